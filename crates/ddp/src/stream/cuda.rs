//! The NCCL comm stream behind the contract: a bucket's ready event is recorded on the
//! compute stream, the comm stream (a second stream of the same GPU) waits on it, runs the
//! modelled link's delay when one is simulated, averages the bucket in place with NCCL and
//! records a done event; at the end of backward the compute stream waits on that done event.
//! The host never waits: the optimizer's kernels are simply queued behind the collectives.
//!
//! Streams and events are the tensor crate's; the bucket's memory reaches NCCL as comm's raw
//! handles ([`DeviceSpan`]), lent out of its tensor until the compute stream waited on the
//! done event (the keep-alive rule of `brigade_tensor::stream`).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use brigade_comm::nccl::{NcclComm, NcclId};
use brigade_comm::{Communicator, DeviceSpan, NetModel, RawStream, Recorder, ReduceOp, SpanId};
use brigade_tensor::{Device, Event, Stream};

use super::gpu_clock::{GpuClock, GpuTimeline};
use super::{BucketStream, Contents, Failed, InFlight, InFlightOp, Landed, ReadyBucket, ReadyEvent};
use crate::{bucket_tag, DdpError};

/// Buckets averaged by NCCL on a comm stream of their GPU, ordered by events (see the module
/// docs). Reduces with one averaging all-reduce per bucket (communication hooks run on the
/// host stream only).
pub struct NcclStream {
    // Dropped before the streams: the communicator borrows the comm stream.
    comm: Arc<NcclComm>,
    comm_stream: Stream,
    compute: Stream,
    link: Option<NetModel>,
    recorder: Option<Recorder>,
    timeline: OnceLock<Option<GpuTimeline>>,
    /// Whether backward's compute scopes are timed on the compute stream for the timeline.
    time_compute: bool,
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
        // communicator: both live in the `NcclStream`, the communicator dropped first.
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
            comm: Arc::new(comm),
            comm_stream,
            compute,
            link: None,
            recorder: None,
            timeline: OnceLock::new(),
            time_compute: false,
        })
    }

    /// Also times backward's compute scopes on the compute stream (events at every change of
    /// scope) for the timeline, in place of the host's launch times.
    pub fn with_compute_timing(mut self, on: bool) -> Self {
        self.time_compute = on;
        self
    }

    /// Also writes every bucket's collective, timed by its events on the comm stream, and its
    /// ready event on the compute stream, to `recorder` (the run's timeline).
    pub fn with_recorder(mut self, recorder: Option<Recorder>) -> Self {
        self.recorder = recorder;
        self
    }

    /// Simulates `link` on the GPU: before each bucket's all-reduce the comm stream runs a
    /// delay kernel of the modelled all-reduce time (a ring of the world size, at least two
    /// ranks, so that at world size 1 communication still takes the modelled time on the comm
    /// stream and its overlap with backward's kernels shows).
    pub fn with_simulated_link(mut self, link: Option<NetModel>) -> Self {
        self.link = link;
        self
    }

    /// The modelled time of one bucket's all-reduce, if a link is simulated.
    pub fn link_delay(&self, bytes: usize) -> Option<Duration> {
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

    /// Enqueues bucket `index`'s collective on the comm stream; returns (start, done).
    fn enqueue(&self, index: usize, bucket: &ReadyBucket, ready: Option<&Event>) -> crate::Result<(Event, Event)> {
        let tag = bucket_tag(index);
        let s = &self.comm_stream;
        if let Some(r) = ready {
            s.wait_event(r)?;
        }
        let mem = bucket.storage.device_memory(s)?;
        let started = s.record_event()?;
        if let Some(delay) = self.link_delay(mem.len * mem.dtype.size_in_bytes()) {
            s.spin(delay)?;
        }
        let Device::Cuda(ordinal) = mem.device else {
            return Err(self.cuda_error(format!("handing bucket {index} to NCCL"), "not GPU memory"));
        };
        let span = DeviceSpan {
            ptr: mem.ptr,
            len: mem.len,
            dtype: mem.dtype,
            ordinal,
        };
        // SAFETY: `span` is the bucket's memory on the communicator's GPU, lent out of its
        // tensor (nobody else writes it) and kept alive in the `InFlight` until the compute
        // stream waited on `done`; the comm stream waited on the ready event above.
        unsafe { self.comm.all_reduce_device(span, ReduceOp::Avg, None, None, &tag)? };
        let done = s.record_event()?;
        Ok((started, done))
    }
}

impl BucketStream for NcclStream {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn compute_scope(&self, span: Option<SpanId>) {
        if !self.time_compute {
            return;
        }
        let Some(timeline) = self.timeline() else {
            return;
        };
        // A failed record leaves the host's launch times in the chart, never fails the run.
        if let Ok(event) = self.compute.record_event() {
            timeline.compute_scope(span, event);
        }
    }

    fn record_ready(&self, index: usize, storage: &brigade_tensor::Storage) -> crate::Result<ReadyEvent> {
        if storage.device() != self.compute.device() {
            return Err(self.cuda_error(
                format!("recording bucket {index}'s ready event"),
                format!(
                    "the bucket lives on {}, NCCL runs on {}",
                    storage.device(),
                    self.compute.device()
                ),
            ));
        }
        Ok(ReadyEvent::Device(self.compute.record_event()?))
    }

    fn launch(&self, bucket: ReadyBucket) -> crate::Result<InFlight> {
        let index = bucket.index;
        let device = bucket.storage.device();
        let numel = bucket.storage.len();
        if bucket.storage.dtype() != brigade_tensor::DType::F32 || device != self.compute.device() {
            return Err(self.cuda_error(
                format!("handing bucket {index} to NCCL"),
                format!(
                    "expected f32 memory on {}, found {} on {device}",
                    self.compute.device(),
                    bucket.storage.dtype()
                ),
            ));
        }
        let ready = match &bucket.ready {
            ReadyEvent::Device(event) => Some(event.clone()),
            ReadyEvent::Host => None,
        };
        let launched = Instant::now();
        let timeline = self.timeline();
        if let Some(t) = timeline {
            // The previous passes' events have completed by now: time them.
            t.flush();
        }
        let (started, done) = self.enqueue(index, &bucket, ready.as_ref())?;
        if let Some(t) = timeline {
            t.issued(
                index,
                &bucket_tag(index),
                numel * 4,
                ready,
                Some(started),
                Some(done.clone()),
            );
        }
        Ok(InFlight {
            index,
            numel,
            device,
            launched,
            op: InFlightOp::Device {
                storage: bucket.storage,
                done,
            },
        })
    }

    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed> {
        let index = in_flight.index;
        let InFlightOp::Device { storage, done } = in_flight.op else {
            return Err(Failed {
                error: DdpError::WrongStream {
                    bucket: index,
                    stream: "nccl",
                    launched_by: "host",
                },
                storage: None,
            });
        };
        // The compute stream waits on the comm stream's done event: the optimizer's kernels
        // queue behind the collective; the host goes on.
        let waited = self
            .compute
            .wait_event(&done)
            .map_err(|e| self.cuda_error(format!("waiting on bucket {index}'s completion event"), e));
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
