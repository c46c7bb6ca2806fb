//! One rank of an NCCL communicator on its own CUDA comm stream.

use std::ffi::c_void;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{result, sys, NcclType};
use half::{bf16, f16};

use super::buffer::DeviceBuffer;
use super::id::NcclId;
use super::raw::{code, RawComm};
use super::watchdog::Watched;
use crate::collective::{check_runnable, OpKind};
use crate::{Buffer, CommError, Communicator, ReduceOp, Work};

/// One rank of an NCCL communicator: collectives run on a dedicated CUDA comm stream of this
/// rank's GPU, ordered against the compute stream by events; a watchdog aborts the
/// communicator on an asynchronous error or a timeout (see the module docs).
///
/// Unlike cudarc's `Comm` it is `Send + Sync` (a [`Communicator`]): it owns the raw NCCL handle
/// and serializes every call on it.
pub struct NcclComm {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    stream: Arc<CudaStream>,
    watched: Arc<Watched<RawComm>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {})", self.rank, self.world_size)
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// An event that records time (cudarc's default disables timing).
fn timed_event(stream: &CudaStream) -> Result<CudaEvent, cudarc::driver::DriverError> {
    stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world_size` on `ctx`'s GPU, with a new comm
    /// stream. `ncclCommInitRank` blocks until every rank joined: it runs on a helper thread,
    /// and a rank that waits longer than `timeout` fails with [`CommError::Timeout`].
    pub fn new(
        ctx: &Arc<CudaContext>,
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
        let stream = ctx.new_stream().map_err(|e| cuda("creating the comm stream", e))?;
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
        Ok(NcclComm {
            rank,
            world_size,
            timeout,
            stream,
            watched: Watched::start(raw, rank, timeout),
        })
    }

    /// The comm stream every collective of this rank runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Checks for a fault now (the watchdog also does, every millisecond): `Err` once the
    /// communicator failed or was aborted.
    pub fn check(&self) -> Result<(), CommError> {
        self.watched.check()
    }

    fn cuda(&self, tag: &str, during: &str, e: cudarc::driver::DriverError) -> CommError {
        self.watched.error(tag, format!("{during}: CUDA error {e:?}"))
    }

    /// Averages (or sums, or maxes) `buf` over the ranks, in place, on the comm stream: the
    /// stream first waits on `buf`'s ready event, then runs `ncclAllReduce`, then records the
    /// completion event that comes back in [`DeviceBuffer::done`] (with a start event for the
    /// timeline). Returns once the collective is *enqueued*; the host never waits for it.
    pub fn all_reduce_device(&self, mut buf: DeviceBuffer, op: ReduceOp, tag: &str) -> Result<DeviceBuffer, CommError> {
        let raw = self.watched.raw(tag)?;
        if let Some(ready) = buf.ready().cloned() {
            self.stream
                .wait(&ready)
                .map_err(|e| self.cuda(tag, "waiting on the ready event", e))?;
        }
        let start = timed_event(&self.stream).map_err(|e| self.cuda(tag, "recording the start event", e))?;
        let n = buf.len();
        {
            let (ptr, _record) = buf.data_mut().device_ptr_mut(&self.stream);
            // SAFETY: `ptr` holds `n` f32 on this communicator's GPU, alive for the call (the
            // buffer's own events order it against other streams); in place is allowed.
            unsafe {
                result::all_reduce(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    n,
                    sys::ncclDataType_t::ncclFloat32,
                    nccl_op(op),
                    raw.handle(),
                    self.stream.cu_stream() as sys::cudaStream_t,
                )
            }
            .map_err(|e| self.watched.error(tag, format!("ncclAllReduce: {}", code(e.0))))?;
        }
        drop(raw);
        let done =
            Arc::new(timed_event(&self.stream).map_err(|e| self.cuda(tag, "recording the completion event", e))?);
        self.watched.watch(tag, done.clone());
        buf.set_done(Arc::new(start), done);
        Ok(buf)
    }

    /// Runs one collective on a host vector: copies it to the GPU, runs NCCL on the comm
    /// stream, waits (polling, bounded by the timeout) and copies the result back.
    fn host<T: NcclType + DeviceRepr + ValidAsZeroBits + Copy>(
        &self,
        v: &mut Vec<T>,
        kind: OpKind,
        tag: &str,
    ) -> Result<(), CommError> {
        let len = v.len();
        let world = self.world_size;
        let up = |e| self.cuda(tag, "copying to the GPU", e);
        let mut input = self.stream.clone_htod(v.as_slice()).map_err(up)?;
        let out_len = match kind {
            OpKind::AllGather => len * world,
            OpKind::ReduceScatter(_) => len / world,
            _ => len,
        };
        let mut output = match kind {
            OpKind::AllGather | OpKind::ReduceScatter(_) => Some(self.stream.alloc_zeros::<T>(out_len).map_err(up)?),
            _ => None,
        };
        {
            let raw = self.watched.raw(tag)?;
            let s = self.stream.cu_stream() as sys::cudaStream_t;
            let dt = T::as_nccl_type();
            let (src, _r) = input.device_ptr_mut(&self.stream);
            let dst = output.as_mut().map(|o| o.device_ptr_mut(&self.stream));
            let dst_ptr = dst.as_ref().map_or(src, |(p, _)| *p);
            let (src, dst_ptr) = (src as *const c_void, dst_ptr as *mut c_void);
            // SAFETY: `src` holds `len` elements and `dst_ptr` `out_len` elements of T on this
            // GPU, both alive until the copy back below has waited for the comm stream.
            let r = unsafe {
                match kind {
                    OpKind::AllReduce(op) => result::all_reduce(src, dst_ptr, len, dt, nccl_op(op), raw.handle(), s),
                    OpKind::Broadcast { root } => {
                        result::broadcast(src, dst_ptr, len, dt, root as i32, raw.handle(), s)
                    }
                    OpKind::AllGather => result::all_gather(src, dst_ptr, len, dt, raw.handle(), s),
                    OpKind::ReduceScatter(op) => {
                        result::reduce_scatter(src, dst_ptr, out_len, dt, nccl_op(op), raw.handle(), s)
                    }
                    OpKind::Barrier => {
                        result::all_reduce(src, dst_ptr, len, dt, nccl_op(ReduceOp::Sum), raw.handle(), s)
                    }
                }
            };
            r.map_err(|e| self.watched.error(tag, format!("NCCL call: {}", code(e.0))))?;
        }
        let done = timed_event(&self.stream).map_err(|e| self.cuda(tag, "recording the completion event", e))?;
        self.watched.wait_event(tag, &done)?;
        let result = match &output {
            Some(o) => self.stream.clone_dtoh(o),
            None => self.stream.clone_dtoh(&input),
        };
        *v = result.map_err(|e| self.cuda(tag, "copying back to the host", e))?;
        Ok(())
    }

    /// One collective on a host [`Buffer`], as a completed [`Work`].
    fn run(&self, buf: Buffer, kind: OpKind, tag: &str) -> Work<Buffer> {
        let (work, promise) = Work::pending(self.rank, tag, self.timeout);
        promise.start();
        let result = check_runnable(kind, Some(buf.dtype()), buf.len() as u64, self.world_size, tag).and_then(|()| {
            let mut buf = buf;
            match &mut buf {
                Buffer::F32(v) => self.host(v, kind, tag),
                Buffer::F16(v) => self.host::<f16>(v, kind, tag),
                Buffer::BF16(v) => self.host::<bf16>(v, kind, tag),
                Buffer::U8(v) => self.host(v, kind, tag),
                Buffer::I8(v) => self.host(v, kind, tag),
            }
            .map(|()| buf)
        });
        promise.complete(result);
        work
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.watched.stop();
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        self.run(buf, OpKind::AllReduce(op), tag)
    }

    fn broadcast(&self, buf: Buffer, root: usize, tag: &str) -> Work<Buffer> {
        self.run(buf, OpKind::Broadcast { root }, tag)
    }

    fn all_gather(&self, buf: Buffer, tag: &str) -> Work<Buffer> {
        self.run(buf, OpKind::AllGather, tag)
    }

    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        self.run(buf, OpKind::ReduceScatter(op), tag)
    }

    fn barrier(&self, tag: &str) -> Work<()> {
        let work = self.run(Buffer::F32(vec![0.0]), OpKind::Barrier, tag);
        work.then(|_| Ok(()))
    }
}
