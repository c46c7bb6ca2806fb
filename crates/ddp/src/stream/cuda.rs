//! The NCCL comm stream behind the contract: a bucket's ready event is recorded on the
//! compute stream; the bucket goes to its reducer policy with the NCCL collectives handle,
//! whose collectives run on the comm stream (a second stream of the same GPU) after the ready
//! event, in place on device memory (with the modelled link's delay first, when one is
//! simulated), each followed by a done event; at the end of backward the compute stream waits
//! on those done events. The host never waits: the optimizer's kernels are simply queued
//! behind the collectives.
//!
//! Streams and events are the tensor crate's; a tensor's memory reaches NCCL as comm's raw
//! handles ([`DeviceSpan`]), and stays alive in the tensor the policy's reduction holds until
//! the compute stream waited on the done event (the keep-alive rule of
//! `brigade_tensor::stream`).
//!
//! The handle serves what the all-reduce policy needs (an in-place f32 all-reduce of a whole
//! bucket); a policy that issues another collective gets a typed error naming it, and runs
//! host-staged over the thread or MPI backend instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use brigade_comm::nccl::{NcclComm, NcclId};
use brigade_comm::{Communicator, DeviceSpan, NetModel, RawStream, Recorder, ReduceOp, SpanId};
use brigade_tensor::{DType, Device, Event, Stream, Tensor};

use super::gpu_clock::{GpuClock, GpuTimeline};
use super::{hand_to_policy, wait_reduction, BucketStream, Failed, InFlight, Landed, ReadyBucket, ReadyEvent};
use crate::collectives::{spans_storage, CollectiveBackend, Collectives, TensorWork};
use crate::policy::ReducerPolicy;
use crate::DdpError;

/// What the stream and its collectives handle share.
struct Shared {
    // Dropped before the streams: the communicator borrows the comm stream.
    comm: Arc<NcclComm>,
    comm_stream: Stream,
    compute: Stream,
    link: Option<NetModel>,
    recorder: Option<Recorder>,
    timeline: OnceLock<Option<GpuTimeline>>,
    /// Whether backward's compute scopes are timed on the compute stream for the timeline.
    time_compute: bool,
    /// The bucket being handed to its policy, with its ready event (the first collective waits
    /// on it).
    current: Mutex<Option<(usize, Option<Event>)>>,
    /// Done events of each bucket's collectives, recorded on the comm stream.
    done: Mutex<HashMap<usize, Vec<Event>>>,
}

/// Buckets reduced by their policy's collectives on NCCL, on a comm stream of their GPU,
/// ordered by events (see the module docs).
pub struct NcclStream {
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl NcclStream {
    /// Rank `rank` of `world_size` joins the NCCL communicator `id` on CUDA device `device`,
    /// with a new comm stream of that device (the NCCL communicator runs there); the compute
    /// stream is the device's. Blocks until every rank joined (at most `timeout`).
    pub fn join(
        device: Device,
        rank: usize,
        world_size: usize,
        id: NcclId,
        timeout: Duration,
    ) -> crate::Result<NcclStream> {
        let Device::Cuda(ordinal) = device else {
            return Err(DdpError::Cuda {
                rank,
                during: "joining NCCL".into(),
                detail: format!("the buckets live on {device}: NCCL reduces GPU memory (use --device cuda)"),
            });
        };
        let compute = Stream::compute(device)?;
        let comm_stream = Stream::new(device)?;
        // SAFETY: `comm_stream` is a live stream of device `ordinal`, and it outlives the
        // communicator: both live in `Shared`, the communicator dropped first.
        let comm = unsafe {
            NcclComm::new(
                ordinal,
                RawStream(comm_stream.raw_handle()),
                rank,
                world_size,
                id,
                timeout,
            )?
        };
        Ok(NcclStream {
            shared: Arc::new(Shared {
                comm: Arc::new(comm),
                comm_stream,
                compute,
                link: None,
                recorder: None,
                timeline: OnceLock::new(),
                time_compute: false,
                current: Mutex::new(None),
                done: Mutex::new(HashMap::new()),
            }),
        })
    }

    fn shared_mut(&mut self) -> &mut Shared {
        Arc::get_mut(&mut self.shared).expect("NcclStream is configured before it is used")
    }

    /// Also times backward's compute scopes on the compute stream (events at every change of
    /// scope) for the timeline, in place of the host's launch times.
    pub fn with_compute_timing(mut self, on: bool) -> Self {
        self.shared_mut().time_compute = on;
        self
    }

    /// Also writes every bucket's collective, timed by its events on the comm stream, and its
    /// ready event on the compute stream, to `recorder` (the run's timeline).
    pub fn with_recorder(mut self, recorder: Option<Recorder>) -> Self {
        self.shared_mut().recorder = recorder;
        self
    }

    /// Simulates `link` on the GPU: before each all-reduce the comm stream runs a delay kernel
    /// of the modelled all-reduce time (a ring of the world size, at least two ranks, so that
    /// at world size 1 communication still takes the modelled time on the comm stream and its
    /// overlap with backward's kernels shows).
    pub fn with_simulated_link(mut self, link: Option<NetModel>) -> Self {
        self.shared_mut().link = link;
        self
    }

    /// The modelled time of one all-reduce of `bytes`, if a link is simulated.
    pub fn link_delay(&self, bytes: usize) -> Option<Duration> {
        self.shared.link_delay(bytes)
    }
}

impl Shared {
    fn link_delay(&self, bytes: usize) -> Option<Duration> {
        self.link
            .map(|m| m.all_reduce_time(bytes, self.comm.world_size().max(2)))
    }

    /// The GPU-clock timeline, anchored on first use (`None` without a recorder, or when the
    /// anchor could not be recorded: the run trains on without a GPU timeline).
    fn timeline(&self) -> Option<&GpuTimeline> {
        self.timeline
            .get_or_init(|| {
                let rec = self.recorder.clone()?;
                let clock = GpuClock::new(&self.comm_stream).ok()?;
                Some(GpuTimeline::new(self.comm.rank(), rec, clock))
            })
            .as_ref()
    }

    fn cuda_error(&self, during: String, e: impl std::fmt::Display) -> DdpError {
        DdpError::Cuda {
            rank: self.comm.rank(),
            during,
            detail: e.to_string(),
        }
    }

    /// Enqueues the in-place all-reduce of `t` (f32, a whole storage on the compute stream's
    /// GPU) on the comm stream, after the current bucket's ready event; records its done event
    /// for `wait`. `t` keeps its memory (and keeps it alive) throughout.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> crate::Result<()> {
        let device = self.compute.device();
        if t.dtype() != DType::F32 || t.device() != device || !spans_storage(t) {
            return Err(self.cuda_error(
                format!("handing `{tag}` to NCCL"),
                format!(
                    "expected a whole f32 buffer on {device}, found {} on {} ({} of {} elements)",
                    t.dtype(),
                    t.device(),
                    t.numel(),
                    t.storage_numel()
                ),
            ));
        }
        let Device::Cuda(ordinal) = device else {
            return Err(self.cuda_error(format!("handing `{tag}` to NCCL"), "not GPU memory"));
        };
        let (bucket, ready) = lock(&self.current)
            .as_mut()
            .map_or((None, None), |(b, ready)| (Some(*b), ready.take()));
        let timeline = self.timeline();
        if let Some(tl) = timeline {
            // The previous passes' events have completed by now: time them.
            tl.flush();
        }
        let s = &self.comm_stream;
        if let Some(r) = &ready {
            s.wait_event(r)?;
        }
        let storage = t.lend_storage()?;
        let enqueued = (|| -> crate::Result<(Event, Event)> {
            let mem = storage.device_memory(s)?;
            let started = s.record_event()?;
            if let Some(delay) = self.link_delay(mem.len * mem.dtype.size_in_bytes()) {
                s.spin(delay)?;
            }
            let span = DeviceSpan {
                ptr: mem.ptr,
                len: mem.len,
                dtype: mem.dtype,
                ordinal,
            };
            // SAFETY: `span` is `t`'s whole memory on the communicator's GPU, lent out of the
            // tensor (nobody else writes it) and, once restored, kept alive by the tensor the
            // reduction holds until the compute stream waited on `done`; the comm stream
            // waited on the ready event above.
            unsafe { self.comm.all_reduce_device(span, op, None, None, tag)? };
            Ok((started, s.record_event()?))
        })();
        t.restore_storage(storage)?;
        let (started, done) = enqueued?;
        if let (Some(tl), Some(b)) = (timeline, bucket) {
            tl.issued(b, tag, t.numel() * 4, ready, Some(started), Some(done.clone()));
        }
        if let Some(b) = bucket {
            lock(&self.done).entry(b).or_default().push(done);
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
        if !self.shared.time_compute {
            return;
        }
        let Some(timeline) = self.shared.timeline() else {
            return;
        };
        // A failed record leaves the host's launch times in the chart, never fails the run.
        if let Ok(event) = self.shared.compute.record_event() {
            timeline.compute_scope(span, event);
        }
    }

    fn record_ready(&self, index: usize, flat: &Tensor) -> crate::Result<ReadyEvent> {
        let compute = &self.shared.compute;
        if flat.device() != compute.device() {
            return Err(self.shared.cuda_error(
                format!("recording bucket {index}'s ready event"),
                format!(
                    "the bucket lives on {}, NCCL runs on {}",
                    flat.device(),
                    compute.device()
                ),
            ));
        }
        Ok(ReadyEvent::Device(compute.record_event()?))
    }

    fn launch(&self, bucket: ReadyBucket, policy: &mut dyn ReducerPolicy) -> crate::Result<InFlight> {
        let ready = match &bucket.ready {
            ReadyEvent::Device(event) => Some(event.clone()),
            ReadyEvent::Host => None,
        };
        *lock(&self.shared.current) = Some((bucket.bucket.index, ready));
        let launched = hand_to_policy(&self.collectives(), bucket, policy, "nccl");
        *lock(&self.shared.current) = None;
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
        // The compute stream waits on the comm stream's done events: the optimizer's kernels
        // queue behind the collectives; the host goes on.
        let events = lock(&self.shared.done).remove(&index).unwrap_or_default();
        for done in events {
            if let Err(e) = self.shared.compute.wait_event(&done) {
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
