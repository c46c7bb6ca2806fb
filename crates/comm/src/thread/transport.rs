//! The thread backend's transport: collectives over shared memory between the ranks' comm
//! streams.
//!
//! # Slot protocol (the invariant behind the `unsafe`)
//! Every collective is one *slot*, executed by every rank's stream in issue order:
//! 1. **Exchange**: each rank publishes a descriptor with a raw pointer to its buffer and waits
//!    for all others (`Rendezvous::exchange`). From here until step 3 the owning stream does not
//!    touch its `Buffer` through Rust references: it is blocked in this function and uses only
//!    the published pointers, like its peers.
//! 2. **Move**: if all descriptors agree, rank `r` reads and writes only *its* element range
//!    (chunk `r`) of the buffers (all-reduce, reduce-scatter, all-gather), or only its own
//!    buffer (broadcast reads the root's buffer, which nobody writes). Ranges of different
//!    ranks are disjoint, so there are no data races.
//! 3. **Barrier**: nobody leaves the slot until every rank finished moving, so no buffer is
//!    freed, resized or reused while a peer still holds its pointer. A rank that fails in the
//!    middle (timeout, dead peer) never reaches step 2 for that slot, and an error at step 1
//!    means some rank will never touch the pointers again.
//!
//! # Small all-reduces: one rendezvous
//! An all-reduce of at most [`EAGER_BYTES`] runs in one rendezvous instead of two (the
//! handshakes, not the bytes, are what a small collective costs): each rank first copies its
//! input into its *staging area* (half `slot % 2` of it), publishes a pointer to that copy
//! instead of its buffer, and after the exchange reduces every rank's copy, in rank order (the
//! same sum on every rank), into its own buffer. Nobody writes memory a peer reads, so no
//! closing barrier is needed. A rank rewrites half `slot % 2` only in slot `slot + 2`, after
//! the exchange of `slot + 1`, which every peer reaches only once done reading `slot`'s copies;
//! the staging areas belong to the rendezvous, so they outlive a rank that leaves first.

use half::{bf16, f16};

use super::desc::{validate, OpDesc, OpKind, SharedPtr};
use super::rendezvous::Rendezvous;
use crate::kernels::{reduce_range, Element};
use crate::stream::Transport;
use crate::{Buffer, CommError, DType, ReduceOp};
use std::sync::Arc;

/// Chunk boundaries are multiples of this many elements (at least one cache line).
const CHUNK_ALIGN: usize = 32;

/// The largest all-reduce (in bytes) that runs in one rendezvous through the staging areas
/// (module docs); larger ones are bandwidth-bound and reduce in place, each rank its chunk.
pub(crate) const EAGER_BYTES: usize = 8 << 10;

/// One rank's end of a [`super::ThreadGroup`]: the [`Transport`] of the thread backend.
pub struct ThreadTransport {
    rank: usize,
    shared: Arc<Rendezvous>,
    slot: u64,
    /// This rank's staging area (owned by `shared`), made at its first small all-reduce: two
    /// halves of [`EAGER_BYTES`], one per slot parity.
    stage: Option<SharedPtr>,
}

impl ThreadTransport {
    pub(crate) fn new(rank: usize, shared: Arc<Rendezvous>) -> Self {
        ThreadTransport {
            rank,
            shared,
            slot: 0,
            stage: None,
        }
    }

    /// Step 1 of a slot: publishes this rank's descriptor (its buffer, or its staged copy, at
    /// `ptr`), waits for every rank's and checks that they agree. A mismatch moves nothing, so
    /// it needs no barrier: every rank returns the same verdict here, whichever path (one
    /// rendezvous or two) its own length chose.
    fn agree(
        &mut self,
        kind: OpKind,
        dtype: Option<DType>,
        len: usize,
        tag: &str,
        ptr: *mut u8,
    ) -> Result<Arc<[OpDesc]>, CommError> {
        let desc = OpDesc {
            slot: self.slot,
            kind,
            dtype,
            len,
            tag: tag.to_string(),
            ptr: SharedPtr(ptr),
        };
        self.slot += 1;
        let descs = self.shared.exchange(self.rank, desc)?;
        validate(&descs)?;
        Ok(descs)
    }

    /// An all-reduce of at most [`EAGER_BYTES`] in one rendezvous (module docs).
    fn all_reduce_eager(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError> {
        let dtype = buf.dtype();
        let len = buf.len();
        let bytes = len * dtype.size_in_bytes();
        let stage = match self.stage {
            Some(stage) => stage,
            None => *self.stage.insert(SharedPtr(self.shared.new_stage(2 * EAGER_BYTES))),
        };
        let half = (self.slot % 2) as usize * EAGER_BYTES;
        // SAFETY: `bytes <= EAGER_BYTES`, so the copy fits in half `slot % 2` of this rank's
        // staging area, which no peer reads now (module docs: it was last read in slot
        // `slot - 2`, and every peer is past the exchange of `slot - 1`).
        let copy = unsafe { stage.0.add(half) };
        unsafe { std::ptr::copy_nonoverlapping(buf.as_mut_ptr().cast_const(), copy, bytes) };
        let descs = self.agree(OpKind::AllReduce(op), Some(dtype), len, tag, copy)?;
        let srcs: Vec<*mut u8> = descs.iter().map(|d| d.ptr.0).collect();
        // SAFETY: every rank agreed on this all-reduce of `len` elements, so each pointer is a
        // peer's staged copy of `len` elements, not rewritten before this rank's next exchange;
        // the destination is this rank's own buffer.
        unsafe { reduce_typed(dtype, &srcs, &[buf.as_mut_ptr()], 0, len, op) };
        Ok(())
    }

    /// Runs one slot of the protocol on `buf` (none for a barrier) whose input had
    /// `input_len` elements.
    fn run_slot(
        &mut self,
        kind: OpKind,
        buf: Option<&mut Buffer>,
        input_len: usize,
        tag: &str,
    ) -> Result<(), CommError> {
        let (dtype, ptr) = match buf {
            Some(buf) => (Some(buf.dtype()), buf.as_mut_ptr()),
            None => (None, std::ptr::null_mut()),
        };
        let descs = self.agree(kind, dtype, input_len, tag, ptr)?;
        // SAFETY: step 2 of the slot protocol (module docs): all ranks agreed, every pointer
        // is live until the barrier below, and this rank touches only its range.
        unsafe { move_data(self.rank, &descs) };
        self.shared.barrier(self.rank, tag)
    }
}

/// Element range of rank `rank`'s chunk when `len` elements are split over `world` ranks.
fn chunk(len: usize, world: usize, rank: usize) -> (usize, usize) {
    let per = len.div_ceil(world).next_multiple_of(CHUNK_ALIGN);
    ((rank * per).min(len), ((rank + 1) * per).min(len))
}

/// # Safety
/// Step 2 of the slot protocol: `descs` agree and their pointers stay valid until every rank
/// reached the closing barrier.
unsafe fn move_data(rank: usize, descs: &[OpDesc]) {
    let world = descs.len();
    let d = &descs[rank];
    let Some(dtype) = d.dtype else { return };
    let ptrs: Vec<*mut u8> = descs.iter().map(|d| d.ptr.0).collect();
    let esize = dtype.size_in_bytes();
    match d.kind {
        OpKind::AllReduce(op) => {
            let (lo, hi) = chunk(d.len, world, rank);
            unsafe { reduce_typed(dtype, &ptrs, &ptrs, lo, hi, op) };
        }
        OpKind::ReduceScatter(op) => {
            let per = d.len / world;
            let (lo, hi) = (rank * per, (rank + 1) * per);
            unsafe { reduce_typed(dtype, &ptrs, &ptrs[rank..rank + 1], lo, hi, op) };
        }
        OpKind::AllGather => {
            // Each buffer holds world*len elements, the owner's input already at its place.
            let seg = d.len * esize;
            for (peer, &dst) in ptrs.iter().enumerate() {
                if peer != rank && seg > 0 {
                    // SAFETY: segment `rank` of every buffer belongs to this rank in this slot.
                    unsafe { std::ptr::copy_nonoverlapping(ptrs[rank].add(rank * seg), dst.add(rank * seg), seg) };
                }
            }
        }
        OpKind::Broadcast { root } => {
            if rank != root && d.len > 0 {
                // SAFETY: the root's buffer is only read in this slot; ours only written by us.
                unsafe { std::ptr::copy_nonoverlapping(ptrs[root], ptrs[rank], d.len * esize) };
            }
        }
        OpKind::Barrier => {}
    }
}

/// # Safety
/// As [`reduce_range`], with `u8` pointers to buffers of element type `dtype`.
unsafe fn reduce_typed(dtype: DType, srcs: &[*mut u8], dsts: &[*mut u8], lo: usize, hi: usize, op: ReduceOp) {
    unsafe fn typed<E: Element>(srcs: &[*mut u8], dsts: &[*mut u8], lo: usize, hi: usize, op: ReduceOp) {
        let srcs: Vec<*const E> = srcs.iter().map(|p| p.cast_const().cast()).collect();
        let dsts: Vec<*mut E> = dsts.iter().map(|p| p.cast()).collect();
        let world = srcs.len() as f32;
        unsafe { reduce_range(&srcs, &dsts, lo, hi, op, world) }
    }
    match dtype {
        DType::F32 => unsafe { typed::<f32>(srcs, dsts, lo, hi, op) },
        DType::F16 => unsafe { typed::<f16>(srcs, dsts, lo, hi, op) },
        DType::BF16 => unsafe { typed::<bf16>(srcs, dsts, lo, hi, op) },
        DType::U8 | DType::I8 | DType::F64 | DType::I64 => {
            unreachable!("validate rejects reductions on {dtype}")
        }
    }
}

impl Transport for ThreadTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world()
    }

    fn all_reduce(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError> {
        let len = buf.len();
        if self.shared.world() > 1 && len * buf.dtype().size_in_bytes() <= EAGER_BYTES {
            return self.all_reduce_eager(buf, op, tag);
        }
        self.run_slot(OpKind::AllReduce(op), Some(buf), len, tag)
    }

    fn broadcast(&mut self, buf: &mut Buffer, root: usize, tag: &str) -> Result<(), CommError> {
        let len = buf.len();
        self.run_slot(OpKind::Broadcast { root }, Some(buf), len, tag)
    }

    fn all_gather(&mut self, buf: &mut Buffer, tag: &str) -> Result<(), CommError> {
        let len = buf.len();
        let world = self.shared.world();
        buf.resize(len * world);
        if self.rank > 0 {
            buf.copy_within(0, len, self.rank * len);
        }
        self.run_slot(OpKind::AllGather, Some(buf), len, tag)
    }

    fn reduce_scatter(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError> {
        let len = buf.len();
        self.run_slot(OpKind::ReduceScatter(op), Some(&mut *buf), len, tag)?;
        let per = len / self.shared.world();
        buf.copy_within(self.rank * per, per, 0);
        buf.resize(per);
        Ok(())
    }

    fn barrier(&mut self, tag: &str) -> Result<(), CommError> {
        self.run_slot(OpKind::Barrier, None, 0, tag)
    }

    fn close(&mut self, reason: &str) {
        self.shared.mark_dead(self.rank, reason.to_string());
    }
}

impl Drop for ThreadTransport {
    fn drop(&mut self) {
        self.shared
            .mark_dead(self.rank, format!("rank {}'s comm stream ended", self.rank));
    }
}
