//! The one collective contract between a reducer policy and the wire: [`ProcessGroup`]
//! (PyTorch's `ProcessGroup`), tensor-level collectives that each return a [`TensorWork`]
//! future, beside the two stream hooks a device needs (`record_ready`, `launch`'s scope, `wait`),
//! which are no-ops on the host.
//!
//! The life of one bucket (PyTorch's reducer with `ProcessGroupNCCL`, llm.c's
//! `multi_gpu_async_reduce_gradient`):
//!
//! 1. [`ProcessGroup::record_ready`]: on the compute side, the moment the bucket's last
//!    gradient is written, a *ready event* is recorded (CUDA: an event on the compute stream;
//!    CPU: the host wrote every gradient before announcing it, so readiness is the call itself).
//! 2. [`ProcessGroup::launch`]: the group says where the bucket's reduction runs (a device
//!    group: on its comm stream, behind the ready event), the reducer hands the bucket to its
//!    policy there, the policy issues its collectives through the group and returns the future
//!    of its [`crate::policy::Reduction`], and [`ProcessGroup::launched`] closes the launch (a
//!    device group records its done event). Buckets are launched strictly in bucket order, the
//!    same on every rank.
//! 3. [`ProcessGroup::wait`]: at the end of backward, before the reducer waits on each
//!    reduction's future, the compute side is ordered behind the bucket's collectives (CUDA:
//!    the compute stream waits on the comm stream's done event; the host does nothing).
//!
//! The groups:
//! - [`HostGroup`]: a rank's [`brigade_comm::CommStream`] (threads, MPI) and its work
//!   handles, calling the stream's own collectives; a tensor that spans its storage is lent to the collective without a copy
//!   ([`Tensor::lend_buffer`], [`Tensor::restore_buffer`]: the bucket's bytes change form twice),
//!   device memory is staged through the host.
//! - [`DeviceGroup`]: a device's comm stream, ordered by events, over a group whose work
//!   completes once enqueued: NCCL (`NcclComm`, the `cuda` feature) or [`HostStaged`] (a host
//!   group, each collective staged through the host and waited on), which runs NCCL's code path
//!   on the counting fake device in CPU tests.
//! - Wrappers, each written once over any group: [`Metered`] (DDP's meter, and each
//!   collective attributed to its bucket) and [`Recording`] (the order of the stream hooks, for
//!   tests); what they and the device group pass through unchanged is written once
//!   (`forward.rs`). Tracing and the simulated link are options of the comm stream below a host group
//!   (one implementation each in `brigade-comm`, shared with the trainer's control messages).
//!
//! What each collective does with its input:
//! - `all_reduce` and `broadcast` work in place: the result lands in the tensor's own storage
//!   (and its views) and the work completes with the tensor;
//! - `reduce_scatter_into` and `all_gather_into` write into an output the caller holds
//!   (`all_gather_into`: `world × n` elements, rank-major) and complete with it; on a host
//!   group they consume their input's storage when they could lend it (the input reads
//!   `StorageLent` afterwards);
//! - `reduce_scatter` and `all_gather` complete with a new tensor (this rank's chunk; every
//!   rank's input as `[world, n]`); `all_gather_sparse` with every rank's values and `I64`
//!   indices ([`SparseGather`]).
//!
//! Collectives move f32, f16, bf16 and the integer types (u8, i8, i64: indices, quantized
//! payloads) and f64; reductions take the floating types only.

// first: the wrappers below use its macro
#[macro_use]
mod forward;
mod device;
mod gpu_clock;
mod host;
mod host_staged;
mod metered;
#[cfg(feature = "cuda")]
mod nccl;
mod recording;
mod sparse;

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{CommError, CommMeter, OpTiming, ReduceOp, SpanId, Work};
use brigade_tensor::{Device, Event, MemoryMeter, Stream, Tensor};

use crate::{DdpError, Result};

pub use device::DeviceGroup;
pub use host::HostGroup;
pub use host_staged::HostStaged;
pub(crate) use metered::LinkTime;
pub use metered::Metered;
#[cfg(feature = "cuda")]
pub use nccl::NcclGroup;
pub use recording::{Recording, StreamEvent};
pub use sparse::SparseGather;

/// A shared process group: what policies hold and clone into their continuations.
pub type Group = Arc<dyn ProcessGroup>;

/// What the compute side recorded when a bucket's last gradient was written.
#[derive(Debug, Clone)]
pub enum ReadyEvent {
    /// The host wrote every gradient before announcing it: nothing left to wait on.
    Host,
    /// An event on the bucket device's compute stream, after the kernels that wrote it.
    Device(Event),
}

/// One rank's collectives on tensors, and the stream hooks around a bucket's reduction (see
/// the module docs). Every collective returns at once; a device group's work completes once
/// enqueued. A group implements the in-place three (`all_reduce`, `reduce_scatter_into`,
/// `all_gather_into`); the others have defaults composed of them (a new output tensor, two
/// all-gathers for a side buffer, no broadcast or barrier), which the host group replaces with
/// its own (lending storage, one collective).
pub trait ProcessGroup: Send + Sync {
    /// A short name for reports and errors (`host`, `nccl`, `host-staged`).
    fn name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// How long a wait blocks before it fails.
    fn timeout(&self) -> Duration;
    /// Whether a work completes once its collective is enqueued on a device stream (a device
    /// group: its values are there for that stream's later work, not yet for the host), rather
    /// than once its values are there (the host group, the default).
    fn enqueues(&self) -> bool {
        false
    }
    /// `Err` once the group failed asynchronously (NCCL's error, a timeout); the host group
    /// reports every error through its works instead.
    fn check(&self) -> Result<()> {
        Ok(())
    }

    /// Reduces `t` over every rank in place; completes with `t` holding the result.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor>;
    /// Reduces `input` (`world` equal chunks) over every rank into `output` (one chunk, the same
    /// dtype and device, spanning its storage); completes with `output`.
    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor>;
    /// Every rank's `input` (same shape everywhere), rank-major, into `output` (`world ×
    /// input.numel()` elements of the same dtype, spanning its storage, lent meanwhile);
    /// completes with `output`.
    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor>;

    /// Copies `root`'s `t` into every rank's `t`; completes with `t`. By default a typed error:
    /// a device comm stream runs all-reduce, reduce-scatter and all-gather only.
    fn broadcast(&self, _t: &Tensor, _root: usize, tag: &str) -> TensorWork<Tensor> {
        self.failed(unsupported(self.name(), "broadcast", tag))
    }
    /// Completes once every rank reached it. By default a typed error, as `broadcast`.
    fn barrier(&self, tag: &str) -> TensorWork<()> {
        self.failed(unsupported(self.name(), "barrier", tag))
    }
    /// This rank's chunk (`numel / world` elements) of the reduction of `t`, as a new 1-D tensor.
    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let world = self.world_size();
        if t.numel() % world != 0 {
            return self.failed(DdpError::Comm(CommError::InvalidArgument(format!(
                "reduce-scatter `{tag}`: {} elements do not split into {world} equal chunks",
                t.numel()
            ))));
        }
        match Tensor::zeros_on(&[t.numel() / world], t.dtype(), t.device()) {
            Ok(chunk) => self.reduce_scatter_into(t, &chunk, op, tag),
            Err(e) => self.failed(e.into()),
        }
    }
    /// Every rank's elements, rank-major, as a new `[world, numel]` tensor.
    fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        match Tensor::zeros_on(&[self.world_size(), t.numel()], t.dtype(), t.device()) {
            Ok(out) => self.all_gather_into(t, &out, tag),
            Err(e) => self.failed(e.into()),
        }
    }
    /// Every rank's `payload` and small `side` tensor (scales, indices), rank-major (`[world,
    /// n]`, `[world, k]`). By default two all-gathers, payload then side, the same order on
    /// every rank (memory of two dtypes is not one buffer); the host group sends both in one
    /// message. How an integer payload is reduced: gather it with its scales, dequantize each
    /// row with its own rank's scales, sum in f32 (see [`brigade_comm::DType`]).
    fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        let both = self
            .all_gather(payload, tag)
            .wait()
            .and_then(|p| Ok((p, self.all_gather(side, tag).wait()?)));
        TensorWork::ready(self.rank(), tag, self.timeout(), both)
    }
    /// Every rank's sparse payload: `values` (1-d) and their positions `indices` (1-d `I64`, as
    /// long), at most `capacity` entries, a count that may differ on every rank (every rank
    /// passes the same `capacity` and dtype). One all-gather of `capacity` values and `1 +
    /// capacity` `I64`s (the count, the indices) per rank, through
    /// [`ProcessGroup::all_gather_with_side`]; completes with every rank's entries as
    /// [`SparseGather`] (rows padded to the capacity), never reading back to the host.
    fn all_gather_sparse(
        &self,
        values: &Tensor,
        indices: &Tensor,
        capacity: usize,
        tag: &str,
    ) -> TensorWork<SparseGather> {
        match sparse::pack(values, indices, capacity, tag) {
            Ok((v, side)) => self
                .all_gather_with_side(&v, &side, tag)
                .then(move |(v, side)| sparse::unpack(v, side, capacity)),
            Err(e) => self.failed(e),
        }
    }

    /// Compute side: bucket `index`, whose flat buffer is `flat`, is fully written; record its
    /// ready event. The host: nothing to record.
    fn record_ready(&self, index: usize, flat: &Tensor) -> Result<ReadyEvent> {
        let _ = (index, flat);
        Ok(ReadyEvent::Host)
    }
    /// Comm side: bucket `index`'s reduction is about to be issued: the stream it runs on (a
    /// device group: its comm stream, now behind `ready`; the reducer runs the policy in a
    /// [`Stream::scope`] of it), or `None` for the caller's own (the host).
    fn launch(&self, index: usize, ready: ReadyEvent) -> Result<Option<Stream>> {
        let _ = (index, ready);
        Ok(None)
    }
    /// Comm side: the policy issued bucket `index`'s reduction, whose collectives handed over
    /// what `meter` counted (a device group records its done event, and times it for the
    /// timeline). The host: nothing.
    fn launched(&self, index: usize, meter: &CommMeter) -> Result<()> {
        let _ = (index, meter);
        Ok(())
    }
    /// Compute side: orders what follows behind bucket `index`'s launched work (a device group:
    /// the compute stream waits on its done event). The host: nothing; the reducer waits on the
    /// reduction's future after this.
    fn wait(&self, index: usize) -> Result<()> {
        let _ = index;
        Ok(())
    }
    /// Compute side, for the timeline: backward's kernels from now on belong to the host span
    /// `span` the reducer just began (`None`: the open one ended). A group that times the
    /// compute stream itself (a device group: an event at every change) moves the span onto the
    /// device clock once its events completed ([`brigade_comm::Recorder::retime`]).
    fn compute_scope(&self, span: Option<SpanId>) {
        let _ = span;
    }
}

impl dyn ProcessGroup {
    /// A work already completed with `value` (a policy that sends nothing for a bucket, e.g.
    /// local SGD between averagings, returns its bucket this way).
    pub fn ready<T: Send + 'static>(&self, value: T) -> TensorWork<T> {
        TensorWork::ready(self.rank(), "ready", self.timeout(), Ok(value))
    }

    /// A work already failed with `error`.
    pub fn failed<T: Send + 'static>(&self, error: DdpError) -> TensorWork<T> {
        Fail::failed(self, error)
    }
}

/// The failed work every default and every group returns for an error found before issuing
/// (for any group type, where `dyn ProcessGroup`'s own `failed` needs a trait object).
trait Fail {
    fn failed<T: Send + 'static>(&self, error: DdpError) -> TensorWork<T>;
}

impl<G: ProcessGroup + ?Sized> Fail for G {
    fn failed<T: Send + 'static>(&self, error: DdpError) -> TensorWork<T> {
        TensorWork::ready(self.rank(), "failed", self.timeout(), Err(error))
    }
}

fn unsupported(group: &str, what: &str, tag: &str) -> DdpError {
    DdpError::Policy {
        policy: format!("(on the {group} stream)"),
        reason: format!(
            "{what} `{tag}` does not run on the device comm stream (it runs all-reduce, reduce-scatter and \
             all-gather): run this policy with the thread or MPI backend, host-staged"
        ),
    }
}

/// Bytes of `t`'s elements.
pub(crate) fn bytes(t: &Tensor) -> usize {
    t.numel() * t.dtype().size_in_bytes()
}

/// The asynchronous result of collectives and what is chained on them (PyTorch's
/// `torch.futures.Future`): it completes with a value or a [`DdpError`]. Continuations run on
/// the thread that completes the work (the comm stream's, or the caller's when it already
/// completed): keep them short, and never hold a lock in the caller that a continuation takes.
pub struct TensorWork<T> {
    work: Work<Result<T>>,
    timeout: Duration,
    /// A device collective's done event, waited on by the waiting thread's stream (see
    /// [`TensorWork::ordered_on_wait`]).
    order: Option<StreamOrder>,
    /// When the collective under this work held the link, as its comm-level work reports it
    /// (a simulated link's slot), once it has: what [`TensorWork::on_ran`] tells, where the
    /// work's own finish also holds its continuations and their wait for the comm thread.
    /// `None` for work not made from one collective.
    slot: Option<Slot>,
}

/// The start and finish of a collective's comm-level work, once it completed without error.
type Slot = Arc<std::sync::Mutex<Option<(std::time::Instant, std::time::Instant)>>>;

/// A device collective's done event for the stream that takes its value: the stream current on
/// the thread that waits for the work (or chains on it, or drops it unwaited) waits on the event
/// then, so whatever that stream runs next reads the collective's result, and the buffers the
/// collective used are freed behind it (the keep-alive rule of `brigade_tensor::Stream`).
struct StreamOrder {
    device: Device,
    done: Option<Event>,
}

impl StreamOrder {
    fn apply(&mut self) -> Result<()> {
        match self.done.take() {
            Some(done) => Ok(Stream::current(self.device)?.wait_event(&done)?),
            None => Ok(()),
        }
    }
}

impl Drop for StreamOrder {
    fn drop(&mut self) {
        // dropped unwaited: ordered now (a failure here has no caller to tell; the stream then
        // runs unordered, which the fake device reports as a race)
        let _ = self.apply();
    }
}

/// The producer side of a [`TensorWork`] made with [`TensorWork::pending`]: dropping it without
/// completing fails the work (never a hang).
pub struct TensorPromise<T>(brigade_comm::Promise<Result<T>>);

impl<T> TensorPromise<T> {
    /// Completes the work with `value`.
    pub fn complete(self, value: Result<T>) {
        self.0.complete(Ok(value))
    }
}

impl<T: Send + 'static> TensorWork<T> {
    /// A work that completes when its promise does (e.g. "the previous bucket is done", to
    /// chain one bucket's collectives after another's).
    pub fn pending(rank: usize, tag: &str, timeout: Duration) -> (TensorWork<T>, TensorPromise<T>) {
        let (work, promise) = Work::pending(rank, tag, timeout);
        (
            TensorWork {
                work,
                timeout,
                order: None,
                slot: None,
            },
            TensorPromise(promise),
        )
    }

    /// A work that has already completed with `value`.
    pub fn ready(rank: usize, tag: &str, timeout: Duration, value: Result<T>) -> TensorWork<T> {
        let (work, promise) = Work::pending(rank, tag, timeout);
        promise.complete(Ok(value));
        TensorWork {
            work,
            timeout,
            order: None,
            slot: None,
        }
    }

    /// This work, whose value is read on `device` only behind `done` (an event recorded on the
    /// comm stream after the collective): the stream current on the thread that waits for the
    /// work waits on `done` then, not before, so a collective issued ahead of its use (ZeRO-3's
    /// prefetched gathers) runs on the comm stream while the caller's stream computes. Chaining
    /// on the work, or dropping it unwaited, orders the caller's stream at once.
    pub fn ordered_on_wait(mut self, device: Device, done: Event) -> TensorWork<T> {
        if let Some(mut earlier) = self.order.take() {
            let _ = earlier.apply();
        }
        self.order = Some(StreamOrder {
            device,
            done: Some(done),
        });
        self
    }

    /// Orders the current stream behind the collective now (see [`TensorWork::ordered_on_wait`]).
    fn order_now(&mut self) -> Result<()> {
        match self.order.take() {
            Some(mut order) => order.apply(),
            None => Ok(()),
        }
    }

    /// A collective's work whose buffer `f` turns into the value (on the comm stream's thread,
    /// its storages charged to the issuing thread's memory meter).
    pub(crate) fn from_comm<B: Send + 'static>(
        work: Work<B>,
        timeout: Duration,
        f: impl FnOnce(B) -> Result<T> + Send + 'static,
    ) -> TensorWork<T> {
        let metered = IssuerMeter::here();
        let slot = Slot::default();
        let seen = slot.clone();
        let mut started = None;
        work.observe(move |event| match event {
            brigade_comm::WorkEvent::Started(at) => started = Some(at),
            brigade_comm::WorkEvent::Finished { at, error: None } => {
                if let Some(s) = started {
                    *seen.lock().unwrap_or_else(|e| e.into_inner()) = Some((s, at));
                }
            }
            brigade_comm::WorkEvent::Finished { .. } => {}
        });
        TensorWork {
            work: work.then(move |b| Ok(metered.run(|| f(b)))),
            timeout,
            order: None,
            slot: Some(slot),
        }
    }

    /// Chains `step` after this work (decompress, divide, copy): the returned work completes
    /// with `step(value)`, or with this work's error. What `step` makes is charged to the
    /// memory meter of the thread that chains it.
    pub fn then<U: Send + 'static>(mut self, step: impl FnOnce(T) -> Result<U> + Send + 'static) -> TensorWork<U> {
        let metered = IssuerMeter::here();
        let ordered = self.order_now();
        TensorWork {
            work: self
                .work
                .then(move |r| Ok(metered.run(|| ordered.and(r).and_then(step)))),
            timeout: self.timeout,
            order: None,
            slot: self.slot.take(),
        }
    }

    /// Chains further collectives after this work: once it succeeded, `step(value)` issues them
    /// and the returned work completes with theirs. Collectives issued by `step` join the comm
    /// stream after everything issued before it ran: to keep every rank's order the same, a
    /// policy chains its buckets one after the other (as PowerSGD does).
    pub fn and_then<U: Send + 'static>(
        mut self,
        step: impl FnOnce(T) -> Result<TensorWork<U>> + Send + 'static,
    ) -> TensorWork<U> {
        let (rank, tag, timeout) = (self.work.rank(), self.work.tag().to_string(), self.timeout);
        let ordered = self.order_now();
        TensorWork {
            work: self.work.and_then(move |r| {
                Ok(match ordered.and(r).and_then(step) {
                    Ok(next) => next.work,
                    Err(e) => TensorWork::ready(rank, &tag, timeout, Err(e)).work,
                })
            }),
            timeout,
            order: None,
            slot: None,
        }
    }

    /// Waits (at most the communicator's timeout) for the value.
    pub fn wait(self) -> Result<T> {
        self.wait_timed().map(|(v, _)| v)
    }

    /// Like [`TensorWork::wait`], also returning when the first collective started and when the
    /// last continuation finished.
    pub fn wait_timed(mut self) -> Result<(T, OpTiming)> {
        let ordered = self.order_now();
        let (r, timing) = self.work.wait_timed()?;
        ordered?;
        Ok((r?, timing))
    }

    /// Whether the work has completed (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.work.is_completed()
    }

    /// Calls `told` with how long the collective under the work held the link and when it left
    /// it, once the work completed; never for a work that failed. For a work made from one
    /// collective (and what is chained on it with [`TensorWork::then`]) that is its comm-level
    /// work's span (a simulated link's slot), not the work's own: its continuations run after
    /// the slot, behind the earlier collectives' continuations on the same thread, and are the
    /// policy's compute; for other work, from its start to its completion.
    pub(crate) fn on_ran(&self, told: impl FnOnce(Duration, std::time::Instant) + Send + 'static) {
        let mut started = None;
        let mut told = Some(told);
        let slot = self.slot.clone();
        self.work.observe(move |event| match event {
            brigade_comm::WorkEvent::Started(at) => started = Some(at),
            brigade_comm::WorkEvent::Finished { at, error: None } => {
                let held = slot.as_ref().and_then(|s| *s.lock().unwrap_or_else(|e| e.into_inner()));
                if let (Some((s, f)), Some(told)) = (held.or(started.map(|s| (s, at))), told.take()) {
                    told(f.saturating_duration_since(s), f);
                }
            }
            brigade_comm::WorkEvent::Finished { .. } => {}
        });
    }
}

/// The memory meter and part of the thread that issues a collective: a continuation running on
/// the comm stream's thread charges what it makes to them, so that a rank's meter sees the
/// storages its collectives make (a reduce-scatter's shard, a gather's result).
struct IssuerMeter(Option<Arc<MemoryMeter>>, usize);

impl IssuerMeter {
    fn here() -> IssuerMeter {
        IssuerMeter(MemoryMeter::current(), MemoryMeter::current_part())
    }

    fn run<R>(self, f: impl FnOnce() -> R) -> R {
        let before = MemoryMeter::install(self.0);
        // a guard, not `in_part`'s closure: `f` runs from here, not from inside the meter
        let part = MemoryMeter::enter_part(self.1);
        let r = f();
        drop(part);
        MemoryMeter::install(before);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Instant;

    #[test]
    fn a_collective_is_told_as_its_slot_on_the_link_not_as_its_continuations_finish() {
        // A collective whose comm-level work held the link from t0 to t0 + 1 ms (a simulated
        // link's slot, stamped after the fact) and whose continuations (the group's own, a
        // policy's `then`) ran only now, seconds later, on the comm thread. What it held the
        // link is the slot: 1 ms, leaving at t0 + 1 ms.
        let t0 = Instant::now() - Duration::from_secs(5);
        let slot_end = t0 + Duration::from_millis(1);
        let (comm, promise) = Work::<u32>::pending(0, "bucket", Duration::from_secs(5));
        let work = TensorWork::from_comm(comm, Duration::from_secs(5), |b| Ok(b + 1)).then(|v| Ok(v * 2));
        let told = Arc::new(Mutex::new(None));
        let into = told.clone();
        work.on_ran(move |d, left| *into.lock().unwrap() = Some((d, left)));
        promise.start_at(t0);
        promise.complete_at(Ok(1), slot_end);
        assert_eq!(work.wait().unwrap(), 4);
        assert_eq!(*told.lock().unwrap(), Some((Duration::from_millis(1), slot_end)));
    }
}
