//! The comm stream: a per-rank worker thread that runs collectives in issue order over a
//! synchronous [`Transport`], completing their [`Work`] handles.
//!
//! A caller that waits for a collective which is next in line while the stream is idle runs
//! it on its own thread instead of handing it to the worker and sleeping until the worker hands
//! it back: two thread wake-ups (tens of microseconds each on a busy or virtual machine) saved
//! on every collective that is waited for as soon as it is issued (the loss agreement, a
//! benchmark). [`Communicator::all_reduce_blocking`] goes further: on an idle stream it runs at
//! once on the caller's thread without queueing, so the worker is not even woken (a woken worker
//! that finds nothing to do still takes a core, on a small machine from a peer rank mid-collective).
//! Collectives issued ahead, as DDP issues its buckets during backward, run on the
//! worker while the caller computes, as before.
//!
//! Two options of a stream, each written once and applied to every collective issued through
//! it: tracing ([`CommStream::traced`]: the issue recorded on the caller's thread with its tag,
//! the start and finish as they happen) and a simulated link ([`CommStream::simulated`],
//! [`CommStream::on_link`]: a collective completes at its modelled finish, on the thread
//! that waits for it (or for a work chained on it), else on the link's timer thread, in issue
//! order, while the stream goes on). [`CommStream::plain`] is a handle on the same stream
//! without them, for control messages.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread;
use std::time::{Duration, Instant};

use crate::communicator::{pack_with_side, unpack_with_side};
use crate::error::panic_message;
use crate::sim::{LinkStage, SharedLink};
use crate::trace::Tracing;
use crate::{Buffer, CommError, Communicator, NetModel, OpTiming, Recorder, ReduceOp, RingOp, Work};

/// A synchronous, blocking per-rank backend: each call performs one collective with the peers
/// and returns when this rank's part is done. A backend implements only this; [`CommStream`]
/// turns it into an asynchronous, ordered [`Communicator`]. Calls arrive in issue order, one at
/// a time: from the stream's worker, or from a caller that waits for the collective (see the
/// module docs).
///
/// Implementations must not block forever: every internal wait is bounded by the timeout and
/// fails when a peer is known to be gone.
pub trait Transport: Send + 'static {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// In-place all-reduce (see [`Communicator::all_reduce`]).
    fn all_reduce(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError>;
    /// In-place broadcast from `root`.
    fn broadcast(&mut self, buf: &mut Buffer, root: usize, tag: &str) -> Result<(), CommError>;
    /// All-gather: on success `buf` holds `world_size * len` elements, rank-major.
    fn all_gather(&mut self, buf: &mut Buffer, tag: &str) -> Result<(), CommError>;
    /// Reduce-scatter: on success `buf` holds this rank's chunk of the reduction.
    fn reduce_scatter(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError>;
    /// Barrier over all ranks.
    fn barrier(&mut self, tag: &str) -> Result<(), CommError>;
    /// Called once when the stream shuts down (its communicator was dropped), after every
    /// queued collective ran; `reason` says why, for the peers' error messages.
    fn close(&mut self, reason: &str) {
        let _ = reason;
    }
}

type Job<T> = Box<dyn FnOnce(&mut T) + Send>;

/// The queue of a stream and its transport, shared by the worker and the waiting callers.
struct Core<T> {
    /// Issued collectives not yet started, with their issue numbers.
    queue: VecDeque<(u64, Job<T>)>,
    /// The transport, or `None` while a thread runs a collective on it.
    transport: Option<T>,
    /// Issue number of the next collective.
    next: u64,
    /// Why the stream is closing, once its last handle was dropped.
    closing: Option<String>,
    /// Handles on the stream (the stream and its plain views) not yet dropped.
    handles: usize,
}

struct Shared<T> {
    core: Mutex<Core<T>>,
    /// Tells the worker that there is something to do.
    work: Condvar,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Core<T>> {
        // Jobs run outside the lock and catch their panics: a poisoned lock holds valid state.
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A [`Communicator`] made of a [`Transport`] driven by a worker thread (the comm stream).
/// Issuing a collective moves its buffer into a FIFO and returns at once; collectives execute
/// strictly in issue order, on the worker (or on a caller that waits for the next one while the
/// stream is idle, see the module docs), are stamped when each started and finished, and
/// complete their [`Work`], handing the same buffer back.
///
/// The collectives are the stream's own methods (what a process group calls); its
/// [`Communicator`] implementation, the object-safe face for control messages, forwards to
/// them. Tracing and a simulated link are options of the stream (see the module docs).
///
/// Dropping the stream (and its plain views) lets the worker finish what was queued, then
/// closes the transport (for the thread backend, peers then fail promptly with
/// [`CommError::RankFailed`]).
pub struct CommStream<T: Transport> {
    shared: Arc<Shared<T>>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Records every collective issued through this handle.
    tracing: Option<Tracing>,
    /// Delays every collective issued through this handle to its modelled finish.
    link: Option<Arc<LinkStage>>,
}

impl<T: Transport> CommStream<T> {
    /// Starts the worker thread that owns `transport`; `timeout` bounds [`Work::wait`].
    pub fn new(transport: T, timeout: Duration) -> Self {
        let rank = transport.rank();
        let world_size = transport.world_size();
        let shared = Arc::new(Shared {
            core: Mutex::new(Core {
                queue: VecDeque::new(),
                transport: Some(transport),
                next: 0,
                closing: None,
                handles: 1,
            }),
            work: Condvar::new(),
        });
        let worker = shared.clone();
        thread::Builder::new()
            .name(format!("comm-stream-{rank}"))
            .spawn(move || run_worker(&worker))
            .expect("spawn comm stream thread");
        CommStream {
            shared,
            rank,
            world_size,
            timeout,
            tracing: None,
            link: None,
        }
    }

    /// This stream recording each collective into `recorder`: issued (when called, with the
    /// caller's tag from [`crate::tagging_collectives`]), started and finished on the stream
    /// (when they happen, whether or not anyone waits; with a simulated link, its times).
    pub fn traced(mut self, recorder: Recorder) -> Self {
        self.tracing = Some(Tracing::new(recorder));
        self
    }

    /// This stream as slow as links of `model` (the ring model of [`crate::cost`]), on a link
    /// of this rank's own: each collective starts on the link once its transfer finished and
    /// the previous one left the link (`sim_start = max(finished, previous sim_finish)`) and
    /// completes `model`'s time later, which its work reports as its timing. The thread that
    /// waits for the work (or for one chained on it) sleeps until then and completes it itself,
    /// running what is chained on it, as a waiter on a stream without a link is woken by the
    /// comm thread that finished; with no waiter, the link's timer thread does, while the
    /// stream goes on. Either completes the earlier collectives still pending first: the
    /// stream's collectives complete in issue order. Either sleeps (yielding the core for the last 100 us), so compute keeps
    /// the core. Ranks drift apart by scheduling noise: [`CommStream::on_link`] shares one link
    /// among them.
    pub fn simulated(mut self, model: NetModel) -> Self {
        self.link = Some(Arc::new(LinkStage::own(model, self.rank, self.world_size)));
        self
    }

    /// Like [`CommStream::simulated`], on `link`, the link every rank of the group shares (see
    /// [`SharedLink`]): every rank of a collective gets the same start (when the last rank's
    /// comm thread took it up, the data's real transfer running inside the slot) and finish.
    pub fn on_link(mut self, link: &SharedLink) -> Self {
        self.link = Some(Arc::new(LinkStage::shared(link, self.rank, self.world_size)));
        self
    }

    /// The recorder of a traced stream.
    pub fn recorder(&self) -> Option<&Recorder> {
        self.tracing.as_ref().map(Tracing::recorder)
    }

    /// The link model of a simulated stream.
    pub fn net_model(&self) -> Option<NetModel> {
        self.link.as_ref().map(|l| l.model())
    }

    /// Another handle on this stream, neither traced nor simulated: its collectives join the
    /// same issue order (control messages beside a traced, simulated training stream).
    pub fn plain(&self) -> CommStream<T> {
        self.shared.lock().handles += 1;
        CommStream {
            shared: self.shared.clone(),
            rank: self.rank,
            world_size: self.world_size,
            timeout: self.timeout,
            tracing: None,
            link: None,
        }
    }

    /// This rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// How long [`Work::wait`] and the transport's waits block before failing.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// See [`Communicator::all_reduce`].
    pub fn all_reduce(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        let bytes = buf.byte_len();
        self.issue(RingOp::AllReduce, bytes, tag, all_reduce_op(buf, op))
    }

    /// See [`Communicator::all_reduce_blocking`]: on an idle stream that is not traced, run on
    /// the calling thread (simulated: nothing in flight on the link, and the caller then waits
    /// the link's time itself).
    pub fn all_reduce_blocking(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Result<Buffer, CommError> {
        self.all_reduce_blocking_timed(buf, op, tag).map(|(buf, _)| buf)
    }

    /// See [`Communicator::all_reduce_blocking_timed`]: [`CommStream::all_reduce_blocking`] with
    /// when the collective started and finished (on a simulated link, its slot).
    pub fn all_reduce_blocking_timed(
        &self,
        buf: Buffer,
        op: ReduceOp,
        tag: &str,
    ) -> Result<(Buffer, OpTiming), CommError> {
        if let (None, Some(link)) = (&self.tracing, &self.link) {
            // simulated and idle: the transfer on this thread, then the link's time
            if link.idle() {
                let bytes = buf.byte_len();
                if let Some(mut transport) = self.take_if_idle() {
                    let ticket = link.ticket();
                    ticket.enter();
                    let result = run_caught(all_reduce_op(buf, op), &mut transport, tag);
                    hand_back(&self.shared, transport);
                    return link.hold(ticket, RingOp::AllReduce, bytes, result);
                }
            }
        }
        if self.tracing.is_some() || self.link.is_some() {
            return self.all_reduce(buf, op, tag).wait_timed();
        }
        let started = Instant::now();
        let buf = self.run_now(tag, all_reduce_op(buf, op))?;
        Ok((buf, OpTiming { started, finished: Instant::now() }))
    }

    /// The transport, taken from the stream if it is idle (nothing queued, nothing running),
    /// for the caller to run one collective on and hand back.
    fn take_if_idle(&self) -> Option<T> {
        let mut core = self.shared.lock();
        if !core.queue.is_empty() || core.transport.is_none() {
            return None;
        }
        let transport = core.transport.take()?;
        core.next += 1;
        Some(transport)
    }

    /// See [`Communicator::broadcast`].
    pub fn broadcast(&self, buf: Buffer, root: usize, tag: &str) -> Work<Buffer> {
        let bytes = buf.byte_len();
        self.issue(RingOp::Broadcast, bytes, tag, move |t, tag| {
            let mut buf = buf;
            t.broadcast(&mut buf, root, tag).map(|()| buf)
        })
    }

    /// See [`Communicator::all_gather`].
    pub fn all_gather(&self, buf: Buffer, tag: &str) -> Work<Buffer> {
        let bytes = buf.byte_len();
        self.issue(RingOp::AllGather, bytes, tag, move |t, tag| {
            let mut buf = buf;
            t.all_gather(&mut buf, tag).map(|()| buf)
        })
    }

    /// See [`crate::all_gather_with_side`]: `payload` and `side` in one all-gather.
    pub fn all_gather_with_side(&self, payload: Buffer, side: Buffer, tag: &str) -> Work<(Buffer, Buffer)> {
        let (packed, unpack) = pack_with_side(payload, side);
        self.all_gather(packed, tag)
            .then(move |all| unpack_with_side(all, unpack))
    }

    /// See [`Communicator::reduce_scatter`].
    pub fn reduce_scatter(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        let bytes = buf.byte_len();
        self.issue(RingOp::ReduceScatter, bytes, tag, move |t, tag| {
            let mut buf = buf;
            t.reduce_scatter(&mut buf, op, tag).map(|()| buf)
        })
    }

    /// See [`Communicator::barrier`].
    pub fn barrier(&self, tag: &str) -> Work<()> {
        self.issue(RingOp::Barrier, 0, tag, move |t, tag| t.barrier(tag))
    }

    /// Issues collective `kind` on `bytes` bytes: traced (its issue recorded now, on the
    /// caller's thread), queued, delayed by the simulated link, and watched by the tracer as it
    /// starts and finishes (the link's times, when simulated).
    fn issue<R: Send + 'static>(
        &self,
        kind: RingOp,
        bytes: usize,
        tag: &str,
        op: impl FnOnce(&mut T, &str) -> Result<R, CommError> + Send + 'static,
    ) -> Work<R> {
        let span = self.tracing.as_ref().map(|t| t.issue(self.rank, kind, tag, bytes));
        let work = match &self.link {
            Some(link) => {
                // the link's slot counts from the instant the comm thread takes the collective up
                let ticket = Arc::new(link.ticket());
                let entry = ticket.clone();
                let work = self.submit(tag, move |t: &mut T, tag: &str| {
                    entry.enter();
                    op(t, tag)
                });
                link.delay(ticket, work, kind, bytes, self.timeout)
            }
            None => self.submit(tag, op),
        };
        match (&self.tracing, span) {
            (Some(t), Some(span)) => t.watch(span, work),
            _ => work,
        }
    }

    /// Queues `op` on the stream and returns its work handle.
    fn submit<R: Send + 'static>(
        &self,
        tag: &str,
        op: impl FnOnce(&mut T, &str) -> Result<R, CommError> + Send + 'static,
    ) -> Work<R> {
        let (work, promise) = Work::pending(self.rank, tag, self.timeout);
        let tag = tag.to_string();
        let job: Job<T> = Box::new(move |transport: &mut T| {
            promise.start();
            promise.complete(run_caught(op, transport, &tag));
        });
        let mut core = self.shared.lock();
        let seq = core.next;
        core.next += 1;
        core.queue.push_back((seq, job));
        drop(core);
        self.shared.work.notify_one();
        let shared = Arc::downgrade(&self.shared);
        work.with_helper(Box::new(move || run_if_next(&shared, seq)))
    }

    /// Runs `op` on the calling thread if the stream is idle (nothing queued, nothing running):
    /// the worker is neither woken nor waited for. Otherwise queues it behind the others and
    /// waits, as [`Work::wait`] does.
    fn run_now<R: Send + 'static>(
        &self,
        tag: &str,
        op: impl FnOnce(&mut T, &str) -> Result<R, CommError> + Send + 'static,
    ) -> Result<R, CommError> {
        let mut core = self.shared.lock();
        if !core.queue.is_empty() || core.transport.is_none() {
            drop(core);
            return self.submit(tag, op).wait();
        }
        let mut transport = core.transport.take().expect("checked");
        core.next += 1;
        drop(core);
        let result = run_caught(op, &mut transport, tag);
        hand_back(&self.shared, transport);
        result
    }
}

/// The all-reduce of `buf` as a stream operation, handing the buffer back.
fn all_reduce_op<T: Transport>(
    mut buf: Buffer,
    op: ReduceOp,
) -> impl FnOnce(&mut T, &str) -> Result<Buffer, CommError> + Send + 'static {
    move |t: &mut T, tag: &str| t.all_reduce(&mut buf, op, tag).map(|()| buf)
}

/// Runs `op` on `transport`; a panic in the backend becomes the collective's error.
fn run_caught<T, R>(
    op: impl FnOnce(&mut T, &str) -> Result<R, CommError>,
    transport: &mut T,
    tag: &str,
) -> Result<R, CommError> {
    catch_unwind(AssertUnwindSafe(|| op(transport, tag))).unwrap_or_else(|payload| {
        Err(CommError::Internal(format!(
            "backend panicked in collective `{tag}`: {}",
            panic_message(payload.as_ref())
        )))
    })
}

/// Gives the transport back to the stream after a caller ran a collective on it, and wakes the
/// worker if collectives were issued meanwhile (from another thread) or the stream is closing.
fn hand_back<T: Transport>(shared: &Shared<T>, transport: T) {
    let mut core = shared.lock();
    core.transport = Some(transport);
    let more = !core.queue.is_empty() || core.closing.is_some();
    drop(core);
    if more {
        shared.work.notify_one();
    }
}

/// The worker: runs queued collectives in order while no caller does; at the close, after the
/// last one, closes the transport.
fn run_worker<T: Transport>(shared: &Shared<T>) {
    let mut core = shared.lock();
    loop {
        if core.transport.is_some() {
            if let Some((_, job)) = core.queue.pop_front() {
                let mut transport = core.transport.take().expect("checked");
                drop(core);
                job(&mut transport);
                core = shared.lock();
                core.transport = Some(transport);
                continue;
            }
            if let Some(reason) = core.closing.take() {
                let mut transport = core.transport.take().expect("checked");
                drop(core);
                transport.close(&reason);
                return;
            }
        }
        core = shared.work.wait(core).unwrap_or_else(|e| e.into_inner());
    }
}

/// Runs collective `seq` on the calling thread if it is next in line and the stream is idle
/// (otherwise the worker runs it, or already did).
fn run_if_next<T: Transport>(shared: &Weak<Shared<T>>, seq: u64) {
    let Some(shared) = shared.upgrade() else { return };
    let mut core = shared.lock();
    if core.queue.front().map(|(s, _)| *s) != Some(seq) || core.transport.is_none() {
        return;
    }
    let (_, job) = core.queue.pop_front().expect("checked");
    let mut transport = core.transport.take().expect("checked");
    drop(core);
    job(&mut transport);
    hand_back(&shared, transport);
}

impl<T: Transport> Drop for CommStream<T> {
    fn drop(&mut self) {
        let mut core = self.shared.lock();
        core.handles -= 1;
        if core.handles > 0 {
            return;
        }
        core.closing = Some(if thread::panicking() {
            format!("rank {}'s thread panicked while holding its communicator", self.rank)
        } else {
            format!("rank {} dropped its communicator", self.rank)
        });
        drop(core);
        self.shared.work.notify_one();
    }
}

impl<T: Transport> Communicator for CommStream<T> {
    fn rank(&self) -> usize {
        CommStream::rank(self)
    }

    fn world_size(&self) -> usize {
        CommStream::world_size(self)
    }

    fn timeout(&self) -> Duration {
        CommStream::timeout(self)
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        CommStream::all_reduce(self, buf, op, tag)
    }

    fn all_reduce_blocking(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Result<Buffer, CommError> {
        CommStream::all_reduce_blocking(self, buf, op, tag)
    }

    fn all_reduce_blocking_timed(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Result<(Buffer, OpTiming), CommError> {
        CommStream::all_reduce_blocking_timed(self, buf, op, tag)
    }

    fn broadcast(&self, buf: Buffer, root: usize, tag: &str) -> Work<Buffer> {
        CommStream::broadcast(self, buf, root, tag)
    }

    fn all_gather(&self, buf: Buffer, tag: &str) -> Work<Buffer> {
        CommStream::all_gather(self, buf, tag)
    }

    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        CommStream::reduce_scatter(self, buf, op, tag)
    }

    fn barrier(&self, tag: &str) -> Work<()> {
        CommStream::barrier(self, tag)
    }
}
