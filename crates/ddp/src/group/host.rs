//! The host group: a [`ProcessGroup`] over a rank's [`CommStream`] (threads, MPI; traced or on a
//! simulated link as options of the stream), which runs the collectives in issue order on a
//! worker thread and whose work handles complete with them. A tensor that spans its storage is lent to
//! the collective without a copy and restored under its views when the collective completes
//! ([`Tensor::lend_buffer`], [`Tensor::restore_buffer`]); device memory is staged through the
//! host by the same two calls.

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{Buffer, CommError, CommStream, ReduceOp, Transport, Work};
use brigade_tensor::{DType, Device, Tensor};

use super::{Fail, ProcessGroup, TensorWork};
use crate::{DdpError, Result};

/// Collectives on a rank's comm stream, completing when their work does.
pub struct HostGroup<T: Transport> {
    comm: Arc<CommStream<T>>,
}

impl<T: Transport> HostGroup<T> {
    /// A group over `comm` (the same stream may carry control messages beside it, as an
    /// `Arc<dyn Communicator>`).
    pub fn new(comm: Arc<CommStream<T>>) -> HostGroup<T> {
        HostGroup { comm }
    }

    /// `work`'s buffer turned into the value by `f` on the comm stream's thread.
    fn then<B: Send + 'static, V: Send + 'static>(
        &self,
        work: Work<B>,
        f: impl FnOnce(B) -> Result<V> + Send + 'static,
    ) -> TensorWork<V> {
        TensorWork::from_comm(work, self.timeout(), f)
    }
}

/// `t`'s elements lent out as a host buffer (see [`Tensor::lend_buffer`]), for a dtype the
/// collectives move.
pub(crate) fn lend(t: &Tensor) -> Result<(Buffer, bool)> {
    if !matches!(
        t.dtype(),
        DType::F32 | DType::F16 | DType::BF16 | DType::U8 | DType::I8 | DType::I64 | DType::F64
    ) {
        return Err(DdpError::Comm(CommError::Unsupported(format!(
            "a collective on a {} tensor (collectives move f32, f16, bf16, f64, u8, i8 and i64)",
            t.dtype()
        ))));
    }
    Ok(t.lend_buffer()?)
}

/// A host buffer as a new tensor of `shape` on `device` (no copy on the CPU).
pub(crate) fn tensor_of(b: Buffer, shape: &[usize], device: Device) -> Result<Tensor> {
    Ok(Tensor::from_buffer(b, shape)?.to_device(device)?)
}

impl<T: Transport> ProcessGroup for HostGroup<T> {
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
        let (buf, lent) = match lend(t) {
            Ok(x) => x,
            Err(e) => return self.failed(e),
        };
        let t = t.clone();
        self.then(self.comm.all_reduce(buf, op, tag), move |b| {
            t.restore_buffer(b, lent)?;
            Ok(t)
        })
    }

    fn broadcast(&self, t: &Tensor, root: usize, tag: &str) -> TensorWork<Tensor> {
        let (buf, lent) = match lend(t) {
            Ok(x) => x,
            Err(e) => return self.failed(e),
        };
        let t = t.clone();
        self.then(self.comm.broadcast(buf, root, tag), move |b| {
            t.restore_buffer(b, lent)?;
            Ok(t)
        })
    }

    fn barrier(&self, tag: &str) -> TensorWork<()> {
        self.then(self.comm.barrier(tag), Ok)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let (buf, _) = match lend(t) {
            Ok(x) => x,
            Err(e) => return self.failed(e),
        };
        let device = t.device();
        self.then(self.comm.reduce_scatter(buf, op, tag), move |mut b| {
            // the chunk keeps its input's allocation otherwise, and memory reports count what is
            // alive
            b.shrink_to_fit();
            let n = b.len();
            tensor_of(b, &[n], device)
        })
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let (buf, _) = match lend(input) {
            Ok(x) => x,
            Err(e) => return self.failed(e),
        };
        let out = output.clone();
        self.then(self.comm.reduce_scatter(buf, op, tag), move |b| {
            out.restore_buffer(b, false)?;
            Ok(out)
        })
    }

    fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let (buf, _) = match lend(t) {
            Ok(x) => x,
            Err(e) => return self.failed(e),
        };
        let (device, n, world) = (t.device(), t.numel(), self.world_size());
        self.then(self.comm.all_gather(buf, tag), move |b| {
            tensor_of(b, &[world, n], device)
        })
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let (n, world) = (input.numel(), self.world_size());
        if output.numel() != n * world || output.dtype() != input.dtype() || !output.spans_storage() {
            let e = DdpError::Comm(CommError::InvalidArgument(format!(
                "all_gather_into `{tag}`: the output must be a whole {} tensor of {} x {n} elements, got {} x {}",
                input.dtype(),
                world,
                output.numel(),
                output.dtype()
            )));
            return self.failed(e);
        }
        // This rank's input goes first in the output's own buffer, which then shrinks to it: the
        // all-gather grows it back in place to every rank's (no second allocation).
        let staged = output
            .narrow(0, 0, n)
            .and_then(|head| head.copy_from(input))
            .map_err(DdpError::from)
            .and_then(|()| lend(output));
        let mut buf = match staged {
            Ok((buf, _)) => buf,
            Err(e) => return self.failed(e),
        };
        buf.truncate(n);
        let out = output.clone();
        self.then(self.comm.all_gather(buf, tag), move |b| {
            out.restore_buffer(b, true)?;
            Ok(out)
        })
    }

    fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        let lent = lend(payload).and_then(|p| Ok((p, lend(side)?)));
        let ((p, _), (s, _)) = match lent {
            Ok(x) => x,
            Err(e) => return self.failed(e),
        };
        let (device, n, k, world) = (payload.device(), payload.numel(), side.numel(), self.world_size());
        // the split in this work's continuation, not a chained one of the stream's: the work
        // keeps the all-gather's own span on the link
        let (packed, layout) = brigade_comm::pack_with_side(p, s);
        let work = self.comm.all_gather(packed, tag);
        self.then(work, move |all| {
            let (p, s) = brigade_comm::unpack_with_side(all, layout)?;
            Ok((tensor_of(p, &[world, n], device)?, tensor_of(s, &[world, k], device)?))
        })
    }
}
