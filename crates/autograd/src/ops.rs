//! Differentiable ops on [`Var`]: each builds its output and, right beside it, the
//! closure that maps the output's gradient to its inputs' gradients.

use brigade_tensor::{Tensor, TensorError};

use crate::{Result, Var};

/// Inverse of a permutation.
fn inverse_perm(p: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; p.len()];
    for (i, &x) in p.iter().enumerate() {
        inv[x] = i;
    }
    inv
}

impl Var {
    fn binary_broadcast(
        &self,
        rhs: &Var,
        op: &'static str,
        fwd: fn(&Tensor, &Tensor) -> brigade_tensor::Result<Tensor>,
        bwd: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)> + Send + Sync + 'static,
    ) -> Result<Var> {
        let (a, b) = (self.value(), rhs.value());
        let out = fwd(&a, &b)?;
        let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
        Ok(Var::from_op(op, out, &[self, rhs], move |g| {
            let (ga, gb) = bwd(&a, &b, g)?;
            Ok(vec![Some(ga.sum_to_shape(&sa)?), Some(gb.sum_to_shape(&sb)?)])
        }))
    }

    /// `a + b`, broadcasting.
    pub fn add(&self, rhs: &Var) -> Result<Var> {
        // d(a+b) = (g, g)
        self.binary_broadcast(rhs, "add", Tensor::add, |_, _, g| Ok((g.clone(), g.clone())))
    }

    /// `a - b`, broadcasting.
    pub fn sub(&self, rhs: &Var) -> Result<Var> {
        // d(a-b) = (g, -g)
        self.binary_broadcast(rhs, "sub", Tensor::sub, |_, _, g| Ok((g.clone(), g.neg()?)))
    }

    /// `a * b`, broadcasting.
    pub fn mul(&self, rhs: &Var) -> Result<Var> {
        // d(ab) = (g b, g a)
        self.binary_broadcast(rhs, "mul", Tensor::mul, |a, b, g| Ok((g.mul(b)?, g.mul(a)?)))
    }

    /// `a / b`, broadcasting.
    pub fn div(&self, rhs: &Var) -> Result<Var> {
        // d(a/b) = (g / b, -g a / b^2)
        self.binary_broadcast(rhs, "div", Tensor::div, |a, b, g| {
            Ok((g.div(b)?, g.mul(a)?.div(&b.sqr()?)?.neg()?))
        })
    }

    /// `x * mul + add`.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Var> {
        let out = self.value().affine(mul, add)?;
        Ok(Var::from_op("affine", out, &[self], move |g| {
            Ok(vec![Some(g.mul_scalar(mul)?)])
        }))
    }

    /// `x * s`.
    pub fn mul_scalar(&self, s: f64) -> Result<Var> {
        self.affine(s, 0.0)
    }

    /// `x + s`.
    pub fn add_scalar(&self, s: f64) -> Result<Var> {
        self.affine(1.0, s)
    }

    /// `-x`.
    pub fn neg(&self) -> Result<Var> {
        self.affine(-1.0, 0.0)
    }

    /// `e^x`.
    pub fn exp(&self) -> Result<Var> {
        let y = self.value().exp()?;
        let yc = y.clone();
        // d e^x = g e^x
        Ok(Var::from_op("exp", y, &[self], move |g| Ok(vec![Some(g.mul(&yc)?)])))
    }

    /// Natural log.
    pub fn ln(&self) -> Result<Var> {
        let x = self.value();
        let y = x.ln()?;
        // d ln x = g / x
        Ok(Var::from_op("ln", y, &[self], move |g| Ok(vec![Some(g.div(&x)?)])))
    }

    /// Square root.
    pub fn sqrt(&self) -> Result<Var> {
        let y = self.value().sqrt()?;
        let yc = y.clone();
        // d sqrt x = g / (2 sqrt x)
        Ok(Var::from_op("sqrt", y, &[self], move |g| {
            Ok(vec![Some(g.div(&yc)?.mul_scalar(0.5)?)])
        }))
    }

    /// `max(x, 0)`.
    pub fn relu(&self) -> Result<Var> {
        let x = self.value();
        Ok(Var::from_op("relu", x.relu()?, &[self], move |g| {
            Ok(vec![Some(x.relu_backward(g)?)])
        }))
    }

    /// GELU, exact erf form.
    pub fn gelu(&self) -> Result<Var> {
        let x = self.value();
        Ok(Var::from_op("gelu", x.gelu()?, &[self], move |g| {
            Ok(vec![Some(x.gelu_backward(g)?)])
        }))
    }

    /// `x^2`.
    pub fn sqr(&self) -> Result<Var> {
        let x = self.value();
        // d x^2 = 2 g x
        Ok(Var::from_op("sqr", x.sqr()?, &[self], move |g| {
            Ok(vec![Some(g.mul(&x)?.mul_scalar(2.0)?)])
        }))
    }

    /// `x^p` for a scalar exponent (`torch.pow(x, p)`).
    pub fn pow(&self, p: f64) -> Result<Var> {
        let x = self.value();
        // d x^p = g p x^(p-1)
        Ok(Var::from_op("pow", x.powf(p)?, &[self], move |g| {
            Ok(vec![Some(g.mul(&x.powf(p - 1.0)?)?.mul_scalar(p)?)])
        }))
    }

    /// Sine (radians).
    pub fn sin(&self) -> Result<Var> {
        let x = self.value();
        // d sin x = g cos x
        Ok(Var::from_op("sin", x.sin()?, &[self], move |g| {
            Ok(vec![Some(g.mul(&x.cos()?)?)])
        }))
    }

    /// Cosine (radians).
    pub fn cos(&self) -> Result<Var> {
        let x = self.value();
        // d cos x = -g sin x
        Ok(Var::from_op("cos", x.cos()?, &[self], move |g| {
            Ok(vec![Some(g.mul(&x.sin()?)?.neg()?)])
        }))
    }

    /// `|x|`; the gradient is `g * sign(x)`, so 0 at 0 (PyTorch's choice).
    pub fn abs(&self) -> Result<Var> {
        let x = self.value();
        Ok(Var::from_op("abs", x.abs()?, &[self], move |g| {
            Ok(vec![Some(g.mul(&x.sign()?)?)])
        }))
    }

    /// Each element limited to `[min, max]` (`torch.clamp`; an infinite bound leaves its side
    /// open). The gradient passes where `min <= x <= max`, bounds included, as in PyTorch,
    /// and is 0 elsewhere.
    pub fn clamp(&self, min: f64, max: f64) -> Result<Var> {
        let x = self.value();
        Ok(Var::from_op("clamp", x.clamp(min, max)?, &[self], move |g| {
            Ok(vec![Some(g.mul(&x.in_range(min, max)?)?)])
        }))
    }

    /// The nearest integer, half to even (`torch.round`). Its gradient is **zero** everywhere,
    /// as in PyTorch (the derivative of a step function almost everywhere). For a
    /// straight-through estimator (quantization-aware training), write
    /// `x.add(&x.round()?.sub(&x)?.detach())`: the value of `round(x)`, the gradient of `x`.
    pub fn round(&self) -> Result<Var> {
        let x = self.value();
        let (shape, dtype) = (x.shape().to_vec(), x.dtype());
        Ok(Var::from_op("round", x.round()?, &[self], move |g| {
            Ok(vec![Some(Tensor::zeros_on(&shape, dtype, g.device())?)])
        }))
    }

    /// Maximum over `dims` (`torch.amax`). The gradient goes to the element that is the
    /// maximum, shared equally among tied maxima (PyTorch's `amax`).
    pub fn amax(&self, dims: &[usize], keepdim: bool) -> Result<Var> {
        self.extremum("amax", dims, keepdim, Tensor::amax)
    }

    /// Minimum over `dims` (`torch.amin`), the gradient as for [`Var::amax`].
    pub fn amin(&self, dims: &[usize], keepdim: bool) -> Result<Var> {
        self.extremum("amin", dims, keepdim, Tensor::amin)
    }

    fn extremum(
        &self,
        op: &'static str,
        dims: &[usize],
        keepdim: bool,
        reduce: fn(&Tensor, &[usize], bool) -> brigade_tensor::Result<Tensor>,
    ) -> Result<Var> {
        let x = self.value();
        let m = reduce(&x, dims, true)?;
        let out = if keepdim { m.clone() } else { reduce(&x, dims, false)? };
        let (shape, dims) = (x.shape().to_vec(), dims.to_vec());
        Ok(Var::from_op(op, out, &[self], move |g| {
            // mask = (x == m); grad = g * mask / count(mask)
            let mask = x.sub(&m)?.is_zero()?;
            let count = mask.sum(&dims, true)?;
            let g = g.reshape(m.shape())?;
            Ok(vec![Some(
                mask.mul(&g.div(&count)?)?.broadcast_to(&shape)?.contiguous()?,
            )])
        }))
    }

    /// Matrix product over the last two dims (batch dims broadcast).
    pub fn matmul(&self, rhs: &Var) -> Result<Var> {
        let (a, b) = (self.value(), rhs.value());
        let out = a.matmul(&b)?;
        Ok(Var::from_op("matmul", out, &[self, rhs], move |g| {
            // dA = G B^T, dB = A^T G (summed over broadcast batch dims)
            let ga = g.matmul(&b.t()?)?.sum_to_shape(a.shape())?;
            let gb = if b.rank() == 2 && a.rank() > 2 {
                // fold the batch into the rows: one GEMM instead of a batch and a sum
                let k = a.shape()[a.rank() - 1];
                let n = g.shape()[g.rank() - 1];
                let rows = a.numel() / k.max(1);
                a.reshape(&[rows, k])?.t()?.matmul(&g.reshape(&[rows, n])?)?
            } else {
                a.t()?.matmul(g)?.sum_to_shape(b.shape())?
            };
            Ok(vec![Some(ga), Some(gb)])
        }))
    }

    /// `x W^T + b` with PyTorch's layout: `x` is `[.., in]`, `W` is `[out, in]`, `b` is
    /// `[out]`. One fused op, so that the weight gradient `G^T X` comes out `[out, in]`
    /// contiguous, exactly the layout of `W` (no transpose to gather).
    pub fn linear(&self, weight: &Var, bias: Option<&Var>) -> Result<Var> {
        let (x, w) = (self.value(), weight.value());
        if w.rank() != 2 || x.rank() < 1 || x.shape()[x.rank() - 1] != w.shape()[1] {
            return Err(TensorError::ShapeMismatch {
                op: "linear",
                lhs: x.shape().to_vec(),
                rhs: w.shape().to_vec(),
            }
            .into());
        }
        let (n_in, n_out) = (w.shape()[1], w.shape()[0]);
        let rows = x.numel() / n_in.max(1);
        let mut out_shape = x.shape().to_vec();
        *out_shape.last_mut().expect("rank >= 1") = n_out;
        let x2 = x.reshape(&[rows, n_in])?;
        let y = match bias {
            Some(b) => x2.matmul_bias(&w.t()?, &b.value())?,
            None => x2.matmul(&w.t()?)?,
        };
        let y = y.reshape(&out_shape)?;
        let x_shape = x.shape().to_vec();
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        let has_bias = bias.is_some();
        // The first layer's input needs no gradient: skip that GEMM.
        let x_needs_grad = self.requires_grad();
        Ok(Var::from_op("linear", y, &inputs, move |g| {
            let g2 = g.reshape(&[rows, n_out])?;
            // dX = G W, dW = G^T X, db = sum over rows of G
            let gx = if x_needs_grad {
                Some(g2.matmul(&w)?.reshape(&x_shape)?)
            } else {
                None
            };
            let gw = g2.t()?.matmul(&x2)?;
            let mut grads = vec![gx, Some(gw)];
            if has_bias {
                grads.push(Some(g2.sum(&[0], false)?));
            }
            Ok(grads)
        }))
    }

    /// Sum over `dims`.
    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Result<Var> {
        let x = self.value();
        let out = x.sum(dims, keepdim)?;
        let shape = x.shape().to_vec();
        let kept = keep_shape(&shape, dims);
        Ok(Var::from_op("sum", out, &[self], move |g| {
            Ok(vec![Some(g.reshape(&kept)?.broadcast_to(&shape)?.contiguous()?)])
        }))
    }

    /// Sum of all elements (a 0-d var).
    pub fn sum_all(&self) -> Result<Var> {
        let dims: Vec<usize> = (0..self.value().rank()).collect();
        self.sum(&dims, false)
    }

    /// Mean over `dims`.
    pub fn mean(&self, dims: &[usize], keepdim: bool) -> Result<Var> {
        let shape = self.shape();
        let n: usize = dims.iter().filter_map(|&d| shape.get(d)).product();
        self.sum(dims, keepdim)?.mul_scalar(1.0 / n.max(1) as f64)
    }

    /// Mean of all elements.
    pub fn mean_all(&self) -> Result<Var> {
        let dims: Vec<usize> = (0..self.value().rank()).collect();
        self.mean(&dims, false)
    }

    /// Maximum over one dim; the gradient is shared equally among tied maxima.
    pub fn max_dim(&self, dim: usize, keepdim: bool) -> Result<Var> {
        let x = self.value();
        let m = x.max_dim(dim, true)?;
        let out = if keepdim { m.clone() } else { x.max_dim(dim, false)? };
        let shape = x.shape().to_vec();
        Ok(Var::from_op("max", out, &[self], move |g| {
            // mask = (x == max); grad = g * mask / count(mask)
            let mask = x.sub(&m)?.is_zero()?;
            let count = mask.sum(&[dim], true)?;
            let g = g.reshape(m.shape())?;
            Ok(vec![Some(
                mask.mul(&g.div(&count)?)?.broadcast_to(&shape)?.contiguous()?,
            )])
        }))
    }

    /// Softmax over the last axis.
    pub fn softmax(&self) -> Result<Var> {
        let y = self.value().softmax_last()?;
        let yc = y.clone();
        Ok(Var::from_op("softmax", y, &[self], move |g| {
            Ok(vec![Some(yc.softmax_backward(g)?)])
        }))
    }

    /// Log-softmax over the last axis.
    pub fn log_softmax(&self) -> Result<Var> {
        let y = self.value().log_softmax_last()?;
        let yc = y.clone();
        Ok(Var::from_op("log_softmax", y, &[self], move |g| {
            Ok(vec![Some(yc.log_softmax_backward(g)?)])
        }))
    }

    /// Layer norm over the last axis with affine parameters `[d]`.
    pub fn layer_norm(&self, weight: &Var, bias: &Var, eps: f64) -> Result<Var> {
        let (x, w) = (self.value(), weight.value());
        let (y, saved) = x.layer_norm(&w, &bias.value(), eps)?;
        Ok(Var::from_op("layer_norm", y, &[self, weight, bias], move |g| {
            let (dx, dw, db) = x.layer_norm_backward(&w, &saved, g)?;
            Ok(vec![Some(dx), Some(dw), Some(db)])
        }))
    }

    /// Rows of this `[vocab, d]` table picked by integer `ids`: `[ids.., d]`.
    pub fn embedding(&self, ids: &Tensor) -> Result<Var> {
        let w = self.value();
        let out = w.embedding(ids)?;
        let (ids, vocab) = (ids.clone(), w.shape()[0]);
        Ok(Var::from_op("embedding", out, &[self], move |g| {
            Ok(vec![Some(g.embedding_backward(&ids, vocab)?)])
        }))
    }

    /// Sets the future positions of `[.., T, S]` attention scores to -inf.
    pub fn causal_mask(&self) -> Result<Var> {
        let out = self.value().causal_fill(f64::NEG_INFINITY)?;
        // masked positions pass no gradient
        Ok(Var::from_op("causal_mask", out, &[self], move |g| {
            Ok(vec![Some(g.causal_fill(0.0)?)])
        }))
    }

    /// Causal multi-head self-attention of packed projections `[B, T, 3d]` (q, k, v side by
    /// side, `n_heads` heads each) into `[B, T, d]`, scores scaled by `1/sqrt(d / n_heads)`:
    /// one fused op, PyTorch's `scaled_dot_product_attention(.., is_causal=True)`.
    pub fn causal_attention(&self, n_heads: usize) -> Result<Var> {
        let x = self.value();
        let hd = x.shape().last().copied().unwrap_or(0) / (3 * n_heads.max(1));
        let scale = 1.0 / (hd as f64).sqrt();
        let (y, saved) = x.causal_attention(n_heads, scale)?;
        Ok(Var::from_op("attention", y, &[self], move |g| {
            Ok(vec![Some(x.causal_attention_backward(&saved, g, n_heads, scale)?)])
        }))
    }

    /// Mean cross-entropy of `[n, c]` logits against `[n]` integer targets.
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<Var> {
        let (loss, probs) = self.value().cross_entropy(targets)?;
        let targets = targets.clone();
        Ok(Var::from_op("cross_entropy", loss, &[self], move |g| {
            // the upstream gradient stays where it is (a host read here stalled every step)
            Ok(vec![Some(probs.cross_entropy_backward_by(&targets, g)?)])
        }))
    }

    /// The same elements in another shape.
    pub fn reshape(&self, shape: &[usize]) -> Result<Var> {
        let x = self.value();
        let old = x.shape().to_vec();
        Ok(Var::from_op("reshape", x.reshape(shape)?, &[self], move |g| {
            Ok(vec![Some(g.reshape(&old)?)])
        }))
    }

    /// Swaps two dims (a view).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Var> {
        let out = self.value().transpose(a, b)?;
        Ok(Var::from_op("transpose", out, &[self], move |g| {
            Ok(vec![Some(g.transpose(a, b)?)])
        }))
    }

    /// Swaps the last two dims (a view).
    pub fn t(&self) -> Result<Var> {
        let r = self.value().rank();
        if r < 2 {
            return Err(TensorError::Invalid {
                op: "t",
                msg: format!("needs rank >= 2, got {:?}", self.shape()),
            }
            .into());
        }
        self.transpose(r - 2, r - 1)
    }

    /// Reorders dims (a view).
    pub fn permute(&self, perm: &[usize]) -> Result<Var> {
        let out = self.value().permute(perm)?;
        let inv = inverse_perm(perm);
        Ok(Var::from_op("permute", out, &[self], move |g| {
            Ok(vec![Some(g.permute(&inv)?)])
        }))
    }

    /// Elements `start..start+len` along `dim` (a view).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Var> {
        let x = self.value();
        let (shape, dtype) = (x.shape().to_vec(), x.dtype());
        Ok(Var::from_op("narrow", x.narrow(dim, start, len)?, &[self], move |g| {
            // on the gradient's device (a host tensor here was a device mismatch on a GPU)
            let full = Tensor::zeros_on(&shape, dtype, g.device())?;
            full.narrow(dim, start, len)?.add_assign(g)?;
            Ok(vec![Some(full)])
        }))
    }

    /// The elements converted to `dtype` (rounding to nearest even); the gradient is converted
    /// back to the input's dtype. Mixed precision casts at its boundaries with it: 16-bit
    /// logits widened to f32 before the loss, as autocast runs the loss in f32.
    pub fn to_dtype(&self, dtype: brigade_tensor::DType) -> Result<Var> {
        let x = self.value();
        let from = x.dtype();
        if from == dtype {
            return Ok(self.clone());
        }
        Ok(Var::from_op("to_dtype", x.to_dtype(dtype)?, &[self], move |g| {
            Ok(vec![Some(g.to_dtype(from)?)])
        }))
    }

    /// A contiguous copy (identity for gradients).
    pub fn contiguous(&self) -> Result<Var> {
        let out = self.value().contiguous()?;
        Ok(Var::from_op("contiguous", out, &[self], |g| Ok(vec![Some(g.clone())])))
    }
}

/// `shape` with the reduced `dims` kept as size 1.
fn keep_shape(shape: &[usize], dims: &[usize]) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .map(|(i, &s)| if dims.contains(&i) { 1 } else { s })
        .collect()
}
