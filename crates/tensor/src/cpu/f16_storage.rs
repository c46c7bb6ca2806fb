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

/// A 16-bit float element: its whole-slice conversions (`brigade_dtype::convert`).
pub(crate) trait HalfFloat: Copy + Default + Send + Sync {
    /// `dst[i] = src[i]` widened (exact).
    fn widen_into(src: &[Self], dst: &mut [f32]);
    /// `dst[i] = src[i]` rounded to nearest even.
    fn round_into(src: &[f32], dst: &mut [Self]);
}

impl HalfFloat for bf16 {
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        convert::bf16_to_f32(src, dst)
    }
    fn round_into(src: &[f32], dst: &mut [Self]) {
        convert::f32_to_bf16(src, dst)
    }
}

impl HalfFloat for f16 {
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        convert::f16_to_f32(src, dst)
    }
    fn round_into(src: &[f32], dst: &mut [Self]) {
        convert::f32_to_f16(src, dst)
    }
}

/// Elements per chunk of a fused 16-bit elementwise op: the widened operands and the f32
/// result stay in the first-level cache between the widening, the f32 kernel and the rounding.
pub(crate) const HALF_CHUNK: usize = 1024;

/// `f(x, y, out)` over one chunk of at most [`HALF_CHUNK`] 16-bit elements (`y` empty when
/// there is no second operand), widened first and rounded into `out16` after.
pub(crate) fn half_chunk<H: HalfFloat>(
    x16: &[H],
    y16: Option<&[H]>,
    out16: &mut [H],
    f: &(impl Fn(&[f32], &[f32], &mut [f32]) + Sync),
) {
    let n = x16.len();
    let (mut x, mut y, mut o) = ([0.0f32; HALF_CHUNK], [0.0f32; HALF_CHUNK], [0.0f32; HALF_CHUNK]);
    H::widen_into(x16, &mut x[..n]);
    let y = match y16 {
        Some(y16) => {
            H::widen_into(y16, &mut y[..n]);
            &y[..n]
        }
        None => &y[..0],
    };
    f(&x[..n], y, &mut o[..n]);
    H::round_into(&o[..n], out16);
}

/// `f` over contiguous 16-bit views `x` (and `y`, of the same dtype and length) into a new
/// 16-bit buffer, a [`HALF_CHUNK`] at a time ([`half_chunk`]), chunks in parallel on the calling
/// thread's compute pool: one pass over memory, and the bits of widening both operands whole,
/// running the f32 kernel and rounding its output. `None` when the views are not both
/// contiguous 16-bit views of one dtype.
pub(crate) fn zip_half(
    x: (&Buffer, &Layout),
    y: Option<(&Buffer, &Layout)>,
    f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync + Send,
) -> Option<Buffer> {
    fn go<H: HalfFloat>(xs: &[H], ys: Option<&[H]>, f: &(impl Fn(&[f32], &[f32], &mut [f32]) + Sync)) -> Vec<H> {
        let mut out = vec![H::default(); xs.len()];
        crate::threads::par_chunks_mut(&mut out, 16 * HALF_CHUNK, |start, chunk| {
            for (i, o) in chunk.chunks_mut(HALF_CHUNK).enumerate() {
                let lo = start + i * HALF_CHUNK;
                let hi = lo + o.len();
                half_chunk(&xs[lo..hi], ys.map(|y| &y[lo..hi]), o, f);
            }
        });
        out
    }
    if !x.1.is_contiguous() || y.is_some_and(|(_, l)| !l.is_contiguous() || l.numel() != x.1.numel()) {
        return None;
    }
    match (x.0, y.map(|(b, _)| b)) {
        (Buffer::BF16(d), None) => Some(Buffer::BF16(go(view(d, x.1), None, &f))),
        (Buffer::F16(d), None) => Some(Buffer::F16(go(view(d, x.1), None, &f))),
        (Buffer::BF16(d), Some(Buffer::BF16(e))) => Some(Buffer::BF16(go(view(d, x.1), Some(view(e, y?.1)), &f))),
        (Buffer::F16(d), Some(Buffer::F16(e))) => Some(Buffer::F16(go(view(d, x.1), Some(view(e, y?.1)), &f))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BinaryOp, Elementwise, InPlace, UnaryOp};

    /// `n` values of `dtype` spread over [-6, 6), with some NaNs and infinities.
    fn values(n: usize, salt: usize, dtype: DType) -> Buffer {
        let v: Vec<f32> = (0..n)
            .map(|i| match (i * 7 + salt) % 997 {
                0 => f32::NAN,
                1 => f32::INFINITY,
                k => (k as f32 - 498.0) * 0.012,
            })
            .collect();
        narrow(Buffer::F32(v), dtype)
    }

    /// The chunked 16-bit ops (GELU and its derivative, add, multiply, accumulate) give the
    /// bits of widening whole operands, the f32 kernel, and one rounding, over lengths that end
    /// inside and on a chunk.
    #[test]
    fn fused_16_bit_elementwise_ops_give_the_bits_of_the_widened_ones() {
        for dtype in [DType::BF16, DType::F16] {
            for n in [3, HALF_CHUNK, 5000] {
                let l = Layout::contiguous(&[n]);
                let (x, y) = (values(n, 0, dtype), values(n, 5, dtype));
                let (xw, _) = widen(&x, &l);
                let (yw, _) = widen(&y, &l);
                let got = x.unary(&l, UnaryOp::Gelu).unwrap();
                let want = narrow(xw.unary(&l, UnaryOp::Gelu).unwrap(), dtype);
                assert_eq!(got.to_le_bytes(), want.to_le_bytes(), "gelu {dtype} {n}");
                for op in [BinaryOp::GeluBackward, BinaryOp::Add, BinaryOp::Mul] {
                    let got = x.binary(&l, &y, &l, op).unwrap();
                    let want = narrow(xw.binary(&l, &yw, &l, op).unwrap(), dtype);
                    assert_eq!(got.to_le_bytes(), want.to_le_bytes(), "{op:?} {dtype} {n}");
                }
                let mut acc = x.clone();
                acc.add_scaled_assign(&l, (&y, &l), 0.3).unwrap();
                let mut want = xw.into_owned();
                want.add_scaled_assign(&l, (&yw, &l), 0.3).unwrap();
                let want = narrow(want, dtype).to_le_bytes();
                assert_eq!(acc.to_le_bytes(), want, "accumulate {dtype} {n}");
            }
        }
    }
}
