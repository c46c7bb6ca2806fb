//! Reduction kernels over raw buffers, shared by the thread backend (the ranks' own buffers)
//! and the shared-memory path (a node's segment): f32 accumulation, in rank order, rounding
//! once at the end.

use half::{bf16, f16};

use crate::buffer::nan_max;
use crate::ReduceOp;

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

/// Elements per tile of the general kernel: its f32 accumulator (256 bytes) stays in
/// registers or L1 while every source streams through once. (A tile of 2048, an 8 KiB
/// accumulator written and re-read per source, ran at 0.55-0.62x memcpy on 2 ranks at 16-64
/// MiB; 64 at 0.73-0.94x.)
const TILE: usize = 64;

/// Reduces elements `lo..hi` over the buffers `srcs` (one per rank, rank order) with `op`,
/// divides by `divisor` when `op` is `Avg`, and writes the result to elements `lo..hi` of every
/// buffer in `dsts` (of element type `O`: the sources' type, or f32 to keep a partial sum
/// unrounded). Two sources (two ranks) take a single fused pass; more go tile by tile.
/// Either way each element is `((s0 + s1) + s2) + ...` in f32, then divided, then rounded
/// once: the same bits whatever the kernel.
///
/// # Safety
/// Every pointer must be valid for `hi` elements; during the call no other thread or process
/// may write elements `lo..hi` of any of these buffers, nor read them in `dsts` (the caller owns
/// that range in all of them). A destination may be one of the sources.
pub(crate) unsafe fn reduce_range<E: Element, O: Element>(
    srcs: &[*const E],
    dsts: &[*mut O],
    lo: usize,
    hi: usize,
    op: ReduceOp,
    divisor: f32,
) {
    // SAFETY (all arms): the caller's contract.
    unsafe {
        match (srcs, dsts) {
            (&[a, b], &[d]) => pair(a, b, [d], lo, hi, op, divisor),
            (&[a, b], &[d0, d1]) => pair(a, b, [d0, d1], lo, hi, op, divisor),
            _ => tiles(srcs, dsts, lo, hi, op, divisor),
        }
    }
}

/// Elements per step of the two-source kernel: small enough to stay in registers, a whole
/// number of vectors.
const PAIR_TILE: usize = 16;

/// Two sources in one pass: each element is read once from each and written once to each
/// destination (a memcpy's traffic per byte; the fastest shape on 2 ranks: 0.9-1.1x memcpy at
/// 16 MiB where the general kernel reaches 0.75-0.9x).
///
/// # Safety
/// As [`reduce_range`].
#[inline(always)]
unsafe fn pair<E: Element, O: Element, const M: usize>(
    a: *const E,
    b: *const E,
    dsts: [*mut O; M],
    lo: usize,
    hi: usize,
    op: ReduceOp,
    divisor: f32,
) {
    #[inline(always)]
    unsafe fn run<E: Element, O: Element, const M: usize>(
        a: *const E,
        b: *const E,
        dsts: [*mut O; M],
        lo: usize,
        hi: usize,
        combine: impl Fn(f32, f32) -> f32,
    ) {
        let mut i = lo;
        while i < hi {
            let n = PAIR_TILE.min(hi - i);
            let mut x = [0f32; PAIR_TILE];
            {
                // SAFETY: `i + n <= hi`; these views end before anything is written.
                let (xa, xb) = unsafe {
                    (
                        std::slice::from_raw_parts(a.add(i), n),
                        std::slice::from_raw_parts(b.add(i), n),
                    )
                };
                for ((x, a), b) in x.iter_mut().zip(xa).zip(xb) {
                    *x = combine(a.to_f32(), b.to_f32());
                }
            }
            for d in dsts {
                // SAFETY: as above; no view of the sources is alive.
                let out = unsafe { std::slice::from_raw_parts_mut(d.add(i), n) };
                for (o, x) in out.iter_mut().zip(&x) {
                    *o = O::from_f32(*x);
                }
            }
            i += n;
        }
    }
    // SAFETY (all arms): the caller's contract.
    unsafe {
        match op {
            ReduceOp::Sum => run(a, b, dsts, lo, hi, |x, y| x + y),
            ReduceOp::Avg => run(a, b, dsts, lo, hi, |x, y| (x + y) / divisor),
            ReduceOp::Max => run(a, b, dsts, lo, hi, nan_max),
        }
    }
}

/// Any number of sources, tile by tile.
///
/// # Safety
/// As [`reduce_range`].
unsafe fn tiles<E: Element, O: Element>(
    srcs: &[*const E],
    dsts: &[*mut O],
    lo: usize,
    hi: usize,
    op: ReduceOp,
    divisor: f32,
) {
    let mut acc = [0f32; TILE];
    let mut start = lo;
    while start < hi {
        let n = TILE.min(hi - start);
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
