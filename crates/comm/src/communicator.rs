//! The `Communicator` trait: asynchronous collectives on one rank.

use std::sync::Arc;
use std::time::Duration;

use crate::{Buffer, CommError, DType, OpTiming, ReduceOp, Work};

/// One rank's view of a group of `world_size` ranks. Every collective is issued at once and
/// returns a [`Work`] handle; collectives execute on this rank's comm stream in the order they
/// were issued, while the caller goes on computing. All ranks must issue the same collectives
/// (kind, dtype, length, op, root, tag) in the same order; a backend reports a difference as
/// [`crate::CommError::Mismatch`]. The tag names the collective (e.g. `"bucket 3"`) in traces
/// and error messages.
///
/// Object safe: the training's control messages (loss agreement, parameter broadcast,
/// checkpoint gathers) hold an `Arc<dyn Communicator>`. Its implementation is the comm stream's
/// ([`crate::CommStream`], which a process group calls directly).
pub trait Communicator: Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// How long [`Work::wait`] and the backend's internal waits block before failing.
    fn timeout(&self) -> Duration;

    /// Reduces `buf` element-wise over all ranks, in place: the same `Vec`, holding the result
    /// on every rank, comes back from `wait`.
    fn all_reduce(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer>;

    /// The blocking all-reduce (PyTorch's `async_op=False`, MPI's `MPI_Allreduce` beside
    /// `MPI_Iallreduce`): the same collective as [`Communicator::all_reduce`], in the same issue
    /// order (ranks may mix the two), for a caller that would wait for it at once: the loss
    /// agreement, a norm, a benchmark. A backend may run it on the calling thread when its comm
    /// stream is idle, without waking the stream's worker and being woken back (tens of
    /// microseconds on a busy or virtual machine: more than a small all-reduce itself costs).
    fn all_reduce_blocking(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Result<Buffer, CommError> {
        self.all_reduce(buf, op, tag).wait()
    }

    /// [`Communicator::all_reduce_blocking`], also returning when the collective started and
    /// finished on the comm stream: on a simulated link, its slot, the same instants on every
    /// rank sharing the link (the instant the call returns is each rank's own, later where a
    /// busy core kept the transfer in memory past the slot or the thread from waking).
    fn all_reduce_blocking_timed(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Result<(Buffer, OpTiming), CommError> {
        self.all_reduce(buf, op, tag).wait_timed()
    }

    /// Copies `root`'s buffer into every rank's buffer (same length on every rank).
    fn broadcast(&self, buf: Buffer, root: usize, tag: &str) -> Work<Buffer>;

    /// Concatenates every rank's buffer (same length `len` everywhere), rank-major: the result
    /// has `world_size * len` elements, rank `r`'s input at `r*len..(r+1)*len`.
    fn all_gather(&self, buf: Buffer, tag: &str) -> Work<Buffer>;

    /// Reduces `buf` (length `world_size * chunk`) over all ranks and returns this rank's
    /// `chunk` of the result (elements `rank*chunk..(rank+1)*chunk`).
    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer>;

    /// Completes once every rank has reached it on its comm stream.
    fn barrier(&self, tag: &str) -> Work<()>;
}

macro_rules! forward_communicator {
    ($ptr:ident) => {
        impl<C: Communicator + ?Sized> Communicator for $ptr<C> {
            fn rank(&self) -> usize {
                (**self).rank()
            }
            fn world_size(&self) -> usize {
                (**self).world_size()
            }
            fn timeout(&self) -> Duration {
                (**self).timeout()
            }
            fn all_reduce(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
                (**self).all_reduce(buf, op, tag)
            }
            fn all_reduce_blocking(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Result<Buffer, CommError> {
                (**self).all_reduce_blocking(buf, op, tag)
            }
            fn all_reduce_blocking_timed(
                &self,
                buf: Buffer,
                op: ReduceOp,
                tag: &str,
            ) -> Result<(Buffer, OpTiming), CommError> {
                (**self).all_reduce_blocking_timed(buf, op, tag)
            }
            fn broadcast(&self, buf: Buffer, root: usize, tag: &str) -> Work<Buffer> {
                (**self).broadcast(buf, root, tag)
            }
            fn all_gather(&self, buf: Buffer, tag: &str) -> Work<Buffer> {
                (**self).all_gather(buf, tag)
            }
            fn reduce_scatter(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
                (**self).reduce_scatter(buf, op, tag)
            }
            fn barrier(&self, tag: &str) -> Work<()> {
                (**self).barrier(tag)
            }
        }
    };
}

forward_communicator!(Arc);
forward_communicator!(Box);

/// Gathers a byte string of any length from every rank (two all-gathers: the lengths,
/// then the strings padded to the longest). Every rank gets every rank's bytes, in rank
/// order. For metadata (parameter signatures, timelines), not for bulk data.
pub fn all_gather_bytes(comm: &dyn Communicator, bytes: Vec<u8>, tag: &str) -> Result<Vec<Vec<u8>>, CommError> {
    let len = Buffer::U8((bytes.len() as u64).to_le_bytes().to_vec());
    let lens: Vec<usize> = match comm.all_gather(len, &format!("{tag}.len")).wait()? {
        Buffer::U8(l) => l
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect(),
        other => {
            return Err(CommError::Internal(format!(
                "all_gather of u8 returned {}",
                other.dtype()
            )))
        }
    };
    let max = lens.iter().copied().max().unwrap_or(0);
    let mut padded = bytes;
    padded.resize(max, 0);
    let all = match comm.all_gather(Buffer::U8(padded), tag).wait()? {
        Buffer::U8(a) => a,
        other => {
            return Err(CommError::Internal(format!(
                "all_gather of u8 returned {}",
                other.dtype()
            )))
        }
    };
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &l)| all[r * max..r * max + l].to_vec())
        .collect())
}

/// One all-gather that carries, beside each rank's `payload`, a small `side` buffer of another
/// type (a quantizing policy's per-bucket scales, a sparsifying one's indices): both travel in the
/// same message, so the side costs one collective's latency less than a second all-gather and is
/// counted with the payload by a meter (as `U8` bytes: the wire bytes are exact).
///
/// Completes with `(payloads, sides)`, each rank-major as [`Communicator::all_gather`] returns
/// them: rank `r`'s payload at `r*len..(r+1)*len`, its side at `r*k..(r+1)*k`. Every rank must
/// pass payloads and sides of the same types and lengths (a different total length is reported
/// as a mismatch, like any all-gather's).
///
/// This is how integer payloads are reduced (see [`DType`]): gather every rank's int8 values
/// and scales, dequantize each piece with its own rank's scales, and sum in f32 in rank order.
pub fn all_gather_with_side(
    comm: &dyn Communicator,
    payload: Buffer,
    side: Buffer,
    tag: &str,
) -> Work<(Buffer, Buffer)> {
    let (packed, unpack) = pack_with_side(payload, side);
    comm.all_gather(packed, tag)
        .then(move |all| unpack_with_side(all, unpack))
}

/// What [`unpack_with_side`] needs to split an all-gathered message: the payload's and the
/// side's dtypes, the side's bytes and the message's.
pub struct SideLayout {
    pdtype: DType,
    sdtype: DType,
    side_bytes: usize,
    message: usize,
}

/// `side` then `payload` as one byte message, and how to split it again: the message
/// [`all_gather_with_side`] gathers, for a caller that issues the all-gather itself (and keeps
/// its work's timing, which a chained split would end at the split's return).
pub fn pack_with_side(payload: Buffer, side: Buffer) -> (Buffer, SideLayout) {
    let (pdtype, sdtype) = (payload.dtype(), side.dtype());
    let side_bytes = side.byte_len();
    let mut packed = side.to_le_bytes();
    packed.extend(payload.to_le_bytes());
    let message = packed.len();
    let layout = SideLayout {
        pdtype,
        sdtype,
        side_bytes,
        message,
    };
    (Buffer::U8(packed), layout)
}

/// Every rank's message, gathered, split into the payloads and the sides, each rank-major.
pub fn unpack_with_side(all: Buffer, layout: SideLayout) -> Result<(Buffer, Buffer), CommError> {
    let SideLayout {
        pdtype,
        sdtype,
        side_bytes,
        message,
    } = layout;
    let all = all
        .into_u8()
        .map_err(|b| CommError::Internal(format!("all_gather of u8 returned {}", b.dtype())))?;
    let world = all.len().checked_div(message).unwrap_or(0);
    let (mut payloads, mut sides) = (
        Vec::with_capacity(world * (message - side_bytes)),
        Vec::with_capacity(world * side_bytes),
    );
    for piece in all.chunks_exact(message.max(1)) {
        sides.extend_from_slice(&piece[..side_bytes]);
        payloads.extend_from_slice(&piece[side_bytes..]);
    }
    let unpack = |dtype: DType, bytes: &[u8]| {
        crate::buffer_from_le_bytes(dtype, bytes).ok_or_else(|| {
            CommError::Internal(format!(
                "{} bytes are not a whole number of {dtype} elements",
                bytes.len()
            ))
        })
    };
    Ok((unpack(pdtype, &payloads)?, unpack(sdtype, &sides)?))
}
