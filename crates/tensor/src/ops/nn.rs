//! Neural-network kernels over the last axis: softmax, log-softmax, layer norm,
//! embedding gather/scatter, causal mask, cross-entropy; each with its backward.

use crate::threads::par_rows_mut;
use crate::{DType, Float, Result, Tensor, TensorError};

/// Reads an index tensor (I64 or U8) as `usize`s, each checked to be below `bound`.
pub(crate) fn indices(op: &'static str, ids: &Tensor, bound: usize) -> Result<Vec<usize>> {
    let v: Vec<i64> = match ids.dtype() {
        DType::I64 => ids.to_vec::<i64>()?,
        DType::U8 => ids.to_vec::<u8>()?.into_iter().map(i64::from).collect(),
        d => {
            return Err(TensorError::UnsupportedDType {
                op,
                dtype: d,
                hint: " (indices are I64 or U8)",
            })
        }
    };
    v.into_iter()
        .enumerate()
        .map(|(i, x)| {
            if x < 0 || x as usize >= bound {
                Err(TensorError::OutOfRange {
                    op,
                    msg: format!("index {x} at position {i} is outside 0..{bound}"),
                })
            } else {
                Ok(x as usize)
            }
        })
        .collect()
}

fn last_dim(op: &'static str, x: &Tensor) -> Result<usize> {
    x.shape().last().copied().ok_or(TensorError::Invalid {
        op,
        msg: "needs rank >= 1".into(),
    })
}

fn softmax_rows<T: Float>(x: &Tensor, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    let d = last_dim(op, x)?;
    let mut out = vec![T::ZERO; x.numel()];
    x.with_contiguous(op, |src: &[T]| {
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
        })
    })?;
    Tensor::from_vec(out, x.shape())
}

/// Row-wise combination of an output `y` and its gradient `g` (same shape).
fn rows2<T: Float>(
    op: &'static str,
    y: &Tensor,
    g: &Tensor,
    f: impl Fn(&[T], &[T], &mut [T]) + Sync + Send,
) -> Result<Tensor> {
    if y.shape() != g.shape() {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: y.shape().to_vec(),
            rhs: g.shape().to_vec(),
        });
    }
    let d = last_dim(op, y)?;
    let mut out = vec![T::ZERO; y.numel()];
    y.with_contiguous(op, |ys: &[T]| {
        g.with_contiguous(op, |gs: &[T]| {
            par_rows_mut(&mut out, d, |r, o| {
                f(&ys[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d], o)
            })
        })
    })??;
    Tensor::from_vec(out, y.shape())
}

/// What the layer-norm forward saves for its backward.
#[derive(Debug, Clone)]
pub struct LayerNormSaved {
    /// Per-row mean, shape `[rows]`.
    pub mean: Tensor,
    /// Per-row `1/sqrt(var + eps)`, shape `[rows]`.
    pub rstd: Tensor,
}

fn layer_norm_impl<T: Float>(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<(Tensor, LayerNormSaved)> {
    let op = "layer_norm";
    let d = last_dim(op, x)?;
    for p in [w, b] {
        if p.shape() != [d] {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: x.shape().to_vec(),
                rhs: p.shape().to_vec(),
            });
        }
    }
    let rows = x.numel() / d.max(1);
    let mut out = vec![T::ZERO; x.numel()];
    let mut stats = vec![T::ZERO; 2 * rows];
    let eps = T::from_f64(eps);
    let inv_d = T::ONE / T::from_usize(d);
    x.with_contiguous(op, |xs: &[T]| {
        w.with_contiguous(op, |ws: &[T]| {
            b.with_contiguous(op, |bs: &[T]| {
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
                })
            })
        })
    })???;
    let mean: Vec<T> = stats.iter().step_by(2).copied().collect();
    let rstd: Vec<T> = stats.iter().skip(1).step_by(2).copied().collect();
    Ok((
        Tensor::from_vec(out, x.shape())?,
        LayerNormSaved {
            mean: Tensor::from_vec(mean, &[rows])?,
            rstd: Tensor::from_vec(rstd, &[rows])?,
        },
    ))
}

fn layer_norm_backward_impl<T: Float>(
    x: &Tensor,
    w: &Tensor,
    saved: &LayerNormSaved,
    gy: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "layer_norm_backward";
    let d = last_dim(op, x)?;
    let rows = x.numel() / d.max(1);
    let mut dx = vec![T::ZERO; x.numel()];
    let mut dw = vec![T::ZERO; d];
    let mut db = vec![T::ZERO; d];
    let inv_d = T::ONE / T::from_usize(d);
    x.with_contiguous(op, |xs: &[T]| {
        w.with_contiguous(op, |ws: &[T]| {
            gy.with_contiguous(op, |gs: &[T]| {
                saved.mean.with_contiguous(op, |ms: &[T]| {
                    saved.rstd.with_contiguous(op, |rs: &[T]| {
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
                    })
                })
            })
        })
    })?????;
    Ok((
        Tensor::from_vec(dx, x.shape())?,
        Tensor::from_vec(dw, &[d])?,
        Tensor::from_vec(db, &[d])?,
    ))
}

fn embedding_impl<T: Float>(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let op = "embedding";
    if weight.rank() != 2 {
        return Err(TensorError::Invalid {
            op,
            msg: format!("weight must be [vocab, dim], got {:?}", weight.shape()),
        });
    }
    let (v, d) = (weight.shape()[0], weight.shape()[1]);
    let idx = indices(op, ids, v)?;
    let mut out = vec![T::ZERO; idx.len() * d];
    weight.with_contiguous(op, |ws: &[T]| {
        par_rows_mut(&mut out, d, |r, o| o.copy_from_slice(&ws[idx[r] * d..(idx[r] + 1) * d]))
    })?;
    let mut shape = ids.shape().to_vec();
    shape.push(d);
    Tensor::from_vec(out, &shape)
}

fn embedding_backward_impl<T: Float>(ids: &Tensor, g: &Tensor, vocab: usize) -> Result<Tensor> {
    let op = "embedding_backward";
    let d = last_dim(op, g)?;
    let idx = indices(op, ids, vocab)?;
    if idx.len() * d != g.numel() {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: ids.shape().to_vec(),
            rhs: g.shape().to_vec(),
        });
    }
    let mut out = vec![T::ZERO; vocab * d];
    g.with_contiguous(op, |gs: &[T]| {
        for (r, &i) in idx.iter().enumerate() {
            for (o, &v) in out[i * d..(i + 1) * d].iter_mut().zip(&gs[r * d..(r + 1) * d]) {
                *o += v;
            }
        }
    })?;
    Tensor::from_vec(out, &[vocab, d])
}

fn causal_fill_impl<T: Float>(x: &Tensor, value: f64) -> Result<Tensor> {
    let op = "causal_mask";
    if x.rank() < 2 {
        return Err(TensorError::Invalid {
            op,
            msg: format!("needs [.., T, S], got {:?}", x.shape()),
        });
    }
    let (t, s) = (x.shape()[x.rank() - 2], x.shape()[x.rank() - 1]);
    if t > s {
        return Err(TensorError::Invalid {
            op,
            msg: format!("query length {t} exceeds key length {s}"),
        });
    }
    let v = T::from_f64(value);
    let mut out = x.contiguous()?.to_vec::<T>()?;
    par_rows_mut(&mut out, s, |r, o| {
        let i = r % t;
        for o in o.iter_mut().skip(i + (s - t) + 1) {
            *o = v;
        }
    });
    Tensor::from_vec(out, x.shape())
}

fn cross_entropy_impl<T: Float>(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let op = "cross_entropy";
    if logits.rank() != 2 || targets.shape() != [logits.shape()[0]] {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: logits.shape().to_vec(),
            rhs: targets.shape().to_vec(),
        });
    }
    let (n, c) = (logits.shape()[0], logits.shape()[1]);
    let t = indices(op, targets, c)?;
    let probs = softmax_rows::<T>(logits, false)?;
    let loss = logits.with_contiguous(op, |ls: &[T]| {
        let mut total = 0.0f64;
        for r in 0..n {
            let row = &ls[r * c..(r + 1) * c];
            let m = row
                .iter()
                .copied()
                .fold(T::NEG_INFINITY, |a, b| if b > a { b } else { a });
            let lse = row.iter().map(|&v| (v - m).exp()).sum::<T>().ln() + m;
            total += (lse - row[t[r]]).to_f64();
        }
        total / n.max(1) as f64
    })?;
    Ok((Tensor::scalar(loss, T::DTYPE), probs))
}

fn cross_entropy_backward_impl<T: Float>(probs: &Tensor, targets: &Tensor, g: f64) -> Result<Tensor> {
    let op = "cross_entropy_backward";
    let (n, c) = (probs.shape()[0], probs.shape()[1]);
    let t = indices(op, targets, c)?;
    let scale = T::from_f64(g / n.max(1) as f64);
    let mut out = probs.contiguous()?.to_vec::<T>()?;
    par_rows_mut(&mut out, c, |r, o| {
        o[t[r]] += -T::ONE;
        for v in o.iter_mut() {
            *v *= scale;
        }
    });
    Tensor::from_vec(out, &[n, c])
}

impl Tensor {
    /// Softmax over the last axis.
    pub fn softmax_last(&self) -> Result<Tensor> {
        float_dispatch!("softmax", self.dtype(), T => softmax_rows::<T>(self, false))
    }

    /// Log-softmax over the last axis.
    pub fn log_softmax_last(&self) -> Result<Tensor> {
        float_dispatch!("log_softmax", self.dtype(), T => softmax_rows::<T>(self, true))
    }

    /// Gradient of softmax: `y * (g - sum(g * y))` row-wise, with `self = y`.
    pub fn softmax_backward(&self, g: &Tensor) -> Result<Tensor> {
        float_dispatch!("softmax_backward", self.dtype(), T => rows2::<T>("softmax_backward", self, g, |y, g, o| {
            let dot: T = y.iter().zip(g).map(|(&a, &b)| a * b).sum();
            for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                *o = y * (g - dot);
            }
        }))
    }

    /// Gradient of log-softmax: `g - exp(y) * sum(g)` row-wise, with `self = y`.
    pub fn log_softmax_backward(&self, g: &Tensor) -> Result<Tensor> {
        float_dispatch!("log_softmax_backward", self.dtype(), T => rows2::<T>("log_softmax_backward", self, g, |y, g, o| {
            let s: T = g.iter().copied().sum();
            for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                *o = g - y.exp() * s;
            }
        }))
    }

    /// Layer norm over the last axis with affine `weight` and `bias` (`[d]` each).
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<(Tensor, LayerNormSaved)> {
        float_dispatch!("layer_norm", self.dtype(), T => layer_norm_impl::<T>(self, weight, bias, eps))
    }

    /// Gradients `(dx, dweight, dbias)` of [`Tensor::layer_norm`], with `self = x`.
    pub fn layer_norm_backward(
        &self,
        weight: &Tensor,
        saved: &LayerNormSaved,
        gy: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        float_dispatch!("layer_norm_backward", self.dtype(), T => layer_norm_backward_impl::<T>(self, weight, saved, gy))
    }

    /// Rows of `self` (`[vocab, d]`) picked by `ids` (I64 or U8): `[ids.., d]`.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        float_dispatch!("embedding", self.dtype(), T => embedding_impl::<T>(self, ids))
    }

    /// Scatter-add of `self` (`[ids.., d]`, a gradient) into a `[vocab, d]` table.
    pub fn embedding_backward(&self, ids: &Tensor, vocab: usize) -> Result<Tensor> {
        float_dispatch!("embedding_backward", self.dtype(), T => embedding_backward_impl::<T>(ids, self, vocab))
    }

    /// Sets the future positions of `[.., T, S]` scores (key `j` after query `i`) to `value`.
    pub fn causal_fill(&self, value: f64) -> Result<Tensor> {
        float_dispatch!("causal_mask", self.dtype(), T => causal_fill_impl::<T>(self, value))
    }

    /// Mean cross-entropy of `[n, c]` logits against `[n]` integer targets; also returns
    /// the softmax probabilities that the backward needs.
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<(Tensor, Tensor)> {
        float_dispatch!("cross_entropy", self.dtype(), T => cross_entropy_impl::<T>(self, targets))
    }

    /// Gradient of [`Tensor::cross_entropy`] w.r.t. the logits, scaled by the upstream
    /// gradient `g`: `(probs - onehot(targets)) * g / n`, with `self = probs`.
    pub fn cross_entropy_backward(&self, targets: &Tensor, g: f64) -> Result<Tensor> {
        float_dispatch!("cross_entropy_backward", self.dtype(), T => cross_entropy_backward_impl::<T>(self, targets, g))
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Tensor};

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_c() {
        let logits = Tensor::zeros(&[3, 4], DType::F64);
        let t = Tensor::from_vec(vec![0i64, 3, 1], &[3]).unwrap();
        let (loss, _) = logits.cross_entropy(&t).unwrap();
        assert!((loss.item().unwrap() - 4f64.ln()).abs() < 1e-12);
        let bad = Tensor::from_vec(vec![0i64, 4, 1], &[3]).unwrap();
        assert!(logits.cross_entropy(&bad).is_err());
    }

    #[test]
    fn causal_fill_masks_the_strict_upper_triangle() {
        let x = Tensor::zeros(&[3, 3], DType::F32);
        let y = x.causal_fill(9.0).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(y, vec![0.0, 9.0, 9.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn layer_norm_rows_have_zero_mean_unit_variance() {
        let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, -1.0, 0.0, 5.0, 2.0], &[2, 4]).unwrap();
        let (y, _) = x
            .layer_norm(&Tensor::ones(&[4], DType::F64), &Tensor::zeros(&[4], DType::F64), 0.0)
            .unwrap();
        let y = y.to_vec::<f64>().unwrap();
        for r in y.chunks(4) {
            let m: f64 = r.iter().sum::<f64>() / 4.0;
            let v: f64 = r.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / 4.0;
            assert!(m.abs() < 1e-12 && (v - 1.0).abs() < 1e-9);
        }
    }
}
