//! The device comm stream behind the reducer's contract, written once for every device
//! backend: a bucket's ready event is recorded on the compute stream; the comm stream (a second
//! stream of the same device) waits on it, and the bucket's **whole policy** — its compute
//! (casts, PowerSGD's matmuls and orthogonalization) and its collectives (all-reduce,
//! reduce-scatter, all-gather, in place on device memory, ordered by `device_collectives.rs`) —
//! is enqueued on the comm stream, in a [`Stream::scope`] of it; then a done event is recorded
//! there. At the end of backward the compute stream waits on the done events: the optimizer's
//! kernels simply queue behind the collectives, and the host never waits inside a step.
//!
//! What moves the bytes is a [`CollectiveBackend`] whose work completes once enqueued: NCCL on
//! a GPU (`NcclStream`, the `cuda` feature), or [`HostStagedComm`] — any communicator, each
//! collective staged through the host on the comm stream — which runs this same code on the
//! counting fake device, where the fake device's vector clocks refuse any access the events do
//! not order (a race on a GPU): how the CPU tests check the NCCL stream's event logic.
//!
//! Streams and events are the tensor crate's; a tensor's memory reaches NCCL as comm's raw
//! handles ([`brigade_comm::DeviceSpan`]), and stays alive in the tensor the policy's reduction
//! holds until the compute stream waited on the done event (the keep-alive rule of
//! `brigade_tensor::stream`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use brigade_comm::{Communicator, NetModel, Recorder, RingOp, SpanId};
use brigade_tensor::{Device, Event, Stream, Tensor};

use super::device_collectives::DeviceCollectives;
use super::gpu_clock::{GpuClock, GpuTimeline};
use super::host_staged::HostStagedComm;
use super::{hand_to_policy, wait_reduction, BucketStream, Failed, InFlight, Landed, ReadyBucket, ReadyEvent};
use crate::collectives::{CollectiveBackend, Collectives};
use crate::policy::ReducerPolicy;
use crate::DdpError;

/// Buckets reduced by their policy on a comm stream of their device, ordered by events, with
/// collectives by a [`CollectiveBackend`] that enqueues on the device (see the module docs).
pub struct DeviceStream<C: CollectiveBackend + 'static> {
    collectives: Arc<DeviceCollectives<C>>,
    compute: Stream,
    recorder: Option<Recorder>,
    timeline: OnceLock<Option<GpuTimeline>>,
    /// Whether backward's compute scopes are timed on the compute stream for the timeline.
    time_compute: bool,
    /// Each launched bucket's done event, recorded on the comm stream after its policy's work.
    done: Mutex<HashMap<usize, Event>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<C: CollectiveBackend + 'static> DeviceStream<C> {
    /// A stream whose collectives `comm` runs on `comm_stream`, a stream of `device` other
    /// than its compute stream (NCCL's communicator was built on it).
    pub fn from_parts(comm: C, device: Device, comm_stream: Stream) -> crate::Result<DeviceStream<C>> {
        let compute = Stream::compute(device)?;
        if comm_stream.device() != device || comm_stream == compute {
            return Err(DdpError::Cuda {
                rank: comm.rank(),
                during: "building the device comm stream".into(),
                detail: format!(
                    "the comm stream must be a second stream of {device}, got {:?}",
                    comm_stream
                ),
            });
        }
        Ok(DeviceStream {
            collectives: Arc::new(DeviceCollectives::new(comm, comm_stream)),
            compute,
            recorder: None,
            timeline: OnceLock::new(),
            time_compute: false,
            done: Mutex::new(HashMap::new()),
        })
    }

    /// Also times backward's compute scopes on the compute stream (events at every change of
    /// scope) for the timeline, in place of the host's launch times.
    pub fn with_compute_timing(mut self, on: bool) -> Self {
        self.time_compute = on;
        self
    }

    /// Also writes every bucket's reduction, timed by its events on the comm stream, and its
    /// ready event on the compute stream, to `recorder` (the run's timeline).
    pub fn with_recorder(mut self, recorder: Option<Recorder>) -> Self {
        self.recorder = recorder;
        self
    }

    /// Simulates `link` on the device: before each collective the comm stream runs a delay
    /// kernel of the modelled time of that collective (a ring of the world size, at least two
    /// ranks, so that at world size 1 communication still takes the modelled time on the comm
    /// stream and its overlap with backward's kernels shows).
    pub fn with_simulated_link(mut self, link: Option<NetModel>) -> Self {
        Arc::get_mut(&mut self.collectives)
            .expect("a device stream is configured before it is used")
            .link = link;
        self
    }

    /// The modelled time of one all-reduce of `bytes`, if a link is simulated.
    pub fn link_delay(&self, bytes: usize) -> Option<Duration> {
        self.collectives.link_delay(RingOp::AllReduce, bytes)
    }

    /// The comm stream (tests read its raw handle in the fake device's log).
    pub fn comm_stream(&self) -> &Stream {
        &self.collectives.comm_stream
    }

    /// The device-clock timeline, anchored on first use (`None` without a recorder, or when the
    /// anchor could not be recorded: the run trains on without a device timeline).
    fn timeline(&self) -> Option<&GpuTimeline> {
        self.timeline
            .get_or_init(|| {
                let rec = self.recorder.clone()?;
                let clock = GpuClock::new(&self.collectives.comm_stream).ok()?;
                Some(GpuTimeline::new(self.collectives.rank(), rec, clock))
            })
            .as_ref()
    }
}

impl DeviceStream<HostStagedComm> {
    /// Buckets of `device` reduced on a new comm stream of it, collectives staged through the
    /// host over `comm`.
    pub fn host_staged(device: Device, comm: Arc<dyn Communicator>) -> crate::Result<Self> {
        DeviceStream::from_parts(HostStagedComm::new(comm), device, Stream::new(device)?)
    }
}

impl<C: CollectiveBackend + 'static> BucketStream for DeviceStream<C> {
    fn name(&self) -> &'static str {
        self.collectives.name()
    }

    fn collectives(&self) -> Collectives {
        Collectives::new(self.collectives.clone())
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

    fn record_ready(&self, index: usize, flat: &Tensor) -> crate::Result<ReadyEvent> {
        let compute = &self.compute;
        if flat.device() != compute.device() {
            return Err(self.collectives.device_error(
                format!("recording bucket {index}'s ready event"),
                format!(
                    "the bucket lives on {}, the comm stream runs on {}",
                    flat.device(),
                    compute.device()
                ),
            ));
        }
        Ok(ReadyEvent::Device(compute.record_event()?))
    }

    fn launch(
        &self,
        bucket: ReadyBucket,
        policy: &mut dyn ReducerPolicy,
        collectives: &Collectives,
    ) -> crate::Result<InFlight> {
        let sh = &self.collectives;
        let s = &sh.comm_stream;
        let ready = match &bucket.ready {
            ReadyEvent::Device(event) => Some(event.clone()),
            ReadyEvent::Host => None,
        };
        let (index, tag) = (bucket.bucket.index, bucket.bucket.tag());
        let timeline = self.timeline();
        if let Some(tl) = timeline {
            // The previous passes' events have completed by now: time them.
            tl.flush();
        }
        // Everything the policy does for this bucket runs on the comm stream, behind the
        // bucket's ready event.
        if let Some(r) = &ready {
            s.wait_event(r)?;
        }
        // (timed only for the timeline: an event nobody waits on costs a record)
        let started = timeline.map(|_| s.record_event()).transpose()?;
        let launched = s.scope(|| hand_to_policy(collectives, bucket, policy, self.name()));
        let done = s.record_event()?;
        let in_flight = launched?;
        // what the policy's collectives for the bucket handed over so far (the bucket's meter)
        let moved = in_flight.meter.totals().payload_bytes as usize;
        if let Some(tl) = timeline {
            tl.issued(index, &tag, moved, ready, started, Some(done.clone()));
        }
        lock(&self.done).insert(index, done);
        Ok(in_flight)
    }

    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed> {
        let index = in_flight.index;
        if in_flight.launched_by != self.name() {
            return Err(Failed {
                error: DdpError::WrongStream {
                    bucket: index,
                    stream: self.name(),
                    launched_by: in_flight.launched_by,
                },
            });
        }
        // The compute stream waits on the comm stream's done event: the optimizer's kernels
        // queue behind the collectives; the host goes on.
        if let Some(done) = lock(&self.done).remove(&index) {
            if let Err(e) = self.compute.wait_event(&done) {
                let error = self
                    .collectives
                    .device_error(format!("waiting on bucket {index}'s completion event"), e);
                return Err(Failed { error });
            }
        }
        let landed = wait_reduction(in_flight)?;
        match self.collectives.check() {
            Ok(()) => Ok(landed),
            Err(error) => Err(Failed { error }),
        }
    }
}
