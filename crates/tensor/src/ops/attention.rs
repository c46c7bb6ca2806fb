//! Causal multi-head self-attention as one op (PyTorch's
//! `scaled_dot_product_attention(q, k, v, is_causal=True)` on a packed projection), with
//! its own backward: no per-head copies, the mask applied inside.

use super::{compute_dtype, same_device, same_dtype};
use crate::storage::dispatch;
use crate::{Result, Tensor, TensorError};

/// What the attention forward saves for its backward.
#[derive(Debug, Clone)]
pub struct AttentionSaved {
    /// The attention weights `[B, heads, T, T]` (zero after each query).
    pub probs: Tensor,
}

/// `[B, T, 3d]` with `3 * n_heads` dividing the last dim, `B, T >= 1`: returns `(B, T, d)`.
fn check_qkv(op: &'static str, qkv: &Tensor, n_heads: usize) -> Result<(usize, usize, usize)> {
    compute_dtype(op, qkv)?;
    let bad = |msg: String| Err(TensorError::Invalid { op, msg });
    let [b, t, w] = qkv.shape() else {
        return bad(format!("qkv must be [batch, time, 3 * d], got {:?}", qkv.shape()));
    };
    if n_heads == 0 || w % (3 * n_heads) != 0 {
        return bad(format!(
            "the last dim of qkv {:?} must split into q, k, v of {n_heads} heads each (a multiple of {})",
            qkv.shape(),
            3 * n_heads.max(1)
        ));
    }
    if *b == 0 || *t == 0 {
        return bad(format!("qkv {:?} holds no token", qkv.shape()));
    }
    Ok((*b, *t, w / 3))
}

impl Tensor {
    /// Causal self-attention of packed projections `self = qkv [B, T, 3d]` (q, k, v side by
    /// side, each `n_heads` heads of `d / n_heads` columns): per head
    /// `softmax(mask(Q Kᵀ * scale)) V`, where query `i` sees keys `0..=i`. Returns
    /// `y [B, T, d]` (head `h` in columns `h*hd..`) and what the backward needs.
    pub fn causal_attention(&self, n_heads: usize, scale: f64) -> Result<(Tensor, AttentionSaved)> {
        let op = "causal_attention";
        let (b, t, d) = check_qkv(op, self, n_heads)?;
        let x = self.contiguous_for(op)?;
        let (y, probs) = dispatch!(&*x.storage(op)?, s => s.causal_attention(x.layout(), n_heads, scale))?;
        Ok((
            Tensor::from_storage(y, &[b, t, d]),
            AttentionSaved {
                probs: Tensor::from_storage(probs, &[b, n_heads, t, t]),
            },
        ))
    }

    /// Gradient `dqkv [B, T, 3d]` of [`Tensor::causal_attention`] from `self = qkv`, the
    /// saved weights and the output gradient `gy [B, T, d]`.
    pub fn causal_attention_backward(
        &self,
        saved: &AttentionSaved,
        gy: &Tensor,
        n_heads: usize,
        scale: f64,
    ) -> Result<Tensor> {
        let op = "causal_attention_backward";
        let (b, t, d) = check_qkv(op, self, n_heads)?;
        for (other, want) in [(gy, vec![b, t, d]), (&saved.probs, vec![b, n_heads, t, t])] {
            same_dtype(op, self, other)?;
            same_device(op, self, other)?;
            if other.shape() != want {
                return Err(TensorError::ShapeMismatch {
                    op,
                    lhs: want,
                    rhs: other.shape().to_vec(),
                });
            }
        }
        let x = self.contiguous_for(op)?;
        let (p, g) = (saved.probs.contiguous_for(op)?, gy.contiguous_for(op)?);
        let (sp, sg) = (p.storage(op)?, g.storage(op)?);
        let dx = dispatch!(&*x.storage(op)?, s, other => s.causal_attention_backward(
            x.layout(),
            (other(&sp)?, p.layout()),
            (other(&sg)?, g.layout()),
            n_heads,
            scale,
        ))?;
        Ok(Tensor::from_storage(dx, self.shape()))
    }
}

#[cfg(test)]
mod tests {
    use crate::storage::DeviceStorage;
    use crate::{DType, Rng, Tensor};

    /// Attention written out with scalar loops in f64: the meaning both paths must have.
    fn naive(qkv: &[f64], b: usize, t: usize, nh: usize, hd: usize) -> Vec<f64> {
        let (d, w) = (nh * hd, 3 * nh * hd);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut y = vec![0.0; b * t * d];
        for bi in 0..b {
            for h in 0..nh {
                let at = |i: usize, part: usize, c: usize| qkv[bi * t * w + i * w + part * d + h * hd + c];
                for i in 0..t {
                    let s: Vec<f64> = (0..=i)
                        .map(|j| (0..hd).map(|c| at(i, 0, c) * at(j, 1, c)).sum::<f64>() * scale)
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for c in 0..hd {
                        y[bi * t * d + i * d + h * hd + c] = (0..=i).map(|j| e[j] / z * at(j, 2, c)).sum();
                    }
                }
            }
        }
        y
    }

    fn cpu(t: &Tensor) -> crate::Buffer {
        match &*t.storage("test").unwrap() {
            DeviceStorage::Cpu(s) => s.clone(),
            _ => unreachable!("a CPU tensor"),
        }
    }

    #[test]
    fn fused_attention_means_masked_scaled_softmax_attention() {
        let (b, t, nh, hd) = (2, 5, 3, 4);
        let qkv = Tensor::randn(&[b, t, 3 * nh * hd], 1.0, DType::F64, &mut Rng::new(1));
        let (y, saved) = qkv.causal_attention(nh, 1.0 / (hd as f64).sqrt()).unwrap();
        let want = naive(&qkv.to_vec::<f64>().unwrap(), b, t, nh, hd);
        for (a, w) in y.to_vec::<f64>().unwrap().iter().zip(&want) {
            assert!((a - w).abs() < 1e-12, "{a} vs {w}");
        }
        // the weights are zero after each query and sum to one
        let p = saved.probs.to_vec::<f64>().unwrap();
        for (r, row) in p.chunks(t).enumerate() {
            let i = r % t;
            assert!(row[i + 1..].iter().all(|&v| v == 0.0), "row {r}: {row:?}");
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
    }

    /// The CPU kernel and the composed path (CUDA's) give the same bits, forward and backward.
    #[test]
    fn fused_kernel_and_composed_path_agree_bit_for_bit() {
        use crate::backend::Attention;
        for dtype in [DType::F32, DType::F64] {
            let (b, t, nh, hd) = (2, 7, 2, 5);
            let mut rng = Rng::new(2);
            let qkv = Tensor::randn(&[b, t, 3 * nh * hd], 1.0, dtype, &mut rng);
            let gy = Tensor::randn(&[b, t, nh * hd], 1.0, dtype, &mut rng);
            let scale = 1.0 / (hd as f64).sqrt();
            let (x, g) = (cpu(&qkv), cpu(&gy));
            let (y1, p1) = x.causal_attention(qkv.layout(), nh, scale).unwrap();
            let (y2, p2) = crate::composed::causal_attention(&x, qkv.layout(), nh, scale).unwrap();
            assert_eq!(y1, y2, "{dtype:?} forward");
            assert_eq!(p1, p2, "{dtype:?} weights");
            let pl = crate::Layout::contiguous(&[b, nh, t, t]);
            let d1 = x
                .causal_attention_backward(qkv.layout(), (&p1, &pl), (&g, gy.layout()), nh, scale)
                .unwrap();
            let d2 =
                crate::composed::causal_attention_backward(&x, qkv.layout(), (&p1, &pl), (&g, gy.layout()), nh, scale)
                    .unwrap();
            assert_eq!(d1, d2, "{dtype:?} backward");
        }
    }
}
