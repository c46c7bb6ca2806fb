//! The device comm stream, written once for every device group: a bucket's ready event is
//! recorded on the compute stream; the comm stream (a second stream of the same device) waits
//! on it, and the bucket's **whole policy** — its compute (casts, PowerSGD's matmuls and
//! orthogonalization) and its collectives (all-reduce, reduce-scatter, all-gather, in place on
//! device memory) — is enqueued on the comm stream, in a [`Stream::scope`] of it; then a done
//! event is recorded there. At the end of backward the compute stream waits on the done events:
//! the optimizer's kernels simply queue behind the collectives, and the host never waits inside
//! a step.
//!
//! What moves the bytes is an inner [`ProcessGroup`] whose work completes once enqueued: NCCL
//! on a GPU (`NcclComm`, the `cuda` feature), or [`HostStaged`] — a host group, each collective
//! staged through the host on the comm stream — which runs this same code on the counting fake
//! device, where the fake device's vector clocks refuse any access the events do not order (a
//! race on a GPU): how the CPU tests check NCCL's event logic.
//!
//! A collective issued outside a bucket's launch (ZeRO's parameter all-gathers, ZeRO-3's per
//! unit, a sharded gradient norm, local SGD's model averaging) is ordered the same way from the
//! issuing stream: the comm stream waits on an event recorded on the caller's current stream,
//! and an event recorded after the collective goes with its work
//! ([`TensorWork::ordered_on_wait`]): the stream of the thread that waits for the work waits
//! on it then. So a gather issued ahead of its use (ZeRO-3's prefetch) runs on the comm stream
//! while the caller's kernels run, and the caller's stream reads its result only behind it; the
//! buffers it used, freed after the wait, are freed behind it too (the keep-alive rule). With a
//! simulated link, a delay kernel of the modelled time runs on the comm stream before each
//! collective.
//!
//! Streams and events are the tensor crate's; a tensor's memory reaches NCCL as comm's raw
//! handles ([`brigade_comm::DeviceSpan`]), and stays alive in the tensor the policy's reduction
//! holds until the compute stream waited on the done event (the keep-alive rule of
//! `brigade_tensor::stream`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use brigade_comm::{CommError, CommMeter, Communicator, NetModel, Recorder, ReduceOp, RingOp, SpanId};
use brigade_tensor::{DType, Device, Event, Stream, Tensor};

use super::gpu_clock::{GpuClock, GpuTimeline};
use super::{bytes, Fail, HostStaged, ProcessGroup, ReadyEvent, TensorWork};
use crate::DdpError;

/// Buckets reduced by their policy on a comm stream of their device, ordered by events, with
/// collectives by a group `G` that enqueues on the device (see the module docs).
pub struct DeviceGroup<G: ProcessGroup + 'static> {
    // Dropped before the stream: NCCL's communicator borrows the comm stream.
    inner: G,
    comm_stream: Stream,
    compute: Stream,
    link: Option<NetModel>,
    recorder: Option<Recorder>,
    timeline: OnceLock<Option<GpuTimeline>>,
    /// Whether backward's compute scopes are timed on the compute stream for the timeline.
    time_compute: bool,
    /// Each bucket being launched: its ready event and, when timed, its start on the comm stream.
    launching: Mutex<HashMap<usize, Launching>>,
    /// Each launched bucket's done event, recorded on the comm stream after its policy's work.
    done: Mutex<HashMap<usize, Event>>,
}

/// A bucket's ready event and, when timed, its start on the comm stream.
type Launching = (Option<Event>, Option<Event>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<G: ProcessGroup + 'static> DeviceGroup<G> {
    /// A group whose collectives `inner` runs on `comm_stream`, a stream of `device` other
    /// than its compute stream (NCCL's communicator was built on it).
    pub fn from_parts(inner: G, device: Device, comm_stream: Stream) -> crate::Result<DeviceGroup<G>> {
        let compute = Stream::compute(device)?;
        if comm_stream.device() != device || comm_stream == compute {
            return Err(DdpError::Cuda {
                rank: inner.rank(),
                during: "building the device comm stream".into(),
                detail: format!(
                    "the comm stream must be a second stream of {device}, got {:?}",
                    comm_stream
                ),
            });
        }
        Ok(DeviceGroup {
            inner,
            comm_stream,
            compute,
            link: None,
            recorder: None,
            timeline: OnceLock::new(),
            time_compute: false,
            launching: Mutex::new(HashMap::new()),
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
        self.link = link;
        self
    }

    /// The modelled time of one all-reduce of `bytes`, if a link is simulated.
    pub fn link_delay(&self, bytes: usize) -> Option<Duration> {
        self.delay(RingOp::AllReduce, bytes)
    }

    /// The comm stream (tests read its raw handle in the fake device's log).
    pub fn comm_stream(&self) -> &Stream {
        &self.comm_stream
    }

    fn delay(&self, op: RingOp, bytes: usize) -> Option<Duration> {
        let p = self.inner.world_size().max(2);
        self.link.map(|m| m.time(op, bytes, p))
    }

    fn device_error(&self, during: String, e: impl std::fmt::Display) -> DdpError {
        DdpError::Cuda {
            rank: self.inner.rank(),
            during,
            detail: e.to_string(),
        }
    }

    /// The device-clock timeline, anchored on first use (`None` without a recorder, or when the
    /// anchor could not be recorded: the run trains on without a device timeline).
    fn timeline(&self) -> Option<&GpuTimeline> {
        self.timeline
            .get_or_init(|| {
                let rec = self.recorder.clone()?;
                let clock = GpuClock::new(&self.comm_stream).ok()?;
                Some(GpuTimeline::new(self.inner.rank(), rec, clock))
            })
            .as_ref()
    }

    /// Checks that `t` is a whole buffer on this stream's device that `op` can move.
    fn check_tensor(&self, t: &Tensor, op: RingOp, tag: &str) -> crate::Result<()> {
        let device = self.comm_stream.device();
        let float = matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
        let movable =
            float || (matches!(op, RingOp::AllGather) && matches!(t.dtype(), DType::U8 | DType::I8 | DType::I64));
        if t.device() != device || !t.spans_storage() || !movable {
            return Err(self.device_error(
                format!("handing `{tag}` to {} ({op:?})", self.inner.name()),
                format!(
                    "expected a whole f32, f16 or bf16 buffer (u8, i8 and i64 too for an all-gather) on {device}, found \
                     {} on {} ({} of {} elements)",
                    t.dtype(),
                    t.device(),
                    t.numel(),
                    t.storage_numel()
                ),
            ));
        }
        Ok(())
    }

    /// Enqueues one collective (`enqueue`, in a scope of the comm stream) moving `bytes`, ordered
    /// as the module docs say; completes with `out`.
    fn issue(
        &self,
        op: RingOp,
        bytes: usize,
        tag: &str,
        out: &Tensor,
        enqueue: impl FnOnce() -> crate::Result<Tensor>,
    ) -> TensorWork<Tensor> {
        let s = &self.comm_stream;
        let mut after = None;
        let done = (|| {
            let caller = Stream::current(s.device())?;
            let outside = caller != *s;
            if outside {
                s.wait_event(&caller.record_event()?)?;
            }
            if let Some(delay) = self.delay(op, bytes) {
                s.spin(delay)?;
            }
            s.scope(enqueue)?;
            if outside {
                after = Some(s.record_event()?);
            }
            Ok(out.clone())
        })();
        let work = TensorWork::ready(self.rank(), tag, self.timeout(), done);
        match after {
            // the caller's stream waits when it waits for the work (or chains on it)
            Some(done) => work.ordered_on_wait(s.device(), done),
            None => work,
        }
    }
}

impl DeviceGroup<HostStaged> {
    /// Buckets of `device` reduced on a new comm stream of it, collectives staged through the
    /// host over `comm`.
    pub fn host_staged(device: Device, comm: Arc<dyn Communicator>) -> crate::Result<Self> {
        DeviceGroup::from_parts(HostStaged::new(comm), device, Stream::new(device)?)
    }
}

impl<G: ProcessGroup + 'static> ProcessGroup for DeviceGroup<G> {
    forward_group!(inner: identity);

    fn enqueues(&self) -> bool {
        true
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        if let Err(e) = self.check_tensor(t, RingOp::AllReduce, tag) {
            return self.failed(e);
        }
        self.issue(RingOp::AllReduce, bytes(t), tag, t, || {
            self.inner.all_reduce(t, op, tag).wait()
        })
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        if let Err(e) = self.check_tensor(input, RingOp::ReduceScatter, tag) {
            return self.failed(e);
        }
        self.issue(RingOp::ReduceScatter, bytes(input), tag, output, || {
            self.inner.reduce_scatter_into(input, output, op, tag).wait()
        })
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let checked = (|| {
            self.check_tensor(input, RingOp::AllGather, tag)?;
            self.check_tensor(output, RingOp::AllGather, tag)?;
            if output.numel() != input.numel() * self.world_size() || output.dtype() != input.dtype() {
                return Err(DdpError::Comm(CommError::InvalidArgument(format!(
                    "all-gather `{tag}`: the output must hold {} x {} {} elements, got {} {}",
                    self.world_size(),
                    input.numel(),
                    input.dtype(),
                    output.numel(),
                    output.dtype()
                ))));
            }
            Ok(())
        })();
        if let Err(e) = checked {
            return self.failed(e);
        }
        self.issue(RingOp::AllGather, bytes(input), tag, output, || {
            self.inner.all_gather_into(input, output, tag).wait()
        })
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
            return Err(self.device_error(
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

    fn launch(&self, index: usize, ready: ReadyEvent) -> crate::Result<Option<Stream>> {
        let s = &self.comm_stream;
        let ready = match ready {
            ReadyEvent::Device(event) => Some(event),
            ReadyEvent::Host => None,
        };
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
        lock(&self.launching).insert(index, (ready, started));
        Ok(Some(s.clone()))
    }

    fn launched(&self, index: usize, meter: &CommMeter) -> crate::Result<()> {
        let done = self.comm_stream.record_event()?;
        let (ready, started) = lock(&self.launching).remove(&index).unwrap_or_default();
        if let Some(tl) = self.timeline() {
            // what the policy's collectives for the bucket handed over (the bucket's meter)
            let moved = meter.totals().payload_bytes as usize;
            tl.issued(
                index,
                &crate::bucket_tag(index),
                moved,
                ready,
                started,
                Some(done.clone()),
            );
        }
        lock(&self.done).insert(index, done);
        Ok(())
    }

    fn wait(&self, index: usize) -> crate::Result<()> {
        // The compute stream waits on the comm stream's done event: the optimizer's kernels
        // queue behind the collectives; the host goes on.
        if let Some(done) = lock(&self.done).remove(&index) {
            if let Err(e) = self.compute.wait_event(&done) {
                return Err(self.device_error(format!("waiting on bucket {index}'s completion event"), e));
            }
        }
        Ok(())
    }
}
