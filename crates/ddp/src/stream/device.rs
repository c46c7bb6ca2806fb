//! The device comm stream behind the contract, written once for every device communicator: a
//! bucket's ready event is recorded on the compute stream; the comm stream (a second stream of
//! the same device) waits on it, and the bucket's **whole policy** — its compute (casts,
//! PowerSGD's matmuls and orthogonalization) and its collectives (all-reduce, reduce-scatter,
//! all-gather, in place on device memory) — is enqueued on the comm stream, in a
//! [`Stream::scope`] of it, with the modelled link's delay before each collective when one is
//! simulated; then a done event is recorded there. At the end of backward the compute stream
//! waits on the done events: the optimizer's kernels simply queue behind the collectives, and
//! the host never waits inside a step.
//!
//! A collective issued outside a bucket's launch (ZeRO's parameter all-gather in its
//! optimizer step, a sharded gradient norm, local SGD's model averaging) is ordered the same
//! way from the issuing stream: the comm stream waits on an event recorded on the caller's
//! current stream, and the caller's stream waits on the collective's done event before its
//! next op (so those collectives do not overlap the caller's next kernels).
//!
//! What moves the bytes is a [`DeviceComm`]: NCCL on a GPU (`NcclStream`, the `cuda`
//! feature), or [`HostStagedComm`] — any [`Communicator`], each collective staged through the
//! host on the comm stream — which runs this same code on the counting fake device, where the
//! fake device's vector clocks refuse any access the events do not order (a race on a GPU):
//! how the CPU tests check the NCCL stream's event logic.
//!
//! Streams and events are the tensor crate's; a tensor's memory reaches NCCL as comm's raw
//! handles ([`brigade_comm::DeviceSpan`]), and stays alive in the tensor the policy's reduction
//! holds until the compute stream waited on the done event (the keep-alive rule of
//! `brigade_tensor::stream`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use brigade_comm::{CommError, Communicator, NetModel, Recorder, ReduceOp, RingOp, SpanId};
use brigade_tensor::{DType, Device, Event, Stream, Tensor};

use super::gpu_clock::{GpuClock, GpuTimeline};
use super::{hand_to_policy, wait_reduction, BucketStream, Failed, InFlight, Landed, ReadyBucket, ReadyEvent};
use crate::collectives::{put_back, spans_storage, take, tensor_of, CollectiveBackend, Collectives, TensorWork};
use crate::policy::ReducerPolicy;
use crate::DdpError;

/// What moves device memory between the ranks for a [`DeviceStream`]: each method enqueues
/// one collective on `stream` (the comm stream; the caller ordered it) and returns once it is
/// enqueued. Every tensor spans its whole storage, lives on the stream's device, and stays
/// alive and unwritten by other streams until the caller's done event completed.
pub trait DeviceComm: Send + Sync + 'static {
    /// A short name for reports and errors (`nccl`, `host-staged`).
    fn name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// How long a wait blocks before it fails.
    fn timeout(&self) -> Duration;
    /// `Err` once the communicator failed (an asynchronous error, a timeout).
    fn check(&self) -> crate::Result<()>;
    /// Reduces `buf` over the ranks, in place.
    fn all_reduce(&self, stream: &Stream, buf: &Tensor, op: ReduceOp, tag: &str) -> crate::Result<()>;
    /// Reduces `send` (`world` equal chunks) and writes this rank's chunk into `recv`.
    fn reduce_scatter(
        &self,
        stream: &Stream,
        send: &Tensor,
        recv: &Tensor,
        op: ReduceOp,
        tag: &str,
    ) -> crate::Result<()>;
    /// Gathers every rank's `send` into `recv` (`world × send.numel()` elements, rank-major).
    fn all_gather(&self, stream: &Stream, send: &Tensor, recv: &Tensor, tag: &str) -> crate::Result<()>;
}

/// What the stream and its collectives handle share.
struct Shared<C> {
    // Dropped before the streams: NCCL's communicator borrows the comm stream.
    comm: C,
    comm_stream: Stream,
    compute: Stream,
    link: Option<NetModel>,
    recorder: Option<Recorder>,
    timeline: OnceLock<Option<GpuTimeline>>,
    /// Whether backward's compute scopes are timed on the compute stream for the timeline.
    time_compute: bool,
    /// The bucket being handed to its policy and the bytes its collectives moved so far.
    current: Mutex<Option<(usize, usize)>>,
    /// Each launched bucket's done event, recorded on the comm stream after its policy's work.
    done: Mutex<HashMap<usize, Event>>,
}

/// Buckets reduced by their policy on a comm stream of their device, ordered by events, with
/// collectives by a [`DeviceComm`] (see the module docs).
pub struct DeviceStream<C: DeviceComm> {
    shared: Arc<Shared<C>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<C: DeviceComm> DeviceStream<C> {
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
            shared: Arc::new(Shared {
                comm,
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

    fn shared_mut(&mut self) -> &mut Shared<C> {
        Arc::get_mut(&mut self.shared).expect("a device stream is configured before it is used")
    }

    /// Also times backward's compute scopes on the compute stream (events at every change of
    /// scope) for the timeline, in place of the host's launch times.
    pub fn with_compute_timing(mut self, on: bool) -> Self {
        self.shared_mut().time_compute = on;
        self
    }

    /// Also writes every bucket's reduction, timed by its events on the comm stream, and its
    /// ready event on the compute stream, to `recorder` (the run's timeline).
    pub fn with_recorder(mut self, recorder: Option<Recorder>) -> Self {
        self.shared_mut().recorder = recorder;
        self
    }

    /// Simulates `link` on the device: before each collective the comm stream runs a delay
    /// kernel of the modelled time of that collective (a ring of the world size, at least two
    /// ranks, so that at world size 1 communication still takes the modelled time on the comm
    /// stream and its overlap with backward's kernels shows).
    pub fn with_simulated_link(mut self, link: Option<NetModel>) -> Self {
        self.shared_mut().link = link;
        self
    }

    /// The modelled time of one all-reduce of `bytes`, if a link is simulated.
    pub fn link_delay(&self, bytes: usize) -> Option<Duration> {
        self.shared.link_delay(RingOp::AllReduce, bytes)
    }

    /// The comm stream (tests read its raw handle in the fake device's log).
    pub fn comm_stream(&self) -> &Stream {
        &self.shared.comm_stream
    }
}

impl<C: DeviceComm> Shared<C> {
    fn link_delay(&self, op: RingOp, bytes: usize) -> Option<Duration> {
        let p = self.comm.world_size().max(2);
        self.link.map(|m| m.time(op, bytes, p))
    }

    /// The device-clock timeline, anchored on first use (`None` without a recorder, or when the
    /// anchor could not be recorded: the run trains on without a device timeline).
    fn timeline(&self) -> Option<&GpuTimeline> {
        self.timeline
            .get_or_init(|| {
                let rec = self.recorder.clone()?;
                let clock = GpuClock::new(&self.comm_stream).ok()?;
                Some(GpuTimeline::new(self.comm.rank(), rec, clock))
            })
            .as_ref()
    }

    fn device_error(&self, during: String, e: impl std::fmt::Display) -> DdpError {
        DdpError::Cuda {
            rank: self.comm.rank(),
            during,
            detail: e.to_string(),
        }
    }

    /// Checks that `t` is a whole buffer on this stream's device that `op` can move.
    fn check_tensor(&self, t: &Tensor, op: RingOp, tag: &str) -> crate::Result<()> {
        let device = self.compute.device();
        let float = matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
        let movable = float || (matches!(op, RingOp::AllGather) && matches!(t.dtype(), DType::U8 | DType::I8));
        if t.device() != device || !spans_storage(t) || !movable {
            return Err(self.device_error(
                format!("handing `{tag}` to {} ({op:?})", self.comm.name()),
                format!(
                    "expected a whole f32, f16 or bf16 buffer (u8 and i8 too for an all-gather) on {device}, found \
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

    /// Enqueues one collective (`enqueue`, on the comm stream) moving `bytes`: inside a
    /// bucket's launch the comm stream is the caller's stream and already behind the ready
    /// event; outside one, the comm stream first waits on the caller's stream and the caller's
    /// stream then waits on the collective.
    fn issue(
        &self,
        op: RingOp,
        bytes: usize,
        enqueue: impl FnOnce(&Stream) -> crate::Result<()>,
    ) -> crate::Result<()> {
        let s = &self.comm_stream;
        let caller = Stream::current(s.device())?;
        let outside = caller != *s;
        if outside {
            s.wait_event(&caller.record_event()?)?;
        }
        if let Some(delay) = self.link_delay(op, bytes) {
            s.spin(delay)?;
        }
        s.scope(|| enqueue(s))?;
        if outside {
            caller.wait_event(&s.record_event()?)?;
        }
        if let Some((_, moved)) = lock(&self.current).as_mut() {
            *moved += bytes;
        }
        Ok(())
    }
}

/// The device collectives handle (see the module docs).
struct DeviceCollectives<C: DeviceComm> {
    shared: Arc<Shared<C>>,
}

fn bytes(t: &Tensor) -> usize {
    t.numel() * t.dtype().size_in_bytes()
}

impl<C: DeviceComm> DeviceCollectives<C> {
    fn done<T: Send + 'static>(&self, tag: &str, value: crate::Result<T>) -> TensorWork<T> {
        TensorWork::ready(self.rank(), tag, self.timeout(), value)
    }

    fn all_gather_checked(&self, input: &Tensor, output: &Tensor, tag: &str) -> crate::Result<()> {
        let sh = &self.shared;
        sh.check_tensor(input, RingOp::AllGather, tag)?;
        sh.check_tensor(output, RingOp::AllGather, tag)?;
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
        sh.issue(RingOp::AllGather, bytes(input), |s| {
            sh.comm.all_gather(s, input, output, tag)
        })
    }
}

impl<C: DeviceComm> CollectiveBackend for DeviceCollectives<C> {
    fn name(&self) -> &'static str {
        self.shared.comm.name()
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
        let sh = &self.shared;
        let done = sh
            .check_tensor(t, RingOp::AllReduce, tag)
            .and_then(|()| sh.issue(RingOp::AllReduce, bytes(t), |s| sh.comm.all_reduce(s, t, op, tag)))
            .map(|()| t.clone());
        self.done(tag, done)
    }

    fn broadcast(&self, _t: &Tensor, _root: usize, tag: &str) -> TensorWork<Tensor> {
        self.done(
            tag,
            Err(DdpError::Policy {
                policy: format!("(on the {} stream)", self.name()),
                reason: format!(
                    "broadcast `{tag}` does not run on the device comm stream (it runs all-reduce, reduce-scatter \
                     and all-gather): run this policy with the thread or MPI backend, host-staged"
                ),
            }),
        )
    }

    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let (sh, world) = (&self.shared, self.world_size());
        let done = (|| {
            sh.check_tensor(t, RingOp::ReduceScatter, tag)?;
            if t.numel() % world != 0 {
                return Err(DdpError::Comm(CommError::InvalidArgument(format!(
                    "reduce-scatter `{tag}`: {} elements do not split into {world} equal chunks",
                    t.numel()
                ))));
            }
            let chunk = Tensor::zeros_on(&[t.numel() / world], t.dtype(), t.device())?;
            sh.issue(RingOp::ReduceScatter, bytes(t), |s| {
                sh.comm.reduce_scatter(s, t, &chunk, op, tag)
            })?;
            Ok(chunk)
        })();
        self.done(tag, done)
    }

    fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let done = (|| {
            let out = Tensor::zeros_on(&[self.world_size(), t.numel()], t.dtype(), t.device())?;
            self.all_gather_checked(t, &out, tag)?;
            Ok(out)
        })();
        self.done(tag, done)
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let done = self.all_gather_checked(input, output, tag).map(|()| output.clone());
        self.done(tag, done)
    }

    fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        // Two all-gathers, in the same order on every rank (device memory of two dtypes is not
        // one buffer).
        let done = (|| {
            let p = self.all_gather(payload, tag).wait()?;
            let s = self.all_gather(side, tag).wait()?;
            Ok((p, s))
        })();
        self.done(tag, done)
    }
}

impl<C: DeviceComm> BucketStream for DeviceStream<C> {
    fn name(&self) -> &'static str {
        self.shared.comm.name()
    }

    fn collectives(&self) -> Collectives {
        Collectives::new(Arc::new(DeviceCollectives {
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
            return Err(self.shared.device_error(
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

    fn launch(&self, bucket: ReadyBucket, policy: &mut dyn ReducerPolicy) -> crate::Result<InFlight> {
        let sh = &self.shared;
        let s = &sh.comm_stream;
        let ready = match &bucket.ready {
            ReadyEvent::Device(event) => Some(event.clone()),
            ReadyEvent::Host => None,
        };
        let (index, tag) = (bucket.bucket.index, bucket.bucket.tag());
        let timeline = sh.timeline();
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
        *lock(&sh.current) = Some((index, 0));
        let launched = s.scope(|| hand_to_policy(&self.collectives(), bucket, policy, self.name()));
        let moved = lock(&sh.current).take().map_or(0, |(_, b)| b);
        let done = s.record_event()?;
        let in_flight = launched?;
        if let Some(tl) = timeline {
            tl.issued(index, &tag, moved, ready, started, Some(done.clone()));
        }
        lock(&sh.done).insert(index, done);
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
        if let Some(done) = lock(&self.shared.done).remove(&index) {
            if let Err(e) = self.shared.compute.wait_event(&done) {
                let error = self
                    .shared
                    .device_error(format!("waiting on bucket {index}'s completion event"), e);
                return Err(Failed { error });
            }
        }
        let landed = wait_reduction(in_flight)?;
        match self.shared.comm.check() {
            Ok(()) => Ok(landed),
            Err(error) => Err(Failed { error }),
        }
    }
}

/// A [`DeviceComm`] over any [`Communicator`] (threads, MPI): each collective copies its input
/// out of device memory on the comm stream, runs on the communicator (the comm stream's caller
/// waits for it), and copies the result back in on the comm stream. On the counting fake device
/// this runs the device stream's exact event logic with thread ranks (every staged copy
/// counted); on a GPU without NCCL it is a correct, slow, device comm stream.
pub struct HostStagedComm {
    comm: Arc<dyn Communicator>,
}

impl HostStagedComm {
    /// Collectives over `comm`.
    pub fn new(comm: Arc<dyn Communicator>) -> HostStagedComm {
        HostStagedComm { comm }
    }

    /// `t`'s elements on the host, copied out on the current stream (`t` keeps its memory).
    fn stage_out(t: &Tensor) -> crate::Result<brigade_comm::Buffer> {
        Ok(take(&t.copy()?)?.0)
    }
}

impl DeviceStream<HostStagedComm> {
    /// Buckets of `device` reduced on a new comm stream of it, collectives staged through the
    /// host over `comm`.
    pub fn host_staged(device: Device, comm: Arc<dyn Communicator>) -> crate::Result<Self> {
        DeviceStream::from_parts(HostStagedComm::new(comm), device, Stream::new(device)?)
    }
}

impl DeviceComm for HostStagedComm {
    fn name(&self) -> &'static str {
        "host-staged"
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn timeout(&self) -> Duration {
        self.comm.timeout()
    }

    fn check(&self) -> crate::Result<()> {
        Ok(())
    }

    fn all_reduce(&self, stream: &Stream, buf: &Tensor, op: ReduceOp, tag: &str) -> crate::Result<()> {
        stream.scope(|| {
            let (b, lent) = take(buf)?;
            let b = self.comm.all_reduce_blocking(b, op, tag)?;
            put_back(buf, b, lent).map(drop)
        })
    }

    fn reduce_scatter(
        &self,
        stream: &Stream,
        send: &Tensor,
        recv: &Tensor,
        op: ReduceOp,
        tag: &str,
    ) -> crate::Result<()> {
        stream.scope(|| {
            let b = self.comm.reduce_scatter(Self::stage_out(send)?, op, tag).wait()?;
            Ok(recv.copy_from(&tensor_of(b, recv.shape(), recv.device())?)?)
        })
    }

    fn all_gather(&self, stream: &Stream, send: &Tensor, recv: &Tensor, tag: &str) -> crate::Result<()> {
        stream.scope(|| {
            let b = self.comm.all_gather(Self::stage_out(send)?, tag).wait()?;
            Ok(recv.copy_from(&tensor_of(b, recv.shape(), recv.device())?)?)
        })
    }
}
