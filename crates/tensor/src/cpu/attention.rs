//! Causal self-attention as one kernel per direction: each (batch, head) pair reads its
//! query, key and value columns straight out of the packed `[B, T, 3d]` projection and
//! writes its output columns straight into `[B, T, d]` (and, backward, its gradient
//! columns into `[B, T, 3d]`), so no head is ever gathered into a contiguous copy. The
//! pairs run in parallel on the calling thread's compute pool.
//!
//! The arithmetic is the composed path's (`crate::composed`), step for step: the same
//! GEMMs over the same operands, the same scaling, masking and softmax expressions, so
//! both give the same bits.

use crate::backend::Attention;
use rayon::prelude::*;

use super::f16_storage::{half_dtype, narrow, widen};
use super::matmul::gemm_strided;
use super::softmax_row::softmax_in_place;
use super::{float_kernel, same, view};
use crate::threads::{compute_threads, install};
use crate::Buffer;
use crate::{Element, Float, Layout, Result};

/// Base pointers shared by the (batch, head) tasks: each task writes only its own
/// columns or its own `[T, T]` block, and reads anything.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

/// Sizes of one call: batch, time, heads, head width.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    nh: usize,
    hd: usize,
}

impl Dims {
    fn from_layout(l: &Layout, n_heads: usize) -> Dims {
        let (b, t, w) = (l.shape()[0], l.shape()[1], l.shape()[2]);
        Dims {
            b,
            t,
            nh: n_heads,
            hd: w / 3 / n_heads,
        }
    }

    fn d(&self) -> usize {
        self.nh * self.hd
    }
}

/// Runs `f(pair)` for every (batch, head) pair, `pair = batch * heads + head`.
fn for_each_pair(pairs: usize, f: impl Fn(usize) + Sync + Send) {
    if compute_threads() > 1 && pairs > 1 {
        install(|| (0..pairs).into_par_iter().for_each(&f));
    } else {
        (0..pairs).for_each(f);
    }
}

/// Query rows per block of the triangular products: each block of rows `r0..r1` multiplies
/// only against keys `0..r1`, so the masked upper triangle is (mostly) never computed.
const BLOCK: usize = 32;

/// The row blocks `r0..r1` of `t` query rows: `t / BLOCK` blocks of at least [`BLOCK`] rows
/// (one block when `t < 2 * BLOCK`), so that no block is small enough for the `gemm` crate to
/// take another kernel (a dot-product or matrix-vector one) that sums in another order than
/// the full product does.
fn row_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = (t / BLOCK).max(1);
    (0..n).map(move |i| (i * t / n, (i + 1) * t / n))
}

/// Scales the scores of query `i` (`row` holds keys `0..len`, `len > i`), and replaces keys
/// `0..=i` by their softmax ([`softmax_in_place`]); the future keys `i+1..len` become 0.
/// The same bits as scaling the whole row, setting the future to `-inf` and taking the
/// softmax of it all, as the composed path does: the future adds exact zeros.
fn masked_softmax_row<T: Float>(row: &mut [T], i: usize, scale: T) {
    let (now, future) = row.split_at_mut(i + 1);
    future.fill(T::ZERO);
    for v in now.iter_mut() {
        *v = *v * scale + T::ZERO;
    }
    softmax_in_place(now);
}

fn forward<T: Float>(x: &[T], dm: Dims, scale: T) -> (Vec<T>, Vec<T>) {
    {
        let Dims { b, t, nh, hd } = dm;
        let (d, w) = (dm.d(), 3 * dm.d());
        let mut y = vec![T::ZERO; b * t * d];
        let mut probs = vec![T::ZERO; b * nh * t * t];
        let (py, pp) = (Shared(y.as_mut_ptr()), Shared(probs.as_mut_ptr()));
        let px = Shared(x.as_ptr() as *mut T);
        for_each_pair(b * nh, |pair| {
            let (bi, h) = (pair / nh, pair % nh);
            let (py, pp, px) = (py, pp, px);
            // SAFETY: `x` holds `b*t*3d` elements and every offset below stays inside the
            // batch's `[t, 3d]` block; this task alone writes block `pair` of `probs` and
            // the columns `h*hd..(h+1)*hd` of batch `bi` in `y`.
            unsafe {
                let base = px.0.add(bi * t * w + h * hd) as *const T;
                let p = pp.0.add(pair * t * t);
                let out = py.0.add(bi * t * d + h * hd);
                // Per block of query rows r0..r1, only keys 0..r1 (the rest of P stays 0).
                for (r0, r1) in row_blocks(t) {
                    let pr = p.add(r0 * t);
                    // S = Q K^T  ([r, hd] x [hd, r1])
                    gemm_strided(
                        r1 - r0,
                        r1,
                        hd,
                        (pr, t, 1),
                        base.add(r0 * w),
                        w,
                        1,
                        base.add(d),
                        1,
                        w,
                        1,
                    );
                    for i in r0..r1 {
                        masked_softmax_row(std::slice::from_raw_parts_mut(p.add(i * t), r1), i, scale);
                    }
                    // Y = P V  ([r, r1] x [r1, hd]) into this head's columns of y
                    gemm_strided(
                        r1 - r0,
                        hd,
                        r1,
                        (out.add(r0 * d), d, 1),
                        pr,
                        t,
                        1,
                        base.add(2 * d),
                        w,
                        1,
                        1,
                    );
                }
            }
        });
        (y, probs)
    }
}

fn backward<T: Float>(x: &[T], probs: &[T], gy: &[T], dm: Dims, scale: T) -> Vec<T> {
    let Dims { b, t, nh, hd } = dm;
    let (d, w) = (dm.d(), 3 * dm.d());
    let mut dx = vec![T::ZERO; b * t * w];
    let pdx = Shared(dx.as_mut_ptr());
    let (px, pp, pg) = (
        Shared(x.as_ptr() as *mut T),
        Shared(probs.as_ptr() as *mut T),
        Shared(gy.as_ptr() as *mut T),
    );
    for_each_pair(b * nh, |pair| {
        let (bi, h) = (pair / nh, pair % nh);
        let (pdx, px, pp, pg) = (pdx, px, pp, pg);
        let mut ds = vec![T::ZERO; t * t];
        // SAFETY: as in `forward`; this task alone writes the columns of head `h` (in
        // each of the q, k, v thirds) of batch `bi` in `dx`, and its own `ds`.
        unsafe {
            let base = px.0.add(bi * t * w + h * hd) as *const T;
            let p = pp.0.add(pair * t * t) as *const T;
            let g = pg.0.add(bi * t * d + h * hd) as *const T;
            let dbase = pdx.0.add(bi * t * w + h * hd);
            let dsp = ds.as_mut_ptr();
            // Per block of query rows r0..r1, only keys 0..r1: the rest of dS stays 0.
            for (r0, r1) in row_blocks(t) {
                // dP = dY V^T  ([r, hd] x [hd, r1])
                let dsr = dsp.add(r0 * t);
                gemm_strided(
                    r1 - r0,
                    r1,
                    hd,
                    (dsr, t, 1),
                    g.add(r0 * d),
                    d,
                    1,
                    base.add(2 * d),
                    1,
                    w,
                    1,
                );
                softmax_grad_rows(p, dsp, t, (r0, r1), scale);
                // dQ = dS K  ([r, r1] x [r1, hd])
                gemm_strided(
                    r1 - r0,
                    hd,
                    r1,
                    (dbase.add(r0 * w), w, 1),
                    dsr,
                    t,
                    1,
                    base.add(d),
                    w,
                    1,
                    1,
                );
            }
            key_value_grads(dm, base, p, g, dsp, dbase);
        }
    });
    dx
}

/// dS = P * (dP - sum(dP * P)) for query rows `r0..r1` of `ds` (holding dP for keys `0..r1`),
/// zero in the future, times the scale.
///
/// # Safety
/// `p` holds `t * t` probabilities and `dsp` `t * t` values, rows `r0..r1` of which only this
/// task touches.
unsafe fn softmax_grad_rows<T: Float>(p: *const T, dsp: *mut T, t: usize, (r0, r1): (usize, usize), scale: T) {
    // SAFETY: as the caller promises.
    unsafe {
        // dS = P * (dP - sum(dP * P)), zero in the future, times the scale
        for i in r0..r1 {
            let pr = std::slice::from_raw_parts(p.add(i * t), i + 1);
            let row = std::slice::from_raw_parts_mut(dsp.add(i * t), r1);
            let (now, future) = row.split_at_mut(i + 1);
            future.fill(T::ZERO);
            let dot: T = pr.iter().zip(now.iter()).map(|(&a, &b)| a * b).sum();
            // one pass: the product rounded, then scaled, as two passes would
            for (o, &y) in now.iter_mut().zip(pr) {
                *o = y * (*o - dot) * scale + T::ZERO;
            }
        }
    }
}

/// dK and dV of one head from its dS (`dsp`), probabilities `p` and output gradient `g`,
/// written into the k and v columns at `dbase`.
///
/// # Safety
/// The pointers are those of `backward`'s task for one head: `base` its q, k, v columns of
/// `x`, `dbase` the same columns of `dx`, which this task alone writes.
unsafe fn key_value_grads<T: Float>(dm: Dims, base: *const T, p: *const T, g: *const T, dsp: *mut T, dbase: *mut T) {
    let Dims { t, hd, .. } = dm;
    let (d, w) = (dm.d(), 3 * dm.d());
    // SAFETY: as the caller promises.
    unsafe {
        // Per block of keys c0..c1, only the queries c0..t that see them.
        for (c0, c1) in row_blocks(t) {
            let rows = t - c0;
            // dK^T = Q^T dS  ([hd, rows] x [rows, c]), written transposed into the k columns
            let dk = dbase.add(d + c0 * w);
            gemm_strided(
                hd,
                c1 - c0,
                rows,
                (dk, 1, w),
                base.add(c0 * w),
                1,
                w,
                dsp.add(c0 * t + c0),
                t,
                1,
                1,
            );
            // dV = P^T dY  ([c, rows] x [rows, hd])
            let dv = dbase.add(2 * d + c0 * w);
            gemm_strided(
                c1 - c0,
                hd,
                rows,
                (dv, w, 1),
                p.add(c0 * t + c0),
                1,
                t,
                g.add(c0 * d),
                d,
                1,
                1,
            );
        }
    }
}

impl Attention for Buffer {
    fn causal_attention(&self, l: &Layout, n_heads: usize, scale: f64) -> Result<(Buffer, Buffer)> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            let (y, p) = x.causal_attention(&xl, n_heads, scale)?;
            return Ok((narrow(y, h), narrow(p, h)));
        }
        let qkv = self;
        float_kernel!("causal_attention", qkv, xs: T => {
            let (y, p) = forward::<T>(view(xs, l), Dims::from_layout(l, n_heads), T::from_f64(scale));
            Ok((T::wrap(y), T::wrap(p)))
        })
    }

    fn causal_attention_backward(
        &self,
        l: &Layout,
        probs: (&Buffer, &Layout),
        gy: (&Buffer, &Layout),
        n_heads: usize,
        scale: f64,
    ) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let ((x, xl), (p, pl), (g, gl)) = (widen(self, l), widen(probs.0, probs.1), widen(gy.0, gy.1));
            return Ok(narrow(
                x.causal_attention_backward(&xl, (&p, &pl), (&g, &gl), n_heads, scale)?,
                h,
            ));
        }
        let qkv = self;
        let op = "causal_attention_backward";
        float_kernel!(op, qkv, xs: T => {
            let (ps, gs) = (view(same::<T>(op, probs.0)?, probs.1), view(same::<T>(op, gy.0)?, gy.1));
            let dx = backward::<T>(view(xs, l), ps, gs, Dims::from_layout(l, n_heads), T::from_f64(scale));
            Ok(T::wrap(dx))
        })
    }
}
