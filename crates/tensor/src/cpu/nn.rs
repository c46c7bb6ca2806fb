//! Neural-network kernels over the last axis on the CPU: softmax, log-softmax, layer norm,
//! embedding gather/scatter, causal mask, cross-entropy; each with its backward. Every
//! input arrives contiguous (the front end gathers strided views first).

use super::{float_kernel, indices, same, view};
use crate::storage::CpuStorage;
use crate::threads::par_rows_mut;
use crate::{Element, Float, Layout, Result};

fn last_dim(l: &Layout) -> usize {
    l.shape().last().copied().unwrap_or(1)
}

fn softmax_rows<T: Float>(src: &[T], d: usize, log: bool) -> Vec<T> {
    let mut out = vec![T::ZERO; src.len()];
    par_rows_mut(&mut out, d, |r, o| {
        let row = &src[r * d..(r + 1) * d];
        let m = row
            .iter()
            .copied()
            .fold(T::NEG_INFINITY, |a, b| if b > a { b } else { a });
        let mut sum = T::ZERO;
        for (o, &v) in o.iter_mut().zip(row) {
            *o = (v - m).exp();
            sum += *o;
        }
        if log {
            let lse = sum.ln() + m;
            for (o, &v) in o.iter_mut().zip(row) {
                *o = v - lse;
            }
        } else {
            let inv = T::ONE / sum;
            for o in o.iter_mut() {
                *o *= inv;
            }
        }
    });
    out
}

/// [`crate::backend::BackendStorage::softmax_last`].
pub(super) fn softmax_last(s: &CpuStorage, l: &Layout, log: bool) -> Result<CpuStorage> {
    float_kernel!("softmax", s, data: T => Ok(T::wrap(softmax_rows(view(data, l), last_dim(l), log))))
}

/// [`crate::backend::BackendStorage::softmax_backward`].
pub(super) fn softmax_backward(
    y: &CpuStorage,
    l: &Layout,
    g: &CpuStorage,
    gl: &Layout,
    log: bool,
) -> Result<CpuStorage> {
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

/// [`crate::backend::BackendStorage::layer_norm`].
pub(super) fn layer_norm(
    x: &CpuStorage,
    l: &Layout,
    w: (&CpuStorage, &Layout),
    b: (&CpuStorage, &Layout),
    eps: f64,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    let op = "layer_norm";
    float_kernel!(op, x, xs: T => {
        let xs = view(xs, l);
        let (ws, bs) = (view(same::<T>(op, w.0)?, w.1), view(same::<T>(op, b.0)?, b.1));
        let d = last_dim(l);
        let rows = xs.len() / d.max(1);
        let mut out = vec![T::ZERO; xs.len()];
        let mut stats = vec![T::ZERO; 2 * rows];
        let eps = T::from_f64(eps);
        let inv_d = T::ONE / T::from_usize(d);
        par_rows_mut(&mut stats, 2, |r, st| {
            let row = &xs[r * d..(r + 1) * d];
            let mean = row.iter().copied().sum::<T>() * inv_d;
            let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() * inv_d;
            st[0] = mean;
            st[1] = T::ONE / (var + eps).sqrt();
        });
        par_rows_mut(&mut out, d, |r, o| {
            let (mean, rstd) = (stats[2 * r], stats[2 * r + 1]);
            for (((o, &v), &wv), &bv) in o.iter_mut().zip(&xs[r * d..(r + 1) * d]).zip(ws).zip(bs) {
                *o = (v - mean) * rstd * wv + bv;
            }
        });
        let mean: Vec<T> = stats.iter().step_by(2).copied().collect();
        let rstd: Vec<T> = stats.iter().skip(1).step_by(2).copied().collect();
        Ok((T::wrap(out), T::wrap(mean), T::wrap(rstd)))
    })
}

/// [`crate::backend::BackendStorage::layer_norm_backward`].
pub(super) fn layer_norm_backward(
    x: &CpuStorage,
    l: &Layout,
    w: (&CpuStorage, &Layout),
    mean: (&CpuStorage, &Layout),
    rstd: (&CpuStorage, &Layout),
    gy: (&CpuStorage, &Layout),
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
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

/// [`crate::backend::BackendStorage::embedding`].
pub(super) fn embedding(w: &CpuStorage, l: &Layout, ids: (&CpuStorage, &Layout)) -> Result<CpuStorage> {
    let idx = indices("embedding", ids.0, ids.1)?;
    float_kernel!("embedding", w, ws: T => {
        let ws = view(ws, l);
        let d = last_dim(l);
        let mut out = vec![T::ZERO; idx.len() * d];
        par_rows_mut(&mut out, d, |r, o| o.copy_from_slice(&ws[idx[r] * d..(idx[r] + 1) * d]));
        Ok(T::wrap(out))
    })
}

/// [`crate::backend::BackendStorage::embedding_backward`].
pub(super) fn embedding_backward(
    g: &CpuStorage,
    l: &Layout,
    ids: (&CpuStorage, &Layout),
    vocab: usize,
) -> Result<CpuStorage> {
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

/// [`crate::backend::BackendStorage::causal_fill`].
pub(super) fn causal_fill(x: &CpuStorage, l: &Layout, value: f64) -> Result<CpuStorage> {
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

/// [`crate::backend::BackendStorage::cross_entropy`].
pub(super) fn cross_entropy(
    logits: &CpuStorage,
    l: &Layout,
    targets: (&CpuStorage, &Layout),
) -> Result<(CpuStorage, CpuStorage)> {
    let t = indices("cross_entropy", targets.0, targets.1)?;
    float_kernel!("cross_entropy", logits, ls: T => {
        let ls = view(ls, l);
        let (n, c) = (l.shape()[0], l.shape()[1]);
        let probs = softmax_rows(ls, c, false);
        let mut total = 0.0f64;
        for r in 0..n {
            let row = &ls[r * c..(r + 1) * c];
            let m = row.iter().copied().fold(T::NEG_INFINITY, |a, b| if b > a { b } else { a });
            let lse = row.iter().map(|&v| (v - m).exp()).sum::<T>().ln() + m;
            total += (lse - row[t[r]]).to_f64();
        }
        let loss = total / n.max(1) as f64;
        Ok((T::wrap(vec![T::from_f64(loss)]), T::wrap(probs)))
    })
}

/// [`crate::backend::BackendStorage::cross_entropy_backward`].
pub(super) fn cross_entropy_backward(
    probs: &CpuStorage,
    l: &Layout,
    targets: (&CpuStorage, &Layout),
    g: f64,
) -> Result<CpuStorage> {
    let t = indices("cross_entropy_backward", targets.0, targets.1)?;
    float_kernel!("cross_entropy_backward", probs, ps: T => {
        let (n, c) = (l.shape()[0], l.shape()[1]);
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
