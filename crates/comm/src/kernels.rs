//! Reduction kernels over raw buffers, shared by the thread backend (the ranks' own buffers)
//! and the shared-memory path (a node's segment): f32 accumulation, in rank order, rounding
//! once at the end.

use half::{bf16, f16};

use crate::collective::nan_max;
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

/// `half`'s bits, branch-free (`brigade_dtype::convert`), so that a tile's loop vectorizes.
impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        brigade_dtype::convert::widen_bf16(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        brigade_dtype::convert::round_bf16(x)
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

/// `1 / divisor` when multiplying by it gives the same bits as dividing by `divisor` for every
/// input: when `divisor` is a power of two (its reciprocal is exact, and both operations round
/// the same real number). A multiply costs a fraction of a division (2 ranks: 6x in cache).
#[inline]
fn exact_reciprocal(divisor: f32) -> Option<f32> {
    let inv = 1.0 / divisor;
    (divisor.is_normal() && inv.is_normal() && divisor.to_bits() & 0x007f_ffff == 0).then_some(inv)
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
        // One tile as fixed-size arrays: the compiler then keeps it in vector registers without
        // a length check per element (4.5x faster in cache than a loop bounded by
        // `min(16, hi - i)`, 2.6x at 16 MiB, on the AMD EPYC of BENCHMARKS.md).
        let pair = |xa: &[E; PAIR_TILE], xb: &[E; PAIR_TILE]| {
            let mut x = [0f32; PAIR_TILE];
            for k in 0..PAIR_TILE {
                x[k] = combine(xa[k].to_f32(), xb[k].to_f32());
            }
            x
        };
        let mut i = lo;
        while i + PAIR_TILE <= hi {
            // SAFETY: `i + PAIR_TILE <= hi`; the views of the sources end with `step`, before
            // anything is written.
            let x = unsafe { pair(&*a.add(i).cast(), &*b.add(i).cast()) };
            for d in dsts {
                // SAFETY: as above.
                unsafe { store(d.add(i), &x, PAIR_TILE) };
            }
            i += PAIR_TILE;
        }
        if i < hi {
            // The last, shorter tile through padded copies (the padding is never written out).
            let n = hi - i;
            // SAFETY: `i + n == hi`; the copies are taken before anything is written.
            let x = unsafe { pair(&pad(a.add(i), n), &pad(b.add(i), n)) };
            for d in dsts {
                // SAFETY: as above.
                unsafe { store(d.add(i), &x, n) };
            }
        }
    }
    // SAFETY (all arms): the caller's contract.
    unsafe {
        match op {
            ReduceOp::Sum => run(a, b, dsts, lo, hi, |x, y| x + y),
            ReduceOp::Avg => match exact_reciprocal(divisor) {
                Some(inv) => run(a, b, dsts, lo, hi, |x, y| (x + y) * inv),
                None => run(a, b, dsts, lo, hi, |x, y| (x + y) / divisor),
            },
            ReduceOp::Max => run(a, b, dsts, lo, hi, nan_max),
        }
    }
}

/// Any number of sources, tile by tile: whole tiles straight from the buffers as fixed-size
/// arrays (see `pair`), the last, shorter one through padded copies.
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
    let inv = exact_reciprocal(divisor);
    let mut start = lo;
    while start + TILE <= hi {
        // SAFETY: in bounds by the caller's contract; the range is owned by this thread. The
        // views of the sources end with `reduce_tile`, before anything is written.
        let acc = reduce_tile(
            srcs.iter().map(|&s| unsafe { &*s.add(start).cast::<[E; TILE]>() }),
            op,
            divisor,
            inv,
        );
        for &dst in dsts {
            // SAFETY: as above.
            unsafe { store(dst.add(start), &acc, TILE) };
        }
        start += TILE;
    }
    if start < hi {
        // The last, shorter tile through padded copies (the padding is never written out).
        let n = hi - start;
        // SAFETY: `start + n == hi`; copied before anything is written.
        let padded: Vec<[E; TILE]> = srcs.iter().map(|&s| unsafe { pad(s.add(start), n) }).collect();
        let acc = reduce_tile(padded.iter(), op, divisor, inv);
        for &dst in dsts {
            // SAFETY: as above.
            unsafe { store(dst.add(start), &acc, n) };
        }
    }
}

/// The `n <= N` elements at `src` as a tile, zero-padded.
///
/// # Safety
/// `src` is valid for `n` reads.
#[inline(always)]
unsafe fn pad<E: Element, const N: usize>(src: *const E, n: usize) -> [E; N] {
    let mut tile = [E::from_f32(0.0); N];
    // SAFETY: the caller's contract; `n <= N`.
    unsafe { std::ptr::copy_nonoverlapping(src, tile.as_mut_ptr(), n.min(N)) };
    tile
}

/// Writes the first `n <= N` values of a tile to `dst`, rounded to `O` (a whole tile as one
/// fixed-size array, which the compiler keeps in vector registers).
///
/// # Safety
/// `dst` is valid for `n` writes that nobody else reads or writes meanwhile.
#[inline(always)]
unsafe fn store<O: Element, const N: usize>(dst: *mut O, x: &[f32; N], n: usize) {
    if n == N {
        // SAFETY: the caller's contract.
        let out = unsafe { &mut *dst.cast::<[O; N]>() };
        for k in 0..N {
            out[k] = O::from_f32(x[k]);
        }
    } else {
        for (k, x) in x.iter().take(n).enumerate() {
            // SAFETY: the caller's contract; `k < n`.
            unsafe { dst.add(k).write(O::from_f32(*x)) };
        }
    }
}

/// One tile over every source (at least one), in source order, in f32; `Avg` divides (or
/// multiplies by `inv`, the exact reciprocal when there is one).
#[inline(always)]
fn reduce_tile<'a, E: Element>(
    mut srcs: impl Iterator<Item = &'a [E; TILE]>,
    op: ReduceOp,
    divisor: f32,
    inv: Option<f32>,
) -> [f32; TILE] {
    let mut acc = [0f32; TILE];
    if let Some(first) = srcs.next() {
        for k in 0..TILE {
            acc[k] = first[k].to_f32();
        }
    }
    for xs in srcs {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => {
                for k in 0..TILE {
                    acc[k] += xs[k].to_f32();
                }
            }
            ReduceOp::Max => {
                for k in 0..TILE {
                    acc[k] = nan_max(acc[k], xs[k].to_f32());
                }
            }
        }
    }
    if op == ReduceOp::Avg {
        match inv {
            Some(inv) => acc.iter_mut().for_each(|a| *a *= inv),
            None => acc.iter_mut().for_each(|a| *a /= divisor),
        }
    }
    acc
}

/// Writes `src` (f32 partial results), divided by `divisor` when `op` is `Avg`, into `dst`
/// as `E`, rounding once.
pub(crate) fn finish_into<E: Element>(src: &[f32], dst: &mut [E], op: ReduceOp, divisor: f32) {
    if op == ReduceOp::Avg {
        match exact_reciprocal(divisor) {
            Some(inv) => dst.iter_mut().zip(src).for_each(|(o, a)| *o = E::from_f32(*a * inv)),
            None => dst
                .iter_mut()
                .zip(src)
                .for_each(|(o, a)| *o = E::from_f32(*a / divisor)),
        }
    } else {
        for (o, a) in dst.iter_mut().zip(src) {
            *o = E::from_f32(*a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: `((s0 + s1) + s2) + ...` in f32, divided (never multiplied), rounded once.
    fn reference<E: Element>(srcs: &[Vec<E>], i: usize, op: ReduceOp, divisor: f32) -> E {
        let mut acc = srcs[0][i].to_f32();
        for s in &srcs[1..] {
            acc = match op {
                ReduceOp::Max => nan_max(acc, s[i].to_f32()),
                _ => acc + s[i].to_f32(),
            };
        }
        if op == ReduceOp::Avg {
            acc /= divisor;
        }
        E::from_f32(acc)
    }

    fn check<E: Element + PartialEq + std::fmt::Debug>(make: impl Fn(f32) -> E, to_bits: impl Fn(E) -> u32) {
        // Lengths around the tile sizes, so whole tiles and a short last one both run.
        for world in 2..=5 {
            for len in [1, 15, 16, 17, 63, 64, 65, 200, 1000] {
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                    for divisor in [2.0, 3.0, 4.0, 5.0, 0.5, 1e-40] {
                        let mut seed = 0x9e37_79b9_u32 ^ (len as u32 * 31 + world as u32);
                        let mut rnd = || {
                            seed ^= seed << 13;
                            seed ^= seed >> 17;
                            seed ^= seed << 5;
                            (seed as f32 / u32::MAX as f32 - 0.5) * 1e3
                        };
                        let srcs: Vec<Vec<E>> = (0..world).map(|_| (0..len).map(|_| make(rnd())).collect()).collect();
                        let (lo, hi) = (len / 7, len);
                        let mut out: Vec<E> = vec![make(0.0); len];
                        let ptrs: Vec<*const E> = srcs.iter().map(|s| s.as_ptr()).collect();
                        // SAFETY: every buffer holds `len >= hi` elements; nothing else runs.
                        unsafe { reduce_range(&ptrs, &[out.as_mut_ptr()], lo, hi, op, divisor) };
                        for i in lo..hi {
                            let want = reference(&srcs, i, op, divisor);
                            assert_eq!(
                                to_bits(out[i]),
                                to_bits(want),
                                "world {world} len {len} {op:?} / {divisor}: element {i} is {:?}, want {want:?}",
                                out[i]
                            );
                        }
                    }
                }
            }
        }
    }

    /// The fast kernels (whole tiles, a multiply for a power-of-two divisor) give the bits of
    /// the plain definition, for every element type, world size and divisor.
    #[test]
    fn kernels_give_the_bits_of_the_definition() {
        check(|x| x, f32::to_bits);
        check(f16::from_f32, |x| u32::from(x.to_bits()));
        check(bf16::from_f32, |x| u32::from(x.to_bits()));
    }

    #[test]
    fn only_powers_of_two_are_multiplied() {
        assert_eq!(exact_reciprocal(2.0), Some(0.5));
        assert_eq!(exact_reciprocal(0.25), Some(4.0));
        assert_eq!(exact_reciprocal(3.0), None);
        assert_eq!(exact_reciprocal(0.0), None);
        assert_eq!(exact_reciprocal(f32::INFINITY), None);
        assert_eq!(exact_reciprocal(1e-40), None); // subnormal
        assert_eq!(exact_reciprocal(2f32.powi(127)), None); // its reciprocal is subnormal
    }
}
