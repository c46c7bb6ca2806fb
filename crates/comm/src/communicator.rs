//! The `Communicator` trait: asynchronous collectives on one rank.

use std::sync::Arc;
use std::time::Duration;

use crate::{Buffer, CommError, ReduceOp, Work};

/// One rank's view of a group of `world_size` ranks. Every collective is issued at once and
/// returns a [`Work`] handle; collectives execute on this rank's comm stream in the order they
/// were issued, while the caller goes on computing. All ranks must issue the same collectives
/// (kind, dtype, length, op, root, tag) in the same order; a backend reports a difference as
/// [`crate::CommError::Mismatch`]. The tag names the collective (e.g. `"bucket 3"`) in traces
/// and error messages.
///
/// Object safe: data-parallel code holds an `Arc<dyn Communicator>`.
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
