//! The CUDA comm stream behind the contract: a bucket's ready event is recorded on the compute
//! stream, the policy's collectives run on NCCL's comm stream after it (in place, on device
//! memory), and at the end of backward the compute stream waits on their completion events.
//! The host never waits: the optimizer's kernels are simply queued behind the collectives.
//!
//! The NCCL collectives handle serves what the all-reduce policy needs (an in-place f32
//! all-reduce of device memory); a policy that issues another collective gets a typed error
//! naming it, until the device seam's NCCL reduce-scatter, all-gather and stream-scoped
//! continuations are wired here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use brigade_comm::nccl::{DeviceBuffer, NcclComm};
use brigade_comm::{Communicator, Recorder, ReduceOp, SpanId};
use brigade_tensor::cuda::CudaDevice;
use brigade_tensor::{DType, Device, Storage, Tensor};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

use super::gpu_clock::{GpuClock, GpuTimeline};
use super::{hand_to_policy, wait_reduction, BucketStream, Failed, InFlight, Landed, ReadyBucket, ReadyEvent};
use crate::collectives::{CollectiveBackend, Collectives, TensorWork};
use crate::policy::ReducerPolicy;
use crate::DdpError;

/// A collective's completion event on the comm stream, with the device whose compute stream
/// must wait on it.
type Completion = (Arc<CudaDevice>, Arc<CudaEvent>);

/// What the stream and its collectives handle share.
struct Shared {
    comm: Arc<NcclComm>,
    recorder: Option<Recorder>,
    timeline: OnceLock<Option<GpuTimeline>>,
    /// The device whose compute stream backward runs on (for the compute spans).
    compute: Option<Arc<CudaDevice>>,
    /// The bucket being handed to its policy, with its ready event (the first collective waits
    /// on it).
    current: Mutex<Option<(usize, Option<Arc<CudaEvent>>)>>,
    /// Completion events of each bucket's collectives, with the device they ran for.
    done: Mutex<HashMap<usize, Vec<Completion>>>,
}

/// Buckets reduced by their policy's collectives on NCCL's own CUDA stream, ordered by events
/// (see the module docs).
pub struct NcclStream {
    shared: Arc<Shared>,
}

impl NcclStream {
    /// Buckets reduced over `comm`.
    pub fn new(comm: Arc<NcclComm>) -> Self {
        NcclStream {
            shared: Arc::new(Shared {
                comm,
                recorder: None,
                timeline: OnceLock::new(),
                compute: None,
                current: Mutex::new(None),
                done: Mutex::new(HashMap::new()),
            }),
        }
    }

    fn shared_mut(&mut self) -> &mut Shared {
        Arc::get_mut(&mut self.shared).expect("NcclStream is configured before it is used")
    }

    /// Also times backward's compute scopes on `device`'s compute stream (CUDA events at every
    /// change of scope) for the timeline, in place of the host's launch times.
    pub fn with_compute_device(mut self, device: Arc<CudaDevice>) -> Self {
        self.shared_mut().compute = Some(device);
        self
    }

    /// Also writes every bucket's collective, timed by its CUDA events on the comm stream, and
    /// its ready event on the compute stream, to `recorder` (the run's timeline).
    pub fn with_recorder(mut self, recorder: Option<Recorder>) -> Self {
        self.shared_mut().recorder = recorder;
        self
    }
}

impl Shared {
    /// The GPU-clock timeline, anchored on first use (`None` without a recorder, or when the
    /// anchor could not be recorded: the run trains on without a GPU timeline).
    fn timeline(&self) -> Option<&GpuTimeline> {
        self.timeline
            .get_or_init(|| {
                let rec = self.recorder.clone()?;
                let clock = GpuClock::new(self.comm.stream()).ok()?;
                Some(GpuTimeline::new(self.comm.rank(), rec, clock))
            })
            .as_ref()
    }

    fn cuda_error(&self, during: String, e: impl std::fmt::Debug) -> DdpError {
        DdpError::Cuda {
            rank: self.comm.rank(),
            during,
            detail: format!("{e:?}"),
        }
    }

    fn device_of(&self, what: &str, device: Device) -> crate::Result<Arc<CudaDevice>> {
        match device {
            Device::Cuda(i) => Ok(CudaDevice::get(i)?),
            Device::Cpu => Err(self.cuda_error(
                format!("{what} with NCCL"),
                "the tensor lives on the CPU: NCCL reduces GPU memory (use --device cuda)",
            )),
        }
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enqueues the in-place all-reduce of `t` on the comm stream; `t` gets its storage back at
    /// once (stream order: whoever reads it next on the compute stream waits on the completion
    /// event first, see `wait`).
    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> crate::Result<()> {
        if t.dtype() != DType::F32 {
            return Err(self.cuda_error(
                format!("all-reducing `{tag}` with NCCL"),
                format!("expected f32 GPU memory, found {}", t.dtype()),
            ));
        }
        let dev = self.device_of(&format!("all-reducing `{tag}`"), t.device())?;
        let numel = t.numel();
        let (slice, _) = t.lend_storage()?.into_cuda_f32().map_err(|s| {
            self.cuda_error(
                format!("handing `{tag}` to NCCL"),
                format!("expected f32 GPU memory, found {:?} on {}", s.dtype(), s.device()),
            )
        })?;
        let (bucket, ready) = Self::lock(&self.current)
            .as_mut()
            .map_or((None, None), |(b, ready)| (Some(*b), ready.take()));
        let timeline = self.timeline();
        if let Some(tl) = timeline {
            // The previous passes' events have completed by now: time them.
            tl.flush();
        }
        let buffer = self
            .comm
            .all_reduce_device(DeviceBuffer::new(slice, ready.clone()), op, tag)?;
        if let (Some(tl), Some(b)) = (timeline, bucket) {
            tl.issued(
                b,
                tag,
                numel * 4,
                ready,
                buffer.started().cloned(),
                buffer.done().cloned(),
            );
        }
        let (slice, done) = buffer.into_parts();
        t.restore_storage(Storage::from_cuda_f32(slice, &dev))?;
        if let (Some(b), Some(done)) = (bucket, done) {
            Self::lock(&self.done).entry(b).or_default().push((dev, done));
        }
        Ok(())
    }
}

/// The NCCL collectives handle (see the module docs).
struct NcclCollectives {
    shared: Arc<Shared>,
}

impl NcclCollectives {
    fn not_yet<T: Send + 'static>(&self, what: &str, tag: &str) -> TensorWork<T> {
        TensorWork::ready(
            self.rank(),
            tag,
            self.timeout(),
            Err(DdpError::Policy {
                policy: "(on the NCCL stream)".into(),
                reason: format!(
                    "{what} `{tag}` does not run on the NCCL stream yet (it serves in-place f32 all-reduces): \
                     run this policy with the thread or MPI backend, host-staged"
                ),
            }),
        )
    }
}

impl CollectiveBackend for NcclCollectives {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.shared.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.shared.comm.world_size()
    }

    fn timeout(&self) -> Duration {
        self.shared.comm.timeout()
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let done = self.shared.all_reduce(t, op, tag).map(|()| t.clone());
        TensorWork::ready(self.rank(), tag, self.timeout(), done)
    }

    fn broadcast(&self, _t: &Tensor, _root: usize, tag: &str) -> TensorWork<Tensor> {
        self.not_yet("broadcast", tag)
    }

    fn reduce_scatter(&self, _t: &Tensor, _op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.not_yet("reduce_scatter", tag)
    }

    fn all_gather(&self, _t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        self.not_yet("all_gather", tag)
    }

    fn all_gather_into(&self, _input: &Tensor, _output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        self.not_yet("all_gather_into", tag)
    }

    fn all_gather_with_side(&self, _p: &Tensor, _s: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        self.not_yet("all_gather_with_side", tag)
    }
}

impl BucketStream for NcclStream {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn collectives(&self) -> Collectives {
        Collectives::new(Arc::new(NcclCollectives {
            shared: self.shared.clone(),
        }))
    }

    fn compute_scope(&self, span: Option<SpanId>) {
        let (Some(dev), Some(timeline)) = (&self.shared.compute, self.shared.timeline()) else {
            return;
        };
        // A failed record leaves the host's launch times in the chart, never fails the run.
        if let Ok(event) = dev.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) {
            timeline.compute_scope(span, Arc::new(event));
        }
    }

    fn record_ready(&self, index: usize, flat: &Tensor) -> crate::Result<ReadyEvent> {
        let dev = self
            .shared
            .device_of(&format!("reducing bucket {index}"), flat.device())?;
        let event = dev
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| {
                self.shared
                    .cuda_error(format!("recording bucket {index}'s ready event"), e)
            })?;
        Ok(ReadyEvent::Cuda(Arc::new(event)))
    }

    fn launch(&self, bucket: ReadyBucket, policy: &mut dyn ReducerPolicy) -> crate::Result<InFlight> {
        let ready = match &bucket.ready {
            ReadyEvent::Cuda(event) => Some(event.clone()),
            ReadyEvent::Host => None,
        };
        *Shared::lock(&self.shared.current) = Some((bucket.bucket.index, ready));
        let launched = hand_to_policy(&self.collectives(), bucket, policy, "nccl");
        *Shared::lock(&self.shared.current) = None;
        launched
    }

    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed> {
        let index = in_flight.index;
        if in_flight.launched_by != "nccl" {
            return Err(Failed {
                error: DdpError::WrongStream {
                    bucket: index,
                    stream: "nccl",
                    launched_by: in_flight.launched_by,
                },
            });
        }
        // The compute stream waits on the comm stream's completion events: the optimizer's
        // kernels queue behind the collectives; the host goes on.
        let events = Shared::lock(&self.shared.done).remove(&index).unwrap_or_default();
        for (dev, done) in events {
            if let Err(e) = dev.stream().wait(&done) {
                let error = self
                    .shared
                    .cuda_error(format!("waiting on bucket {index}'s completion event"), e);
                return Err(Failed { error });
            }
        }
        let landed = wait_reduction(in_flight)?;
        match self.shared.comm.check() {
            Ok(()) => Ok(landed),
            Err(e) => Err(Failed { error: e.into() }),
        }
    }
}
