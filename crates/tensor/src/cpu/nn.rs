//! Neural-network kernels over the last axis on the CPU: softmax, log-softmax, layer norm,
//! embedding gather/scatter, causal mask, cross-entropy; each with its backward. Every
//! input arrives contiguous (the front end gathers strided views first).

use super::f16_storage::{half_dtype, narrow, widen};
use super::softmax_row::softmax_in_place;
use super::{float_kernel, indices, same, view};
use crate::backend::Nn;
use crate::threads::par_rows_mut;
use crate::Buffer;
use crate::{Element, Float, Layout, Result};

fn last_dim(l: &Layout) -> usize {
    l.shape().last().copied().unwrap_or(1)
}

/// Softmax (or log-softmax) of one row into `o`; returns the row's log-sum-exp
/// `ln(sum exp(x - m)) + m`.
#[inline(always)]
fn softmax_row<T: Float>(row: &[T], o: &mut [T], log: bool) -> T {
    let m = row
        .iter()
        .copied()
        .fold(T::NEG_INFINITY, |a, b| if b > a { b } else { a });
    let mut sum = T::ZERO;
    for (o, &v) in o.iter_mut().zip(row) {
        *o = (v - m).exp();
        sum += *o;
    }
    let lse = sum.ln() + m;
    if log {
        for (o, &v) in o.iter_mut().zip(row) {
            *o = v - lse;
        }
    } else {
        let inv = T::ONE / sum;
        for o in o.iter_mut() {
            *o *= inv;
        }
    }
    lse
}

fn softmax_rows<T: Float>(src: &[T], d: usize, log: bool) -> Vec<T> {
    let mut out = vec![T::ZERO; src.len()];
    par_rows_mut(&mut out, d, |r, o| {
        let row = &src[r * d..(r + 1) * d];
        if log {
            softmax_row(row, o, true);
        } else {
            o.copy_from_slice(row);
            softmax_in_place(o);
        }
    });
    out
}

/// Independent partial sums per row reduction: enough chains to hide the adder's latency
/// and fill two AVX2 registers of f32.
const LANES: usize = 16;

/// `sum f(x)` over a row with [`LANES`] partial sums (lane `l` adds elements `l, l + LANES,
/// ..`; the lanes are then added in order, then the tail): the loop vectorizes, and the bits
/// are the same on every CPU (no fused multiply-add, a fixed order).
#[inline(always)]
fn lane_sum<T: Float>(row: &[T], f: impl Fn(T) -> T) -> T {
    let mut acc = [T::ZERO; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += f(c[l]);
        }
    }
    let mut s = T::ZERO;
    for a in acc {
        s += a;
    }
    for &v in tail {
        s += f(v);
    }
    s
}

/// One row of [`layer_norm`]: returns `(mean, rstd)` and writes `y`.
#[inline(always)]
fn layer_norm_row<T: Float>(x: &[T], w: &[T], b: &[T], y: &mut [T], inv_d: T, eps: T) -> (T, T) {
    let mean = lane_sum(x, |v| v) * inv_d;
    let var = lane_sum(x, |v| (v - mean) * (v - mean)) * inv_d;
    let rstd = T::ONE / (var + eps).sqrt();
    for (((o, &v), &wv), &bv) in y.iter_mut().zip(x).zip(w).zip(b) {
        *o = (v - mean) * rstd * wv + bv;
    }
    (mean, rstd)
}

/// [`layer_norm_row`] over every row, writing `y` and the per-row `mean`, `rstd`.
#[inline(always)]
fn layer_norm_rows<T: Float>(xs: &[T], ws: &[T], bs: &[T], eps: T, out: &mut [T], mean: &mut [T], rstd: &mut [T]) {
    let d = ws.len();
    let inv_d = T::ONE / T::from_usize(d);
    let (pm, pr) = (RowPtr(mean.as_mut_ptr()), RowPtr(rstd.as_mut_ptr()));
    par_rows_mut(out, d, |r, o| {
        let (pm, pr) = (pm, pr);
        let (m, s) = layer_norm_row(&xs[r * d..(r + 1) * d], ws, bs, o, inv_d, eps);
        // SAFETY: `mean` and `rstd` hold one element per row, and only row `r`'s call
        // writes element `r`.
        unsafe {
            *pm.0.add(r) = m;
            *pr.0.add(r) = s;
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn layer_norm_rows_avx2<T: Float>(
    xs: &[T],
    ws: &[T],
    bs: &[T],
    eps: T,
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
) {
    layer_norm_rows(xs, ws, bs, eps, out, mean, rstd)
}

/// A per-row output that the row tasks share: each writes only its own element.
#[derive(Clone, Copy)]
struct RowPtr<T>(*mut T);
unsafe impl<T> Send for RowPtr<T> {}
unsafe impl<T> Sync for RowPtr<T> {}

impl Nn for Buffer {
    fn softmax_last(&self, l: &Layout, log: bool) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            return Ok(narrow(x.softmax_last(&xl, log)?, h));
        }
        let s = self;
        float_kernel!("softmax", s, data: T => Ok(T::wrap(softmax_rows(view(data, l), last_dim(l), log))))
    }

    fn softmax_backward(&self, l: &Layout, g: &Buffer, gl: &Layout, log: bool) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let ((y, yl), (g, gl)) = (widen(self, l), widen(g, gl));
            return Ok(narrow(y.softmax_backward(&yl, &g, &gl, log)?, h));
        }
        let y = self;
        float_kernel!("softmax_backward", y, ys: T => {
            let (ys, gs) = (view(ys, l), view(same::<T>("softmax_backward", g)?, gl));
            let d = last_dim(l);
            let mut out = vec![T::ZERO; ys.len()];
            par_rows_mut(&mut out, d, |r, o| {
                let (y, g) = (&ys[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d]);
                if log {
                    let s: T = g.iter().copied().sum();
                    for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                        *o = g - y.exp() * s;
                    }
                } else {
                    let dot: T = y.iter().zip(g).map(|(&a, &b)| a * b).sum();
                    for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                        *o = y * (g - dot);
                    }
                }
            });
            Ok(T::wrap(out))
        })
    }

    /// `layer_norm`: one pass per row (the row stays in
    /// cache for its three loops), rows in parallel.
    fn layer_norm(
        &self,
        l: &Layout,
        w: (&Buffer, &Layout),
        b: (&Buffer, &Layout),
        eps: f64,
    ) -> Result<(Buffer, Buffer, Buffer)> {
        if let Some(h) = half_dtype(self) {
            let ((x, xl), (w, wl), (b, bl)) = (widen(self, l), widen(w.0, w.1), widen(b.0, b.1));
            let (y, mean, rstd) = x.layer_norm(&xl, (&w, &wl), (&b, &bl), eps)?;
            return Ok((narrow(y, h), narrow(mean, h), narrow(rstd, h)));
        }
        let x = self;
        let op = "layer_norm";
        float_kernel!(op, x, xs: T => {
            let xs = view(xs, l);
            let (ws, bs) = (view(same::<T>(op, w.0)?, w.1), view(same::<T>(op, b.0)?, b.1));
            let d = last_dim(l);
            let rows = xs.len() / d.max(1);
            let mut out = vec![T::ZERO; xs.len()];
            let (mut mean, mut rstd) = (vec![T::ZERO; rows], vec![T::ZERO; rows]);
            let eps = T::from_f64(eps);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2, checked just above.
                unsafe { layer_norm_rows_avx2(xs, ws, bs, eps, &mut out, &mut mean, &mut rstd) };
                return Ok((T::wrap(out), T::wrap(mean), T::wrap(rstd)));
            }
            layer_norm_rows(xs, ws, bs, eps, &mut out, &mut mean, &mut rstd);
            Ok((T::wrap(out), T::wrap(mean), T::wrap(rstd)))
        })
    }

    fn layer_norm_backward(
        &self,
        l: &Layout,
        w: (&Buffer, &Layout),
        mean: (&Buffer, &Layout),
        rstd: (&Buffer, &Layout),
        gy: (&Buffer, &Layout),
    ) -> Result<(Buffer, Buffer, Buffer)> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            let ((w, wl), (m, ml), (r, rl), (g, gl)) = (
                widen(w.0, w.1),
                widen(mean.0, mean.1),
                widen(rstd.0, rstd.1),
                widen(gy.0, gy.1),
            );
            let (dx, dw, db) = x.layer_norm_backward(&xl, (&w, &wl), (&m, &ml), (&r, &rl), (&g, &gl))?;
            return Ok((narrow(dx, h), narrow(dw, h), narrow(db, h)));
        }
        let x = self;
        let op = "layer_norm_backward";
        float_kernel!(op, x, xs: T => {
            let xs = view(xs, l);
            let ws = view(same::<T>(op, w.0)?, w.1);
            let (ms, rs) = (view(same::<T>(op, mean.0)?, mean.1), view(same::<T>(op, rstd.0)?, rstd.1));
            let gs = view(same::<T>(op, gy.0)?, gy.1);
            let d = last_dim(l);
            let rows = xs.len() / d.max(1);
            let mut dx = vec![T::ZERO; xs.len()];
            let mut dw = vec![T::ZERO; d];
            let mut db = vec![T::ZERO; d];
            let inv_d = T::ONE / T::from_usize(d);
            par_rows_mut(&mut dx, d, |r, o| {
                let (xr, gr) = (&xs[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d]);
                let (mean, rstd) = (ms[r], rs[r]);
                let (mut s1, mut s2) = (T::ZERO, T::ZERO);
                for i in 0..d {
                    let dxhat = gr[i] * ws[i];
                    s1 += dxhat;
                    s2 += dxhat * (xr[i] - mean) * rstd;
                }
                let (s1, s2) = (s1 * inv_d, s2 * inv_d);
                for i in 0..d {
                    let xhat = (xr[i] - mean) * rstd;
                    o[i] = rstd * (gr[i] * ws[i] - s1 - xhat * s2);
                }
            });
            for r in 0..rows {
                let (xr, gr) = (&xs[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d]);
                for i in 0..d {
                    dw[i] += gr[i] * (xr[i] - ms[r]) * rs[r];
                    db[i] += gr[i];
                }
            }
            Ok((T::wrap(dx), T::wrap(dw), T::wrap(db)))
        })
    }

    fn embedding(&self, l: &Layout, ids: (&Buffer, &Layout)) -> Result<Buffer> {
        let w = self;
        let idx = indices("embedding", ids.0, ids.1)?;
        if half_dtype(self).is_some() {
            // a gather copies elements: the 16-bit rows need no widening
            fn rows<T: Element>(ws: &[T], l: &Layout, idx: &[usize]) -> Buffer {
                let (ws, d) = (view(ws, l), last_dim(l));
                let mut out = vec![T::default(); idx.len() * d];
                par_rows_mut(&mut out, d, |r, o| o.copy_from_slice(&ws[idx[r] * d..(idx[r] + 1) * d]));
                T::wrap(out)
            }
            return Ok(match w {
                Buffer::BF16(ws) => rows(ws, l, &idx),
                Buffer::F16(ws) => rows(ws, l, &idx),
                _ => unreachable!("half_dtype is F16 or BF16"),
            });
        }
        float_kernel!("embedding", w, ws: T => {
            let ws = view(ws, l);
            let d = last_dim(l);
            let mut out = vec![T::ZERO; idx.len() * d];
            par_rows_mut(&mut out, d, |r, o| o.copy_from_slice(&ws[idx[r] * d..(idx[r] + 1) * d]));
            Ok(T::wrap(out))
        })
    }

    fn embedding_backward(&self, l: &Layout, ids: (&Buffer, &Layout), vocab: usize) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let (g, gl) = widen(self, l);
            return Ok(narrow(g.embedding_backward(&gl, ids, vocab)?, h));
        }
        let g = self;
        let idx = indices("embedding_backward", ids.0, ids.1)?;
        float_kernel!("embedding_backward", g, gs: T => {
            let gs = view(gs, l);
            let d = last_dim(l);
            let mut out = vec![T::ZERO; vocab * d];
            for (r, &i) in idx.iter().enumerate() {
                for (o, &v) in out[i * d..(i + 1) * d].iter_mut().zip(&gs[r * d..(r + 1) * d]) {
                    *o += v;
                }
            }
            Ok(T::wrap(out))
        })
    }

    fn causal_fill(&self, l: &Layout, value: f64) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            return Ok(narrow(x.causal_fill(&xl, value)?, h));
        }
        let x = self;
        float_kernel!("causal_mask", x, xs: T => {
            let r = l.rank();
            let (t, s) = (l.shape()[r - 2], l.shape()[r - 1]);
            let v = T::from_f64(value);
            let mut out = view(xs, l).to_vec();
            par_rows_mut(&mut out, s, |r, o| {
                let i = r % t;
                for o in o.iter_mut().skip(i + (s - t) + 1) {
                    *o = v;
                }
            });
            Ok(T::wrap(out))
        })
    }

    fn cross_entropy(&self, l: &Layout, targets: (&Buffer, &Layout)) -> Result<(Buffer, Buffer)> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            let (loss, probs) = x.cross_entropy(&xl, targets)?;
            return Ok((narrow(loss, h), narrow(probs, h)));
        }
        let logits = self;
        let t = indices("cross_entropy", targets.0, targets.1)?;
        float_kernel!("cross_entropy", logits, ls: T => {
            let ls = view(ls, l);
            let (n, c) = (l.shape()[0], l.shape()[1]);
            // one pass per row: the probabilities and the log-sum-exp the loss needs (f32: the
            // vectorized softmax of `softmax_row.rs`)
            let mut probs = vec![T::ZERO; ls.len()];
            let mut lse = vec![T::ZERO; n];
            let pl = RowPtr(lse.as_mut_ptr());
            par_rows_mut(&mut probs, c, |r, o| {
                // The closure captures the whole `RowPtr` (Send), not its raw pointer field.
                #[allow(clippy::redundant_locals)]
                let pl = pl;
                o.copy_from_slice(&ls[r * c..(r + 1) * c]);
                let (m, sum) = softmax_in_place(o);
                let v = sum.ln() + m;
                // SAFETY: `lse` holds one element per row; only row `r`'s call writes element `r`.
                unsafe { *pl.0.add(r) = v };
            });
            let mut total = 0.0f64;
            for r in 0..n {
                total += (lse[r] - ls[r * c + t[r]]).to_f64();
            }
            let loss = total / n.max(1) as f64;
            Ok((T::wrap(vec![T::from_f64(loss)]), T::wrap(probs)))
        })
    }

    fn cross_entropy_backward(&self, l: &Layout, targets: (&Buffer, &Layout), g: (&Buffer, &Layout)) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let ((p, pl), (g, gl)) = (widen(self, l), widen(g.0, g.1));
            return Ok(narrow(p.cross_entropy_backward(&pl, targets, (&g, &gl))?, h));
        }
        let probs = self;
        let op = "cross_entropy_backward";
        let t = indices(op, targets.0, targets.1)?;
        float_kernel!(op, probs, ps: T => {
            let (n, c) = (l.shape()[0], l.shape()[1]);
            let g = view(same::<T>(op, g.0)?, g.1)[0].to_f64();
            let scale = T::from_f64(g / n.max(1) as f64);
            let mut out = view(ps, l).to_vec();
            par_rows_mut(&mut out, c, |r, o| {
                o[t[r]] += -T::ONE;
                for v in o.iter_mut() {
                    *v *= scale;
                }
            });
            Ok(T::wrap(out))
        })
    }
}
