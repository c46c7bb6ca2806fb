//! 16-bit float storage on the CPU (`F16`, `BF16`), computed in f32 as autocast does: every
//! kernel widens its 16-bit operands to f32 (exactly), runs the f32 kernel (f32 accumulation
//! inside GEMMs, reductions, softmax, layer norm and the loss), and rounds each output once to
//! the storage's dtype, to nearest even. A GEMM upcasts whole operands: one tile per matrix.

use brigade_dtype::convert;
use half::{bf16, f16};

use super::view;
use crate::{Buffer, DType, Layout};

/// The 16-bit float dtype of a storage, `None` for every other dtype.
pub(crate) fn half_dtype(b: &Buffer) -> Option<DType> {
    match b {
        Buffer::F16(_) => Some(DType::F16),
        Buffer::BF16(_) => Some(DType::BF16),
        _ => None,
    }
}

/// The view `l` of a storage as f32: a 16-bit view widened into a fresh contiguous f32 buffer
/// (its layout returned beside it: same shape, offset 0), any other storage as it is. A
/// contiguous view widens sixteen elements an instruction (`brigade_dtype::convert`).
pub(crate) fn widen<'a>(b: &'a Buffer, l: &Layout) -> (std::borrow::Cow<'a, Buffer>, Layout) {
    use std::borrow::Cow;
    fn up<T: Copy>(d: &[T], l: &Layout, f: impl Fn(T) -> f32, slice: impl Fn(&[T]) -> Vec<f32>) -> Vec<f32> {
        if l.is_contiguous() {
            slice(view(d, l))
        } else {
            let mut v = Vec::with_capacity(l.numel());
            l.for_each_offset(|o| v.push(f(d[o])));
            v
        }
    }
    let wide = match b {
        Buffer::F16(d) => up(d, l, f16::to_f32, convert::f16_to_f32_vec),
        Buffer::BF16(d) => up(d, l, bf16::to_f32, convert::bf16_to_f32_vec),
        _ => return (Cow::Borrowed(b), l.clone()),
    };
    (Cow::Owned(Buffer::F32(wide)), Layout::contiguous(l.shape()))
}

/// An f32 kernel output rounded to `dtype` (`F16` or `BF16`), to nearest even.
pub(crate) fn narrow(b: Buffer, dtype: DType) -> Buffer {
    match (b, dtype) {
        (Buffer::F32(v), DType::BF16) => Buffer::BF16(convert::to_bf16_vec(&v)),
        (Buffer::F32(v), DType::F16) => Buffer::F16(convert::to_f16_vec(&v)),
        (b, _) => b,
    }
}
