//! Neural-network ops over the last axis: softmax, log-softmax, layer norm, embedding
//! gather/scatter, causal mask, cross-entropy; each with its backward.

use super::{compute_dtype, same_device, same_dtype, same_shape};
use crate::storage::dispatch;
use crate::{DType, Result, Tensor, TensorError};

/// Checks that an index tensor (I64 or U8) holds only values below `bound`, so that a bad id
/// is one clear error on every device (the kernels also guard their reads).
pub(crate) fn check_indices(op: &'static str, ids: &Tensor, bound: usize) -> Result<()> {
    if !matches!(ids.dtype(), DType::I64 | DType::U8) {
        return Err(TensorError::UnsupportedDType {
            op,
            dtype: ids.dtype(),
            hint: " (indices are I64 or U8)",
        });
    }
    // Device ids carry the range they were uploaded with: validated on the host before the
    // upload, so checking them here reads nothing back (no stall inside a training step).
    // Only ids of unknown range (made on the device, or out of range: for the message) are
    // read.
    if let Some((lo, hi)) = dispatch!(plain &*ids.storage(op)?, s => s.int_range()) {
        if lo >= 0 && (hi as u64) < bound as u64 {
            return Ok(());
        }
    }
    let v: Vec<i64> = match ids.dtype() {
        DType::I64 => ids.to_vec::<i64>()?,
        _ => ids.to_vec::<u8>()?.into_iter().map(i64::from).collect(),
    };
    for (i, x) in v.into_iter().enumerate() {
        if x < 0 || x as usize >= bound {
            return Err(TensorError::OutOfRange {
                op,
                msg: format!("index {x} at position {i} is outside 0..{bound}"),
            });
        }
    }
    Ok(())
}

fn last_dim(op: &'static str, x: &Tensor) -> Result<usize> {
    x.shape().last().copied().ok_or(TensorError::Invalid {
        op,
        msg: "needs rank >= 1".into(),
    })
}

/// The operands of a row kernel: same dtype (a compute one), same device, contiguous.
fn rows_operand(op: &'static str, x: &Tensor, other: &Tensor) -> Result<Tensor> {
    same_dtype(op, x, other)?;
    same_device(op, x, other)?;
    other.contiguous_for(op)
}

fn softmax(x: &Tensor, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    compute_dtype(op, x)?;
    last_dim(op, x)?;
    let x = x.contiguous_for(op)?;
    let out = dispatch!(&*x.storage(op)?, s => s.softmax_last(x.layout(), log))?;
    Ok(Tensor::from_storage(out, x.shape()))
}

fn softmax_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Tensor> {
    let op = if log {
        "log_softmax_backward"
    } else {
        "softmax_backward"
    };
    compute_dtype(op, y)?;
    same_shape(op, y, g)?;
    last_dim(op, y)?;
    let (y, g) = (y.contiguous_for(op)?, rows_operand(op, y, g)?);
    let out = dispatch!(&*y.storage(op)?, s, other => s.softmax_backward(y.layout(), other(&*g.storage(op)?)?, g.layout(), log))?;
    Ok(Tensor::from_storage(out, y.shape()))
}

/// What the layer-norm forward saves for its backward.
#[derive(Debug, Clone)]
pub struct LayerNormSaved {
    /// Per-row mean, shape `[rows]`.
    pub mean: Tensor,
    /// Per-row `1/sqrt(var + eps)`, shape `[rows]`.
    pub rstd: Tensor,
}

fn layer_norm_impl(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<(Tensor, LayerNormSaved)> {
    let op = "layer_norm";
    compute_dtype(op, x)?;
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
    let (w, b) = (rows_operand(op, x, w)?, rows_operand(op, x, b)?);
    let x = x.contiguous_for(op)?;
    let (sw, sb) = (w.storage(op)?, b.storage(op)?);
    let (y, mean, rstd) = dispatch!(&*x.storage(op)?, s, other => s.layer_norm(x.layout(), (other(&sw)?, w.layout()), (other(&sb)?, b.layout()), eps))?;
    Ok((
        Tensor::from_storage(y, x.shape()),
        LayerNormSaved {
            mean: Tensor::from_storage(mean, &[rows]),
            rstd: Tensor::from_storage(rstd, &[rows]),
        },
    ))
}

fn layer_norm_backward_impl(
    x: &Tensor,
    w: &Tensor,
    saved: &LayerNormSaved,
    gy: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "layer_norm_backward";
    compute_dtype(op, x)?;
    let d = last_dim(op, x)?;
    let rows = x.numel() / d.max(1);
    if w.shape() != [d] || gy.shape() != x.shape() || saved.mean.shape() != [rows] || saved.rstd.shape() != [rows] {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: x.shape().to_vec(),
            rhs: gy.shape().to_vec(),
        });
    }
    let w = rows_operand(op, x, w)?;
    let (mean, rstd) = (rows_operand(op, x, &saved.mean)?, rows_operand(op, x, &saved.rstd)?);
    let gy = rows_operand(op, x, gy)?;
    let x = x.contiguous_for(op)?;
    let (sw, sm, sr, sg) = (w.storage(op)?, mean.storage(op)?, rstd.storage(op)?, gy.storage(op)?);
    let (dx, dw, db) = dispatch!(&*x.storage(op)?, s, other => s.layer_norm_backward(
        x.layout(),
        (other(&sw)?, w.layout()),
        (other(&sm)?, mean.layout()),
        (other(&sr)?, rstd.layout()),
        (other(&sg)?, gy.layout()),
    ))?;
    Ok((
        Tensor::from_storage(dx, x.shape()),
        Tensor::from_storage(dw, &[d]),
        Tensor::from_storage(db, &[d]),
    ))
}

fn embedding_impl(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let op = "embedding";
    compute_dtype(op, weight)?;
    if weight.rank() != 2 {
        return Err(TensorError::Invalid {
            op,
            msg: format!("weight must be [vocab, dim], got {:?}", weight.shape()),
        });
    }
    let (v, d) = (weight.shape()[0], weight.shape()[1]);
    check_indices(op, ids, v)?;
    same_device(op, weight, ids)?;
    let w = weight.contiguous_for(op)?;
    let out =
        dispatch!(&*w.storage(op)?, s, other => s.embedding(w.layout(), (other(&*ids.storage(op)?)?, ids.layout())))?;
    let mut shape = ids.shape().to_vec();
    shape.push(d);
    Ok(Tensor::from_storage(out, &shape))
}

fn embedding_backward_impl(ids: &Tensor, g: &Tensor, vocab: usize) -> Result<Tensor> {
    let op = "embedding_backward";
    compute_dtype(op, g)?;
    let d = last_dim(op, g)?;
    check_indices(op, ids, vocab)?;
    if ids.numel() * d != g.numel() {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: ids.shape().to_vec(),
            rhs: g.shape().to_vec(),
        });
    }
    same_device(op, g, ids)?;
    let g = g.contiguous_for(op)?;
    let out = dispatch!(&*g.storage(op)?, s, other => s.embedding_backward(g.layout(), (other(&*ids.storage(op)?)?, ids.layout()), vocab))?;
    Ok(Tensor::from_storage(out, &[vocab, d]))
}

fn causal_fill_impl(x: &Tensor, value: f64) -> Result<Tensor> {
    let op = "causal_mask";
    compute_dtype(op, x)?;
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
    let x = x.contiguous_for(op)?;
    let out = dispatch!(&*x.storage(op)?, s => s.causal_fill(x.layout(), value))?;
    Ok(Tensor::from_storage(out, x.shape()))
}

fn cross_entropy_impl(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let op = "cross_entropy";
    compute_dtype(op, logits)?;
    if logits.rank() != 2 || targets.shape() != [logits.shape()[0]] {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: logits.shape().to_vec(),
            rhs: targets.shape().to_vec(),
        });
    }
    check_indices(op, targets, logits.shape()[1])?;
    same_device(op, logits, targets)?;
    let x = logits.contiguous_for(op)?;
    let (loss, probs) = dispatch!(&*x.storage(op)?, s, other => s.cross_entropy(x.layout(), (other(&*targets.storage(op)?)?, targets.layout())))?;
    Ok((Tensor::from_storage(loss, &[]), Tensor::from_storage(probs, x.shape())))
}

fn cross_entropy_backward_impl(probs: &Tensor, targets: &Tensor, g: &Tensor) -> Result<Tensor> {
    let op = "cross_entropy_backward";
    compute_dtype(op, probs)?;
    if probs.rank() != 2 || targets.shape() != [probs.shape()[0]] {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: probs.shape().to_vec(),
            rhs: targets.shape().to_vec(),
        });
    }
    if g.numel() != 1 {
        return Err(TensorError::Invalid {
            op,
            msg: format!("the upstream gradient must be one element, got shape {:?}", g.shape()),
        });
    }
    same_dtype(op, probs, g)?;
    same_device(op, probs, g)?;
    check_indices(op, targets, probs.shape()[1])?;
    same_device(op, probs, targets)?;
    let p = probs.contiguous_for(op)?;
    let g = g.contiguous_for(op)?;
    let out = dispatch!(&*p.storage(op)?, s, other => s.cross_entropy_backward(
        p.layout(),
        (other(&*targets.storage(op)?)?, targets.layout()),
        (other(&*g.storage(op)?)?, g.layout()),
    ))?;
    Ok(Tensor::from_storage(out, p.shape()))
}

impl Tensor {
    /// Softmax over the last axis.
    pub fn softmax_last(&self) -> Result<Tensor> {
        softmax(self, false)
    }

    /// Log-softmax over the last axis.
    pub fn log_softmax_last(&self) -> Result<Tensor> {
        softmax(self, true)
    }

    /// Gradient of softmax: `y * (g - sum(g * y))` row-wise, with `self = y`.
    pub fn softmax_backward(&self, g: &Tensor) -> Result<Tensor> {
        softmax_backward(self, g, false)
    }

    /// Gradient of log-softmax: `g - exp(y) * sum(g)` row-wise, with `self = y`.
    pub fn log_softmax_backward(&self, g: &Tensor) -> Result<Tensor> {
        softmax_backward(self, g, true)
    }

    /// Layer norm over the last axis with affine `weight` and `bias` (`[d]` each).
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<(Tensor, LayerNormSaved)> {
        layer_norm_impl(self, weight, bias, eps)
    }

    /// Gradients `(dx, dweight, dbias)` of [`Tensor::layer_norm`], with `self = x`.
    pub fn layer_norm_backward(
        &self,
        weight: &Tensor,
        saved: &LayerNormSaved,
        gy: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        layer_norm_backward_impl(self, weight, saved, gy)
    }

    /// Rows of `self` (`[vocab, d]`) picked by `ids` (I64 or U8): `[ids.., d]`.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        embedding_impl(self, ids)
    }

    /// Scatter-add of `self` (`[ids.., d]`, a gradient) into a `[vocab, d]` table.
    pub fn embedding_backward(&self, ids: &Tensor, vocab: usize) -> Result<Tensor> {
        embedding_backward_impl(ids, self, vocab)
    }

    /// Sets the future positions of `[.., T, S]` scores (key `j` after query `i`) to `value`.
    pub fn causal_fill(&self, value: f64) -> Result<Tensor> {
        causal_fill_impl(self, value)
    }

    /// Mean cross-entropy of `[n, c]` logits against `[n]` integer targets; also returns
    /// the softmax probabilities that the backward needs.
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<(Tensor, Tensor)> {
        cross_entropy_impl(self, targets)
    }

    /// Gradient of [`Tensor::cross_entropy`] w.r.t. the logits, scaled by the upstream
    /// gradient `g`: `(probs - onehot(targets)) * g / n`, with `self = probs`.
    pub fn cross_entropy_backward(&self, targets: &Tensor, g: f64) -> Result<Tensor> {
        let g = Tensor::full_on(&[], g, self.dtype(), self.device())?;
        cross_entropy_backward_impl(self, targets, &g)
    }

    /// [`Tensor::cross_entropy_backward`] with the upstream gradient as a one-element tensor
    /// of the same dtype and device (the loss's gradient, as backward has it): nothing is read
    /// back to the host.
    pub fn cross_entropy_backward_by(&self, targets: &Tensor, g: &Tensor) -> Result<Tensor> {
        cross_entropy_backward_impl(self, targets, g)
    }
}

#[cfg(test)]
mod tests {
    use crate::{test_device, DType, Device, Tensor};

    fn on(t: Tensor, d: Device) -> Tensor {
        t.to_device(d).unwrap()
    }

    fn cross_entropy_of_uniform_logits_is_log_c(d: Device) {
        let logits = Tensor::zeros_on(&[3, 4], DType::F64, d).unwrap();
        let t = on(Tensor::from_vec(vec![0i64, 3, 1], &[3]).unwrap(), d);
        let (loss, probs) = logits.cross_entropy(&t).unwrap();
        assert!((loss.item().unwrap() - 4f64.ln()).abs() < 1e-12);
        assert_eq!(probs.to_vec::<f64>().unwrap(), vec![0.25; 12]);
        // d/dlogits = (probs - onehot) / n: row 0 is (-0.75, 0.25, 0.25, 0.25) / 3
        let g = probs.cross_entropy_backward(&t, 1.0).unwrap().to_vec::<f64>().unwrap();
        assert!((g[0] + 0.25).abs() < 1e-15 && (g[1] - 0.25 / 3.0).abs() < 1e-15);
        let bad = on(Tensor::from_vec(vec![0i64, 4, 1], &[3]).unwrap(), d);
        assert!(logits.cross_entropy(&bad).is_err());
    }
    test_device!(cross_entropy_of_uniform_logits_is_log_c);

    fn causal_fill_masks_the_strict_upper_triangle(d: Device) {
        let x = Tensor::zeros_on(&[3, 3], DType::F32, d).unwrap();
        let y = x.causal_fill(9.0).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(y, vec![0.0, 9.0, 9.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0]);
    }
    test_device!(causal_fill_masks_the_strict_upper_triangle);

    fn layer_norm_rows_have_zero_mean_unit_variance(d: Device) {
        let x = on(
            Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, -1.0, 0.0, 5.0, 2.0], &[2, 4]).unwrap(),
            d,
        );
        let (w, b) = (
            on(Tensor::ones(&[4], DType::F64), d),
            Tensor::zeros_on(&[4], DType::F64, d).unwrap(),
        );
        let (y, saved) = x.layer_norm(&w, &b, 0.0).unwrap();
        let y = y.to_vec::<f64>().unwrap();
        for r in y.chunks(4) {
            let m: f64 = r.iter().sum::<f64>() / 4.0;
            let v: f64 = r.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / 4.0;
            assert!(m.abs() < 1e-12 && (v - 1.0).abs() < 1e-9);
        }
        // rows 1..4 and -1,0,5,2 have means 2.5 and 1.5
        assert_eq!(saved.mean.to_vec::<f64>().unwrap(), vec![2.5, 1.5]);
    }
    test_device!(layer_norm_rows_have_zero_mean_unit_variance);

    fn embedding_gathers_rows_and_its_backward_adds_them_up(d: Device) {
        let w = on(
            Tensor::from_vec(vec![0.0f32, 1.0, 10.0, 11.0, 20.0, 21.0], &[3, 2]).unwrap(),
            d,
        );
        let ids = on(Tensor::from_vec(vec![2i64, 0, 2], &[3]).unwrap(), d);
        assert_eq!(
            w.embedding(&ids).unwrap().to_vec::<f32>().unwrap(),
            vec![20.0, 21.0, 0.0, 1.0, 20.0, 21.0]
        );
        // row 2 is picked twice: its gradient is the sum of both rows of g
        let g = on(
            Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]).unwrap(),
            d,
        );
        assert_eq!(
            g.embedding_backward(&ids, 3).unwrap().to_vec::<f32>().unwrap(),
            vec![3.0, 4.0, 0.0, 0.0, 6.0, 8.0]
        );
        assert!(w
            .embedding(&on(Tensor::from_vec(vec![3i64], &[1]).unwrap(), d))
            .is_err());
    }
    test_device!(embedding_gathers_rows_and_its_backward_adds_them_up);
}
