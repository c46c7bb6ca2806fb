//! The tensor-level collectives a reducer policy issues (the seam between policies and
//! backends): [`Collectives`] is a cheap, cloneable handle with all-reduce, broadcast,
//! reduce-scatter, all-gather and an all-gather with a side buffer, each on [`Tensor`]s and each
//! returning a [`TensorWork`] future with `then`-style continuations.
//!
//! A policy never sees a communicator or a host vector: the handle's backend
//! ([`CollectiveBackend`]) moves the tensors. [`HostCollectives`] serves the thread and MPI
//! backends (any [`Communicator`]): a tensor that spans its whole storage is lent to the
//! collective without a copy, as DDP's buckets always were (its views read a typed
//! `StorageLent` error meanwhile, never stale data), device memory is staged through the host,
//! and a view that does not span its storage is copied. An NCCL backend implements the same
//! trait on device memory (`stream::DeviceStream`'s handle, NCCL's or host-staged).
//!
//! What each collective does with its input (host backend and contract alike):
//! - `all_reduce` and `broadcast` work in place: the result lands in the tensor's own storage
//!   (and its views) and the work completes with the tensor;
//! - `reduce_scatter` and `all_gather` complete with a new tensor (this rank's chunk; every
//!   rank's input, rank-major, as `[world, n]`) and consume their input's storage when they
//!   could lend it: the input reads `StorageLent` afterwards (restore it if you need it again;
//!   the reducer does for a bucket whose full buffer a policy keeps);
//! - `all_gather_into` gathers into a tensor the caller already holds (`world × n` elements,
//!   rank-major; ZeRO-1 gathers its updated parameters into the idle gradient bucket): no
//!   scratch at all.
//!
//! Every collective a policy issues is counted once, into the handle's meter; one issued for a
//! bucket, including those issued later from a continuation, is attributed to that bucket: in
//! traces, and in the bucket's part of the meter (what this rank sends under the ring
//! algorithms, [`brigade_comm::RingOp::wire_bytes`]), which step profiles record.

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{
    all_gather_with_side, tagging_collectives, Buffer, CommError, CommMeter, Communicator, OpTiming, ReduceOp, RingOp,
    Work,
};
use brigade_tensor::{DType, Device, Storage, Tensor};

use crate::{DdpError, Result};

/// The asynchronous result of collectives and what is chained on them (PyTorch's
/// `torch.futures.Future`): it completes with a value or a [`DdpError`]. Continuations run on
/// the thread that completes the work (the comm stream's, or the caller's when it already
/// completed): keep them short, and never hold a lock in the caller that a continuation takes.
pub struct TensorWork<T> {
    work: Work<Result<T>>,
    timeout: Duration,
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
        (TensorWork { work, timeout }, TensorPromise(promise))
    }

    /// A work that has already completed with `value`.
    pub fn ready(rank: usize, tag: &str, timeout: Duration, value: Result<T>) -> TensorWork<T> {
        let (work, promise) = Work::pending(rank, tag, timeout);
        promise.complete(Ok(value));
        TensorWork { work, timeout }
    }

    /// A collective's work whose buffer `f` turns into the value (on the comm stream's thread).
    pub(crate) fn from_comm<B: Send + 'static>(
        work: Work<B>,
        timeout: Duration,
        f: impl FnOnce(B) -> Result<T> + Send + 'static,
    ) -> TensorWork<T> {
        TensorWork {
            work: work.then(move |b| Ok(f(b))),
            timeout,
        }
    }

    /// Chains `step` after this work (decompress, divide, copy): the returned work completes
    /// with `step(value)`, or with this work's error.
    pub fn then<U: Send + 'static>(self, step: impl FnOnce(T) -> Result<U> + Send + 'static) -> TensorWork<U> {
        TensorWork {
            work: self.work.then(move |r| Ok(r.and_then(step))),
            timeout: self.timeout,
        }
    }

    /// Chains further collectives after this work: once it succeeded, `step(value)` issues them
    /// and the returned work completes with theirs. Collectives issued by `step` join the comm
    /// stream after everything issued before it ran: to keep every rank's order the same, a
    /// policy chains its buckets one after the other (as PowerSGD does).
    pub fn and_then<U: Send + 'static>(
        self,
        step: impl FnOnce(T) -> Result<TensorWork<U>> + Send + 'static,
    ) -> TensorWork<U> {
        let (rank, tag, timeout) = (self.work.rank(), self.work.tag().to_string(), self.timeout);
        TensorWork {
            work: self.work.and_then(move |r| {
                Ok(match r.and_then(step) {
                    Ok(next) => next.work,
                    Err(e) => TensorWork::ready(rank, &tag, timeout, Err(e)).work,
                })
            }),
            timeout,
        }
    }

    /// Waits (at most the communicator's timeout) for the value.
    pub fn wait(self) -> Result<T> {
        self.wait_timed().map(|(v, _)| v)
    }

    /// Like [`TensorWork::wait`], also returning when the first collective started and when the
    /// last continuation finished.
    pub fn wait_timed(self) -> Result<(T, OpTiming)> {
        let (r, timing) = self.work.wait_timed()?;
        Ok((r?, timing))
    }

    /// Whether the work has completed (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.work.is_completed()
    }
}

/// The tensor-level collective contract: what a policy's collectives ([`Collectives`]) are
/// served by. [`HostCollectives`] serves any [`Communicator`] (threads, MPI); on a device comm
/// stream (`stream::DeviceStream`) NCCL serves it on device memory, or `HostStagedComm` through
/// the host, behind the stream's event ordering, which serves it in turn. Semantics as in the
/// module docs; every method returns at once (a device backend's work completes once it is
/// enqueued).
///
/// A backend implements the in-place three (`all_reduce`, `reduce_scatter_into`,
/// `all_gather_into`); the others have defaults composed of them (a new output tensor, two
/// all-gathers for a side buffer, no broadcast), which the host backend replaces with its own
/// (lending storage, one collective).
pub trait CollectiveBackend: Send + Sync {
    /// A short name for errors (`host`, `nccl`, `host-staged`).
    fn name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// How long a wait blocks before it fails.
    fn timeout(&self) -> Duration;
    /// `Err` once the backend failed asynchronously (NCCL's error, a timeout); the host backend
    /// reports every error through its works instead.
    fn check(&self) -> Result<()> {
        Ok(())
    }
    /// In place over every rank.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor>;
    /// Reduces `input` (`world` equal chunks) over every rank into `output` (one chunk, the same
    /// dtype and device, spanning its storage), in place; completes with `output`.
    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor>;
    /// Every rank's `input`, rank-major, into `output` (`world × input.numel()` elements,
    /// spanning its storage), in place; completes with `output`.
    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor>;

    /// In place: `root`'s values on every rank. By default a typed error: a device comm stream
    /// runs all-reduce, reduce-scatter and all-gather only.
    fn broadcast(&self, _t: &Tensor, _root: usize, tag: &str) -> TensorWork<Tensor> {
        let e = DdpError::Policy {
            policy: format!("(on the {} stream)", self.name()),
            reason: format!(
                "broadcast `{tag}` does not run on the device comm stream (it runs all-reduce, reduce-scatter and \
                 all-gather): run this policy with the thread or MPI backend, host-staged"
            ),
        };
        TensorWork::ready(self.rank(), tag, self.timeout(), Err(e))
    }
    /// This rank's chunk (`numel / world` elements) of the reduction, as a new 1-D tensor.
    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let world = self.world_size();
        if t.numel() % world != 0 {
            let e = DdpError::Comm(CommError::InvalidArgument(format!(
                "reduce-scatter `{tag}`: {} elements do not split into {world} equal chunks",
                t.numel()
            )));
            return TensorWork::ready(self.rank(), tag, self.timeout(), Err(e));
        }
        match Tensor::zeros_on(&[t.numel() / world], t.dtype(), t.device()) {
            Ok(chunk) => self.reduce_scatter_into(t, &chunk, op, tag),
            Err(e) => TensorWork::ready(self.rank(), tag, self.timeout(), Err(e.into())),
        }
    }
    /// Every rank's elements, rank-major, as a new `[world, numel]` tensor.
    fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        match Tensor::zeros_on(&[self.world_size(), t.numel()], t.dtype(), t.device()) {
            Ok(out) => self.all_gather_into(t, &out, tag),
            Err(e) => TensorWork::ready(self.rank(), tag, self.timeout(), Err(e.into())),
        }
    }
    /// Every rank's payload and side tensor, rank-major (`[world, n]`, `[world, k]`). By default
    /// two all-gathers, payload then side, the same order on every rank (memory of two dtypes
    /// is not one buffer).
    fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        let both = self
            .all_gather(payload, tag)
            .wait()
            .and_then(|p| Ok((p, self.all_gather(side, tag).wait()?)));
        TensorWork::ready(self.rank(), tag, self.timeout(), both)
    }
}

/// The handle a policy issues its collectives through (see the module docs): each one is
/// counted once, into the handle's [`CommMeter`] (DDP's: [`crate::DdpConfig::meter`]). Clones
/// share the backend, the meter and, within a bucket's reduction, the bucket's attribution:
/// clone it into a continuation to issue more collectives for the same bucket.
#[derive(Clone)]
pub struct Collectives {
    backend: Arc<dyn CollectiveBackend>,
    /// What the collectives sent (within a bucket: the bucket's part of the whole).
    meter: CommMeter,
    /// The bucket whose reduction these collectives belong to.
    bucket: Option<usize>,
}

impl Collectives {
    /// A handle over `backend`, counting into a meter of its own.
    pub fn new(backend: Arc<dyn CollectiveBackend>) -> Collectives {
        Collectives {
            backend,
            meter: CommMeter::new(),
            bucket: None,
        }
    }

    /// The same handle, counting into `meter`.
    pub(crate) fn metered(self, meter: CommMeter) -> Collectives {
        Collectives { meter, ..self }
    }

    /// What this handle's collectives sent so far (within a bucket: the bucket's).
    pub(crate) fn meter(&self) -> &CommMeter {
        &self.meter
    }

    /// A handle over any communicator, through the host ([`HostCollectives`]).
    pub fn host(comm: Arc<dyn Communicator>) -> Collectives {
        Collectives::new(Arc::new(HostCollectives::new(comm)))
    }

    /// The same handle, its collectives attributed to bucket `index` from now on (counted in a
    /// part of the meter of their own as well).
    pub(crate) fn for_bucket(&self, index: usize) -> Collectives {
        Collectives {
            backend: self.backend.clone(),
            meter: self.meter.part(),
            bucket: Some(index),
        }
    }

    /// The backend's name (`host`, `nccl`).
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.backend.rank()
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.backend.world_size()
    }

    /// How long a wait blocks before it fails.
    pub fn timeout(&self) -> Duration {
        self.backend.timeout()
    }

    /// A work already completed with `value` (a policy that sends nothing for a bucket, e.g.
    /// local SGD between averagings, returns its bucket this way).
    pub fn ready<T: Send + 'static>(&self, value: T) -> TensorWork<T> {
        TensorWork::ready(self.rank(), "ready", self.timeout(), Ok(value))
    }

    /// A work already failed with `error`.
    pub fn failed<T: Send + 'static>(&self, error: DdpError) -> TensorWork<T> {
        TensorWork::ready(self.rank(), "failed", self.timeout(), Err(error))
    }

    fn issue<T>(&self, op: RingOp, bytes: usize, f: impl FnOnce(&dyn CollectiveBackend) -> T) -> T {
        self.meter.count(op, bytes, self.world_size());
        match self.bucket {
            Some(index) => tagging_collectives(index, || f(self.backend.as_ref())),
            None => f(self.backend.as_ref()),
        }
    }

    /// Reduces `t` over every rank in place; completes with `t` holding the result.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::AllReduce, bytes(t), |b| b.all_reduce(t, op, tag))
    }

    /// Copies `root`'s `t` into every rank's `t`; completes with `t`.
    pub fn broadcast(&self, t: &Tensor, root: usize, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::Broadcast, bytes(t), |b| b.broadcast(t, root, tag))
    }

    /// Reduces `t` (`world * chunk` elements) over every rank; completes with this rank's chunk
    /// (elements `rank*chunk..(rank+1)*chunk`) as a new 1-D tensor. Consumes `t`'s storage when
    /// it spans it.
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::ReduceScatter, bytes(t), |b| b.reduce_scatter(t, op, tag))
    }

    /// Gathers every rank's `t` (same shape everywhere); completes with `[world, t.numel()]`,
    /// rank `r`'s elements in row `r`. Consumes `t`'s storage when it spans it.
    pub fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::AllGather, bytes(t), |b| b.all_gather(t, tag))
    }

    /// Gathers every rank's `input` (same shape everywhere) into `output`, which holds
    /// `world × input.numel()` elements of the same dtype and spans its storage: rank `r`'s
    /// elements at `r*n..(r+1)*n`, no buffer besides `output` (it is lent meanwhile). Completes
    /// with `output`.
    pub fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::AllGather, bytes(input), |b| {
            b.all_gather_into(input, output, tag)
        })
    }

    /// Gathers every rank's `payload` and small `side` tensor (scales, indices) in one
    /// collective; completes with `([world, payload.numel()], [world, side.numel()])`. How an
    /// integer payload is reduced: gather it with its scales, dequantize each row with its own
    /// rank's scales, sum in f32 (see [`brigade_comm::DType`]).
    pub fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        self.issue(RingOp::AllGather, bytes(payload) + bytes(side), |b| {
            b.all_gather_with_side(payload, side, tag)
        })
    }
}

fn bytes(t: &Tensor) -> usize {
    t.numel() * t.dtype().size_in_bytes()
}

/// [`CollectiveBackend`] over any [`Communicator`] (threads, MPI, simulated, traced, metered):
/// tensors travel as host [`Buffer`]s, lent without a copy where they can be.
pub struct HostCollectives {
    comm: Arc<dyn Communicator>,
}

impl HostCollectives {
    /// Collectives over `comm`.
    pub fn new(comm: Arc<dyn Communicator>) -> HostCollectives {
        HostCollectives { comm }
    }
}

/// Whether `t` covers its whole storage, in order: then the storage itself can be lent.
pub(crate) fn spans_storage(t: &Tensor) -> bool {
    t.is_contiguous() && t.layout().offset() == 0 && t.numel() == t.storage_numel()
}

/// `t`'s elements as a host buffer: its own storage when it spans it (`true`: lent, the tensor
/// reads `StorageLent` until it is restored), else a copy.
pub(crate) fn take(t: &Tensor) -> Result<(Buffer, bool)> {
    if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16 | DType::U8 | DType::I8) {
        return Err(DdpError::Comm(CommError::Unsupported(format!(
            "a collective on a {} tensor (collectives move f32, f16, bf16, u8 and i8)",
            t.dtype()
        ))));
    }
    if spans_storage(t) {
        return Ok((t.lend_storage()?.into_buffer()?, true));
    }
    Ok((t.to_buffer()?, false))
}

/// A host buffer as a new tensor of `shape` on `device` (no copy on the CPU).
pub(crate) fn tensor_of(b: Buffer, shape: &[usize], device: Device) -> Result<Tensor> {
    Ok(Tensor::from_buffer(b, shape)?.to_device(device)?)
}

/// Puts `b` (the result of an in-place collective) back under `t`.
pub(crate) fn put_back(t: &Tensor, b: Buffer, lent: bool) -> Result<Tensor> {
    if lent {
        t.restore_storage(Storage::from_buffer(b, t.device())?)?;
    } else {
        t.copy_from(&tensor_of(b, t.shape(), t.device())?)?;
    }
    Ok(t.clone())
}

impl HostCollectives {
    fn failed<T: Send + 'static>(&self, tag: &str, e: DdpError) -> TensorWork<T> {
        TensorWork::ready(self.comm.rank(), tag, self.comm.timeout(), Err(e))
    }
}

impl CollectiveBackend for HostCollectives {
    fn name(&self) -> &'static str {
        "host"
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

    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let (buf, lent) = match take(t) {
            Ok(x) => x,
            Err(e) => return self.failed(tag, e),
        };
        let t = t.clone();
        TensorWork::from_comm(self.comm.all_reduce(buf, op, tag), self.timeout(), move |b| {
            put_back(&t, b, lent)
        })
    }

    fn broadcast(&self, t: &Tensor, root: usize, tag: &str) -> TensorWork<Tensor> {
        let (buf, lent) = match take(t) {
            Ok(x) => x,
            Err(e) => return self.failed(tag, e),
        };
        let t = t.clone();
        TensorWork::from_comm(self.comm.broadcast(buf, root, tag), self.timeout(), move |b| {
            put_back(&t, b, lent)
        })
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let (buf, _) = match take(t) {
            Ok(x) => x,
            Err(e) => return self.failed(tag, e),
        };
        let device = t.device();
        TensorWork::from_comm(self.comm.reduce_scatter(buf, op, tag), self.timeout(), move |mut b| {
            // the chunk keeps its input's allocation otherwise, and memory reports count what is
            // alive
            b.shrink_to_fit();
            let n = b.len();
            tensor_of(b, &[n], device)
        })
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let (buf, _) = match take(input) {
            Ok(x) => x,
            Err(e) => return self.failed(tag, e),
        };
        let out = output.clone();
        TensorWork::from_comm(self.comm.reduce_scatter(buf, op, tag), self.timeout(), move |b| {
            out.copy_from(&tensor_of(b, out.shape(), out.device())?)?;
            Ok(out)
        })
    }

    fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let (buf, _) = match take(t) {
            Ok(x) => x,
            Err(e) => return self.failed(tag, e),
        };
        let (device, n, world) = (t.device(), t.numel(), self.world_size());
        TensorWork::from_comm(self.comm.all_gather(buf, tag), self.timeout(), move |b| {
            tensor_of(b, &[world, n], device)
        })
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let (n, world) = (input.numel(), self.world_size());
        if output.numel() != n * world || output.dtype() != input.dtype() || !spans_storage(output) {
            let e = DdpError::Comm(CommError::InvalidArgument(format!(
                "all_gather_into `{tag}`: the output must be a whole {} tensor of {} x {n} elements, got {} x {}",
                input.dtype(),
                world,
                output.numel(),
                output.dtype()
            )));
            return self.failed(tag, e);
        }
        // This rank's input goes first in the output's own buffer, which then shrinks to it: the
        // all-gather grows it back in place to every rank's (no second allocation).
        let staged = output
            .narrow(0, 0, n)
            .and_then(|head| head.copy_from(input))
            .map_err(DdpError::from)
            .and_then(|()| take(output));
        let mut buf = match staged {
            Ok((buf, _)) => buf,
            Err(e) => return self.failed(tag, e),
        };
        buf.truncate(n);
        let out = output.clone();
        TensorWork::from_comm(self.comm.all_gather(buf, tag), self.timeout(), move |b| {
            put_back(&out, b, true)
        })
    }

    fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        let taken = take(payload).and_then(|p| Ok((p, take(side)?)));
        let ((p, _), (s, _)) = match taken {
            Ok(x) => x,
            Err(e) => return self.failed(tag, e),
        };
        let (device, n, k, world) = (payload.device(), payload.numel(), side.numel(), self.world_size());
        let work = all_gather_with_side(self.comm.as_ref(), p, s, tag);
        TensorWork::from_comm(work, self.timeout(), move |(p, s)| {
            Ok((tensor_of(p, &[world, n], device)?, tensor_of(s, &[world, k], device)?))
        })
    }
}
