//! The CPU backend: host buffers ([`Buffer`]) and the kernels of the device contract
//! ([`crate::backend`]). GEMM goes through the `gemm` crate; large elementwise and row
//! kernels split across the calling thread's compute pool ([`crate::set_compute_threads`]).
//! Each file is one family of kernels.

mod attention;
mod elementwise;
mod gelu_f32;
mod inplace;
mod matmul;
mod nn;
mod reduce;
mod softmax_row;

pub use matmul::gemm_threads_for;

use crate::backend::{AdamWScalars, BackendStorage, BinaryOp, ReduceOp, SgdScalars, UnaryOp};
use crate::{Buffer, DType, Device, Element, Layout, Result, TensorError};

/// Runs `$body` with `$v` bound to the storage's elements and `$T` to their Rust type,
/// for the types kernels compute in (f32, f64).
macro_rules! float_kernel {
    ($op:expr, $s:expr, $v:ident: $T:ident => $body:expr) => {
        match $s {
            $crate::Buffer::F32($v) => {
                type $T = f32;
                $body
            }
            $crate::Buffer::F64($v) => {
                type $T = f64;
                $body
            }
            s => Err($crate::TensorError::UnsupportedDType {
                op: $op,
                dtype: s.dtype(),
                hint: " (kernels compute in f32/f64: convert with to_dtype first)",
            }),
        }
    };
}
pub(crate) use float_kernel;

/// The elements of an operand that must have the same type as the first one.
pub(crate) fn same<'a, T: Element>(op: &'static str, s: &'a Buffer) -> Result<&'a [T]> {
    T::slice(s).ok_or(TensorError::DTypeMismatch {
        op,
        lhs: T::DTYPE,
        rhs: s.dtype(),
    })
}

/// Mutable elements of an operand that must have the same type as the first one.
pub(crate) fn same_mut<'a, T: Element>(op: &'static str, s: &'a mut Buffer) -> Result<&'a mut [T]> {
    let dtype = s.dtype();
    T::slice_mut(s).ok_or(TensorError::DTypeMismatch {
        op,
        lhs: T::DTYPE,
        rhs: dtype,
    })
}

/// The elements of a contiguous view.
pub(crate) fn view<'a, T>(data: &'a [T], l: &Layout) -> &'a [T] {
    &data[l.offset()..l.offset() + l.numel()]
}

/// The elements of any view, row-major, as a new vector (`T` must be the dtype).
pub(crate) fn gather<T: Element>(s: &Buffer, l: &Layout, op: &'static str) -> Result<Vec<T>> {
    let d = T::slice(s).ok_or(TensorError::DTypeMismatch {
        op,
        lhs: s.dtype(),
        rhs: T::DTYPE,
    })?;
    if l.is_contiguous() {
        Ok(view(d, l).to_vec())
    } else {
        let mut v = Vec::with_capacity(l.numel());
        l.for_each_offset(|o| v.push(d[o]));
        Ok(v)
    }
}

/// The smallest and largest value of an integer buffer (`None` for floats and for an empty
/// buffer): what a device storage remembers of the ids it was given, so that an index check
/// needs no copy back.
pub(crate) fn int_range(b: &Buffer) -> Option<(i64, i64)> {
    fn range(it: impl Iterator<Item = i64>) -> Option<(i64, i64)> {
        it.fold(None, |r, x| match r {
            None => Some((x, x)),
            Some((lo, hi)) => Some((lo.min(x), hi.max(x))),
        })
    }
    match b {
        Buffer::I64(v) => range(v.iter().copied()),
        Buffer::U8(v) => range(v.iter().map(|&x| i64::from(x))),
        Buffer::I8(v) => range(v.iter().map(|&x| i64::from(x))),
        _ => None,
    }
}

/// The range of integer values `range` once converted to `dtype`: the same range when `dtype`
/// is an integer type holding all of it (the conversion keeps every value), else unknown.
pub(crate) fn range_in(range: Option<(i64, i64)>, dtype: DType) -> Option<(i64, i64)> {
    let (lo, hi) = range?;
    let fits = match dtype {
        DType::I64 => true,
        DType::U8 => lo >= 0 && hi <= 255,
        DType::I8 => lo >= -127 && hi <= 127,
        _ => false,
    };
    fits.then_some((lo, hi))
}

/// Index operands (I64 or U8) as `usize`s; the front end has checked their range.
pub(crate) fn indices(op: &'static str, ids: &Buffer, l: &Layout) -> Result<Vec<usize>> {
    match ids {
        Buffer::I64(_) => Ok(gather::<i64>(ids, l, op)?.into_iter().map(|x| x as usize).collect()),
        Buffer::U8(_) => Ok(gather::<u8>(ids, l, op)?.into_iter().map(usize::from).collect()),
        s => Err(TensorError::UnsupportedDType {
            op,
            dtype: s.dtype(),
            hint: " (indices are I64 or U8)",
        }),
    }
}

impl BackendStorage for Buffer {
    fn dtype(&self) -> DType {
        Buffer::dtype(self)
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn len(&self) -> usize {
        Buffer::len(self)
    }

    fn empty_like(&self) -> Self {
        Buffer::zeros(self.dtype(), 0)
    }

    fn to_cpu(&self) -> Result<Buffer> {
        Ok(self.clone())
    }

    fn into_cpu(self) -> Result<Buffer> {
        Ok(self)
    }

    fn copy_strided(&self, layout: &Layout) -> Result<Self> {
        let op = "copy";
        Ok(match self {
            Buffer::F32(_) => Buffer::F32(gather(self, layout, op)?),
            Buffer::F64(_) => Buffer::F64(gather(self, layout, op)?),
            Buffer::F16(_) => Buffer::F16(gather(self, layout, op)?),
            Buffer::BF16(_) => Buffer::BF16(gather(self, layout, op)?),
            Buffer::I64(_) => Buffer::I64(gather(self, layout, op)?),
            Buffer::U8(_) => Buffer::U8(gather(self, layout, op)?),
            Buffer::I8(_) => Buffer::I8(gather(self, layout, op)?),
        })
    }

    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Self> {
        // f32 to 16 bits directly: `half`'s f64 -> bf16 drops the low 32 bits before rounding,
        // so a value just above a tie would round down through f64 (as PyTorch and the
        // collectives' kernels, which round from f32, never do).
        if let Buffer::F32(_) = self {
            match dtype {
                DType::BF16 => {
                    let v = gather::<f32>(self, layout, "to_dtype")?;
                    return Ok(Buffer::BF16(v.into_iter().map(half::bf16::from_f32).collect()));
                }
                DType::F16 => {
                    let v = gather::<f32>(self, layout, "to_dtype")?;
                    return Ok(Buffer::F16(v.into_iter().map(half::f16::from_f32).collect()));
                }
                _ => {}
            }
        }
        fn conv<T: Element>(s: &Buffer, l: &Layout) -> Result<Vec<f64>> {
            Ok(gather::<T>(s, l, "to_dtype")?
                .into_iter()
                .map(Element::to_f64)
                .collect())
        }
        let v = match self {
            Buffer::F32(_) => conv::<f32>(self, layout)?,
            Buffer::F64(_) => conv::<f64>(self, layout)?,
            Buffer::F16(_) => conv::<half::f16>(self, layout)?,
            Buffer::BF16(_) => conv::<half::bf16>(self, layout)?,
            Buffer::I64(_) => conv::<i64>(self, layout)?,
            Buffer::U8(_) => conv::<u8>(self, layout)?,
            Buffer::I8(_) => conv::<i8>(self, layout)?,
        };
        Ok(Buffer::from_f64_vec(v, dtype))
    }

    fn unary(&self, layout: &Layout, op: UnaryOp) -> Result<Self> {
        elementwise::unary(self, layout, op)
    }

    fn binary(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, op: BinaryOp) -> Result<Self> {
        elementwise::binary(self, lhs, rhs, rhs_layout, op)
    }

    fn reduce(&self, layout: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self> {
        reduce::reduce(self, layout, dims, op)
    }

    fn matmul(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self> {
        matmul::matmul(self, lhs, rhs, rhs_layout)
    }

    fn matmul_bias(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, bias: (&Self, &Layout)) -> Result<Self> {
        matmul::matmul_bias(self, lhs, rhs, rhs_layout, bias)
    }

    fn softmax_last(&self, layout: &Layout, log: bool) -> Result<Self> {
        nn::softmax_last(self, layout, log)
    }

    fn softmax_backward(&self, layout: &Layout, g: &Self, g_layout: &Layout, log: bool) -> Result<Self> {
        nn::softmax_backward(self, layout, g, g_layout, log)
    }

    fn layer_norm(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        bias: (&Self, &Layout),
        eps: f64,
    ) -> Result<(Self, Self, Self)> {
        nn::layer_norm(self, layout, weight, bias, eps)
    }

    fn layer_norm_backward(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        mean: (&Self, &Layout),
        rstd: (&Self, &Layout),
        gy: (&Self, &Layout),
    ) -> Result<(Self, Self, Self)> {
        nn::layer_norm_backward(self, layout, weight, mean, rstd, gy)
    }

    fn embedding(&self, layout: &Layout, ids: (&Self, &Layout)) -> Result<Self> {
        nn::embedding(self, layout, ids)
    }

    fn embedding_backward(&self, layout: &Layout, ids: (&Self, &Layout), vocab: usize) -> Result<Self> {
        nn::embedding_backward(self, layout, ids, vocab)
    }

    fn causal_fill(&self, layout: &Layout, value: f64) -> Result<Self> {
        nn::causal_fill(self, layout, value)
    }

    fn causal_attention(&self, layout: &Layout, n_heads: usize, scale: f64) -> Result<(Self, Self)> {
        attention::causal_attention(self, layout, n_heads, scale)
    }

    fn causal_attention_backward(
        &self,
        layout: &Layout,
        probs: (&Self, &Layout),
        gy: (&Self, &Layout),
        n_heads: usize,
        scale: f64,
    ) -> Result<Self> {
        attention::causal_attention_backward(self, layout, probs, gy, n_heads, scale)
    }

    fn cross_entropy(&self, layout: &Layout, targets: (&Self, &Layout)) -> Result<(Self, Self)> {
        nn::cross_entropy(self, layout, targets)
    }

    fn cross_entropy_backward(&self, layout: &Layout, targets: (&Self, &Layout), g: (&Self, &Layout)) -> Result<Self> {
        nn::cross_entropy_backward(self, layout, targets, g)
    }

    fn fill(&mut self, layout: &Layout, v: f64) -> Result<()> {
        inplace::fill(self, layout, v)
    }

    fn copy_from(&mut self, layout: &Layout, src: (&Self, &Layout)) -> Result<()> {
        inplace::copy_from(self, layout, src)
    }

    fn add_scaled_assign(&mut self, layout: &Layout, src: (&Self, &Layout), scale: f64) -> Result<()> {
        inplace::add_scaled_assign(self, layout, src, scale)
    }

    fn sgd_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        momentum_buffer: Option<(&mut Self, &Layout)>,
        s: &SgdScalars,
    ) -> Result<()> {
        inplace::sgd_step(self, layout, grad, momentum_buffer, s)
    }

    fn adamw_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        m: (&mut Self, &Layout),
        v: (&mut Self, &Layout),
        s: &AdamWScalars,
    ) -> Result<()> {
        inplace::adamw_step(self, layout, grad, m, v, s)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Buffer, DType};

    #[test]
    fn integer_ranges_survive_only_conversions_that_keep_every_value() {
        let s = Buffer::from_f64_vec(vec![-3.0, 250.0, 2.5], DType::I8);
        assert_eq!(s, Buffer::I8(vec![-3, 127, 2]));
        assert_eq!(super::int_range(&s), Some((-3, 127)));
        assert_eq!(super::range_in(Some((-3, 127)), DType::I64), Some((-3, 127)));
        assert_eq!(super::range_in(Some((-3, 127)), DType::U8), None);
        assert_eq!(super::range_in(Some((0, 200)), DType::I8), None);
        assert_eq!(super::range_in(Some((0, 200)), DType::F32), None);
        assert_eq!(super::int_range(&Buffer::zeros(DType::F32, 3)), None);
    }
}
