//! One rank of an NCCL communicator on a CUDA comm stream that the caller owns.

use std::ffi::c_void;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use cudarc::driver::sys::{CUevent_flags, CUevent_wait_flags};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::{result, sys};

use super::id::NcclId;
use super::raw::{code, RawComm};
use super::watchdog::Watched;
use crate::collective::{check_runnable, describe, OpKind};
use crate::{CommError, DType, DeviceSpan, RawEvent, RawStream, ReduceOp};

/// One rank of an NCCL communicator: collectives run on the comm stream the caller gave (a
/// stream of this rank's GPU), ordered against other streams by events; a watchdog aborts the
/// communicator on an asynchronous error or a timeout (see the module docs).
///
/// Unlike cudarc's `Comm` it is `Send + Sync`: it owns the raw NCCL handle
/// and serializes every enqueue on it.
pub struct NcclComm {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    /// The caller's stream, borrowed (never destroyed here).
    stream: Arc<CudaStream>,
    watched: Arc<Watched<RawComm>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {} on cuda:{})",
            self.rank, self.world_size, self.ordinal
        )
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// NCCL's type for `dtype` (every dtype has one).
fn nccl_type(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
        DType::I8 => sys::ncclDataType_t::ncclInt8,
    }
}

/// An event that records time (cudarc's default disables timing).
fn timed_event(stream: &CudaStream) -> Result<CudaEvent, cudarc::driver::DriverError> {
    stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
}

/// Which device collective.
#[derive(Debug, Clone, Copy)]
enum DeviceOp {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world_size` on CUDA device `ordinal`, running
    /// its collectives on `stream`. `ncclCommInitRank` blocks until every rank joined: it runs
    /// on a helper thread, and a rank that waits longer than `timeout` fails with
    /// [`CommError::Timeout`].
    ///
    /// # Safety
    /// `stream` must be a live `CUstream` of device `ordinal` that outlives the communicator
    /// (the caller owns it; it is never destroyed here).
    pub unsafe fn new(
        ordinal: usize,
        stream: RawStream,
        rank: usize,
        world_size: usize,
        id: NcclId,
        timeout: Duration,
    ) -> Result<NcclComm, CommError> {
        super::require_nccl()?;
        let init = "ncclCommInitRank";
        let cuda = |during: &str, e: cudarc::driver::DriverError| CommError::Nccl {
            rank,
            tag: during.to_string(),
            detail: format!("CUDA error {e:?}"),
        };
        // The device's primary context: the one the tensor crate's streams belong to.
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda("opening the CUDA context", e))?;
        // Every cross-stream use is ordered by the caller's events.
        // SAFETY: this crate's own device memory (host-staged collectives) lives on one stream.
        unsafe { ctx.disable_event_tracking() };
        // SAFETY: the caller promises a live stream of this context that outlives `self`.
        let stream = unsafe { ctx.wrap_borrowed_stream(stream.0 as cudarc::driver::sys::CUstream) };
        let (tx, rx) = mpsc::channel();
        let joiner_ctx = ctx.clone();
        thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let joined = joiner_ctx
                    .bind_to_thread()
                    .map_err(|e| format!("binding the CUDA context: {e:?}"))
                    .and_then(|()| RawComm::init_rank(world_size, id.0, rank));
                let _ = tx.send(joined);
            })
            .map_err(|e| CommError::Internal(format!("spawning the NCCL init thread: {e}")))?;
        let raw = match rx.recv_timeout(timeout) {
            Ok(Ok(raw)) => raw,
            Ok(Err(detail)) => {
                return Err(CommError::Nccl {
                    rank,
                    tag: init.into(),
                    detail,
                })
            }
            Err(_) => {
                return Err(CommError::Timeout {
                    rank,
                    tag: init.into(),
                    after: timeout,
                })
            }
        };
        let watchdog_ctx = ctx.clone();
        let bind = Box::new(move || watchdog_ctx.bind_to_thread().map_err(|e| format!("{e:?}")));
        Ok(NcclComm {
            rank,
            world_size,
            timeout,
            ordinal,
            ctx,
            stream,
            watched: Watched::start(raw, rank, timeout, bind),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// How long a wait on the device blocks before the watchdog fails it.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The comm stream every collective of this rank runs on.
    pub fn stream(&self) -> RawStream {
        RawStream(self.stream.cu_stream() as u64)
    }

    /// The CUDA device it runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Checks for a fault now (the watchdog also does, every millisecond): `Err` once the
    /// communicator failed or was aborted.
    pub fn check(&self) -> Result<(), CommError> {
        self.watched.check()
    }

    /// Averages (or sums, or maxes) `buf` over the ranks, in place, on the comm stream: the
    /// stream first waits on `ready` (when given), then runs `ncclAllReduce`, then records
    /// `done` (when given; a caller that owns the comm stream may instead record its own event
    /// after this call). Returns once the collective is *enqueued*; the host never waits for it.
    ///
    /// # Safety
    /// `buf` must be device memory of this communicator's GPU holding `buf.len` elements of
    /// `buf.dtype`, alive and not written by any other stream until the collective completed
    /// (`done`, or an event the caller records after it on the comm stream); `ready` and
    /// `done` must be live events of that device.
    pub unsafe fn all_reduce_device(
        &self,
        buf: DeviceSpan,
        op: ReduceOp,
        ready: Option<RawEvent>,
        done: Option<RawEvent>,
        tag: &str,
    ) -> Result<(), CommError> {
        // SAFETY: the caller's promises, passed on.
        unsafe { self.device(DeviceOp::AllReduce(op), buf, buf, ready, done, tag) }
    }

    /// Reduces `send` (`world_size` equal chunks, one per rank) over the ranks and leaves chunk
    /// `rank` of the result in `recv` (`send.len / world_size` elements), on the comm stream,
    /// between `ready` and `done` as [`NcclComm::all_reduce_device`] does.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_device`], for both spans (which must not overlap).
    pub unsafe fn reduce_scatter_device(
        &self,
        send: DeviceSpan,
        recv: DeviceSpan,
        op: ReduceOp,
        ready: Option<RawEvent>,
        done: Option<RawEvent>,
        tag: &str,
    ) -> Result<(), CommError> {
        // SAFETY: the caller's promises, passed on.
        unsafe { self.device(DeviceOp::ReduceScatter(op), send, recv, ready, done, tag) }
    }

    /// Gathers every rank's `send` into `recv` (`send.len * world_size` elements, rank order),
    /// on the comm stream, between `ready` and `done` as [`NcclComm::all_reduce_device`] does.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_device`], for both spans (which must not overlap).
    pub unsafe fn all_gather_device(
        &self,
        send: DeviceSpan,
        recv: DeviceSpan,
        ready: Option<RawEvent>,
        done: Option<RawEvent>,
        tag: &str,
    ) -> Result<(), CommError> {
        // SAFETY: the caller's promises, passed on.
        unsafe { self.device(DeviceOp::AllGather, send, recv, ready, done, tag) }
    }

    /// Checks a device collective's spans against each other and this communicator.
    fn check_device(&self, op: DeviceOp, send: DeviceSpan, recv: DeviceSpan, tag: &str) -> Result<OpKind, CommError> {
        let kind = match op {
            DeviceOp::AllReduce(r) => OpKind::AllReduce(r),
            DeviceOp::ReduceScatter(r) => OpKind::ReduceScatter(r),
            DeviceOp::AllGather => OpKind::AllGather,
        };
        let described = || describe(kind, Some(send.dtype), send.len as u64, tag);
        let bad = |why: String| CommError::InvalidArgument(format!("{}: {why}", described()));
        if send.ordinal != self.ordinal || recv.ordinal != self.ordinal {
            return Err(bad(format!(
                "memory on cuda:{} / cuda:{}, the communicator runs on cuda:{}",
                send.ordinal, recv.ordinal, self.ordinal
            )));
        }
        if send.dtype != recv.dtype {
            return Err(bad(format!("send is {}, recv is {}", send.dtype, recv.dtype)));
        }
        if matches!(op, DeviceOp::AllReduce(_) | DeviceOp::ReduceScatter(_)) && !send.dtype.is_float() {
            return Err(CommError::Unsupported(format!(
                "reduction on {} device memory: {}",
                send.dtype,
                described()
            )));
        }
        let w = self.world_size;
        let want = match op {
            DeviceOp::AllReduce(_) => send.len,
            DeviceOp::ReduceScatter(_) => send.len / w,
            DeviceOp::AllGather => send.len * w,
        };
        if recv.len != want {
            return Err(bad(format!(
                "recv holds {} elements, the collective writes {want}",
                recv.len
            )));
        }
        check_runnable(kind, Some(send.dtype), send.len as u64, w, tag)?;
        Ok(kind)
    }

    /// One device collective between the caller's events, enqueued under the watchdog.
    ///
    /// # Safety
    /// See [`NcclComm::all_reduce_device`].
    unsafe fn device(
        &self,
        op: DeviceOp,
        send: DeviceSpan,
        recv: DeviceSpan,
        ready: Option<RawEvent>,
        done: Option<RawEvent>,
        tag: &str,
    ) -> Result<(), CommError> {
        self.check_device(op, send, recv, tag)?;
        let s = self.stream.cu_stream();
        let watch = self.watched.enqueue(tag, |raw| {
            self.ctx
                .bind_to_thread()
                .map_err(|e| format!("binding the CUDA context: {e:?}"))?;
            if let Some(r) = ready {
                // SAFETY: the caller's live event; the wait is captured now.
                unsafe {
                    cudarc::driver::result::stream::wait_event(
                        s,
                        r.0 as cudarc::driver::sys::CUevent,
                        CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                }
                .map_err(|e| format!("waiting on the ready event: CUDA error {e:?}"))?;
            }
            if send.len > 0 {
                let (sp, rp) = (send.ptr as *const c_void, recv.ptr as *mut c_void);
                let (dt, h, st) = (nccl_type(send.dtype), raw.handle(), s as sys::cudaStream_t);
                // SAFETY: the caller's spans hold the counts checked above on this GPU.
                let r = unsafe {
                    match op {
                        DeviceOp::AllReduce(o) => result::all_reduce(sp, rp, send.len, dt, nccl_op(o), h, st),
                        DeviceOp::ReduceScatter(o) => result::reduce_scatter(sp, rp, recv.len, dt, nccl_op(o), h, st),
                        DeviceOp::AllGather => result::all_gather(sp, rp, send.len, dt, h, st),
                    }
                };
                r.map_err(|e| format!("NCCL call: {}", code(e.0)))?;
            }
            if let Some(d) = done {
                // SAFETY: the caller's live event, recorded on the comm stream.
                unsafe { cudarc::driver::result::event::record(d.0 as cudarc::driver::sys::CUevent, s) }
                    .map_err(|e| format!("recording the done event: CUDA error {e:?}"))?;
            }
            // the watchdog's own event (the caller may destroy `done` whenever it likes)
            timed_event(&self.stream).map_err(|e| format!("recording the watchdog's event: CUDA error {e:?}"))
        })?;
        self.watched.watch(tag, Arc::new(watch));
        Ok(())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.watched.stop();
    }
}
