//! Reduction kernels over raw buffers, shared by the thread backend (the ranks' own buffers)
//! and the shared-memory path (a node's segment): f32 accumulation, in rank order, rounding
//! once at the end.

use half::{bf16, f16};

use crate::buffer::nan_max;
use crate::ReduceOp;

/// Elements per block: the f32 accumulator (8 KiB) and the blocks being read stay in L1.
const BLOCK: usize = 2048;

/// An element type reduced through an f32 accumulator.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Reduces elements `lo..hi` over the buffers `srcs` (one per rank, rank order) with `op`,
/// divides by `divisor` when `op` is `Avg`, and writes the result to elements `lo..hi` of every
/// buffer in `dsts` (of element type `O`: the sources' type, or f32 to keep a partial sum
/// unrounded).
///
/// # Safety
/// Every pointer must be valid for `hi` elements; during the call no other thread or process
/// may write elements `lo..hi` of any of these buffers, nor read them in `dsts` (the caller owns
/// that range in all of them).
pub(crate) unsafe fn reduce_range<E: Element, O: Element>(
    srcs: &[*const E],
    dsts: &[*mut O],
    lo: usize,
    hi: usize,
    op: ReduceOp,
    divisor: f32,
) {
    let mut acc = [0f32; BLOCK];
    let mut start = lo;
    while start < hi {
        let n = BLOCK.min(hi - start);
        let acc = &mut acc[..n];
        // SAFETY: in bounds by the caller's contract; the range is owned by this thread.
        let first = unsafe { std::slice::from_raw_parts(srcs[0].add(start), n) };
        for (a, x) in acc.iter_mut().zip(first) {
            *a = x.to_f32();
        }
        for &src in &srcs[1..] {
            // SAFETY: as above.
            let xs = unsafe { std::slice::from_raw_parts(src.add(start), n) };
            match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    for (a, x) in acc.iter_mut().zip(xs) {
                        *a += x.to_f32();
                    }
                }
                ReduceOp::Max => {
                    for (a, x) in acc.iter_mut().zip(xs) {
                        *a = nan_max(*a, x.to_f32());
                    }
                }
            }
        }
        if op == ReduceOp::Avg {
            for a in acc.iter_mut() {
                *a /= divisor;
            }
        }
        for &dst in dsts {
            // SAFETY: as above; `first`/`xs` are no longer used.
            let out = unsafe { std::slice::from_raw_parts_mut(dst.add(start), n) };
            for (o, a) in out.iter_mut().zip(acc.iter()) {
                *o = O::from_f32(*a);
            }
        }
        start += n;
    }
}

/// Writes `src` (f32 partial results), divided by `divisor` when `op` is `Avg`, into `dst`
/// as `E`, rounding once.
pub(crate) fn finish_into<E: Element>(src: &[f32], dst: &mut [E], op: ReduceOp, divisor: f32) {
    if op == ReduceOp::Avg {
        for (o, a) in dst.iter_mut().zip(src) {
            *o = E::from_f32(*a / divisor);
        }
    } else {
        for (o, a) in dst.iter_mut().zip(src) {
            *o = E::from_f32(*a);
        }
    }
}
