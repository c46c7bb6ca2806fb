//! The CUDA comm stream behind the contract: a bucket's ready event is recorded on the compute
//! stream, NCCL's comm stream waits on it and averages the bucket in place, and at the end of
//! backward the compute stream waits on the completion event. The host never waits: the
//! optimizer's kernels are simply queued behind the collectives.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use brigade_comm::nccl::{DeviceBuffer, NcclComm};
use brigade_comm::{Communicator, Recorder, ReduceOp, SpanId};
use brigade_tensor::cuda::CudaDevice;
use brigade_tensor::{Device, Storage};
use cudarc::driver::sys::CUevent_flags;

use super::gpu_clock::{GpuClock, GpuTimeline};
use super::{BucketStream, Contents, Failed, InFlight, InFlightOp, Landed, ReadyBucket, ReadyEvent};
use crate::{bucket_tag, DdpError};

/// A bucket enqueued on the NCCL comm stream: its memory (reduced in place) and its device.
pub(crate) struct Enqueued {
    buffer: DeviceBuffer,
    dev: Arc<CudaDevice>,
}

/// Buckets averaged by NCCL on the comm's own CUDA stream, ordered by events (see the module
/// docs). Reduces with one averaging all-reduce per bucket (communication hooks run on the
/// host stream only).
pub struct NcclStream {
    comm: Arc<NcclComm>,
    recorder: Option<Recorder>,
    timeline: OnceLock<Option<GpuTimeline>>,
    /// The device whose compute stream backward runs on (for the compute spans).
    compute: Option<Arc<CudaDevice>>,
}

impl NcclStream {
    /// Buckets reduced over `comm`.
    pub fn new(comm: Arc<NcclComm>) -> Self {
        NcclStream {
            comm,
            recorder: None,
            timeline: OnceLock::new(),
            compute: None,
        }
    }

    /// Also times backward's compute scopes on `device`'s compute stream (CUDA events at every
    /// change of scope) for the timeline, in place of the host's launch times.
    pub fn with_compute_device(mut self, device: Arc<CudaDevice>) -> Self {
        self.compute = Some(device);
        self
    }

    /// Also writes every bucket's collective, timed by its CUDA events on the comm stream, and
    /// its ready event on the compute stream, to `recorder` (the run's timeline).
    pub fn with_recorder(mut self, recorder: Option<Recorder>) -> Self {
        self.recorder = recorder;
        self
    }

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

    fn device_of(&self, index: usize, device: Device) -> crate::Result<Arc<CudaDevice>> {
        match device {
            Device::Cuda(i) => Ok(CudaDevice::get(i)?),
            Device::Cpu => Err(self.cuda_error(
                format!("reducing bucket {index} with NCCL"),
                "the bucket lives on the CPU: NCCL reduces GPU memory (use --device cuda)",
            )),
        }
    }
}

impl BucketStream for NcclStream {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn compute_scope(&self, span: Option<SpanId>) {
        let (Some(dev), Some(timeline)) = (&self.compute, self.timeline()) else {
            return;
        };
        // A failed record leaves the host's launch times in the chart, never fails the run.
        if let Ok(event) = dev.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) {
            timeline.compute_scope(span, Arc::new(event));
        }
    }

    fn record_ready(&self, index: usize, storage: &Storage) -> crate::Result<ReadyEvent> {
        let dev = self.device_of(index, storage.device())?;
        let event = dev
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| self.cuda_error(format!("recording bucket {index}'s ready event"), e))?;
        Ok(ReadyEvent::Cuda(Arc::new(event)))
    }

    fn launch(&self, bucket: ReadyBucket) -> crate::Result<InFlight> {
        let index = bucket.index;
        let device = bucket.storage.device();
        let numel = bucket.storage.len();
        let (slice, dev) = bucket.storage.into_cuda_f32().map_err(|s| {
            self.cuda_error(
                format!("handing bucket {index} to NCCL"),
                format!("expected f32 GPU memory, found {:?} on {}", s.dtype(), s.device()),
            )
        })?;
        let ready = match bucket.ready {
            ReadyEvent::Cuda(event) => Some(event),
            ReadyEvent::Host => None,
        };
        let launched = Instant::now();
        let timeline = self.timeline();
        if let Some(t) = timeline {
            // The previous passes' events have completed by now: time them.
            t.flush();
        }
        let tag = bucket_tag(index);
        let buffer = self
            .comm
            .all_reduce_device(DeviceBuffer::new(slice, ready.clone()), ReduceOp::Avg, &tag)?;
        if let Some(t) = timeline {
            t.issued(
                index,
                &tag,
                numel * 4,
                ready,
                buffer.started().cloned(),
                buffer.done().cloned(),
            );
        }
        Ok(InFlight {
            index,
            numel,
            device,
            launched,
            op: InFlightOp::Cuda(Enqueued { buffer, dev }),
        })
    }

    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed> {
        let index = in_flight.index;
        let InFlightOp::Cuda(Enqueued { buffer, dev }) = in_flight.op else {
            return Err(Failed {
                error: DdpError::WrongStream {
                    bucket: index,
                    stream: "nccl",
                    launched_by: "host",
                },
                storage: None,
            });
        };
        let (slice, done) = buffer.into_parts();
        // The compute stream waits on the comm stream's completion event: the optimizer's
        // kernels queue behind the collective; the host goes on.
        let waited = match &done {
            Some(done) => dev
                .stream()
                .wait(done)
                .map_err(|e| self.cuda_error(format!("waiting on bucket {index}'s completion event"), e)),
            None => Ok(()),
        };
        let storage = Storage::from_cuda_f32(slice, &dev);
        match waited.and_then(|()| self.comm.check().map_err(DdpError::from)) {
            Ok(()) => Ok(Landed {
                index,
                contents: Contents::Storage(storage),
                ran: None,
            }),
            Err(error) => Err(Failed {
                error,
                storage: Some(storage),
            }),
        }
    }
}
