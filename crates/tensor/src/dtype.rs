//! Element types: which ones a tensor can store and which ones kernels compute in.

/// The element type of a tensor's storage: Brigade's one [`DType`] (shared with the
/// collectives' buffers, `brigade-comm`). Kernels compute in `F32` (and `F64`, used by the
/// finite-difference gradient checker); `F16` and `BF16` are storage formats converted on the
/// way in and out; `I64` and `U8` hold indices and tokens; `I8` holds quantized payloads.
pub use brigade_dtype::DType;

/// A type that a tensor can hold, and that host vectors moved in and out of tensors have.
pub use brigade_dtype::Element;

/// A host buffer: a CPU tensor's storage, and what a collective moves.
pub use brigade_dtype::Buffer;

/// A type kernels compute in: `f32` for training, `f64` for gradient checks.
pub trait Float:
    Element
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::ops::MulAssign
    + std::iter::Sum
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// Negative infinity (the identity of a max).
    const NEG_INFINITY: Self;
    /// e to the power `self`.
    fn exp(self) -> Self;
    /// The natural logarithm.
    fn ln(self) -> Self;
    /// The square root.
    fn sqrt(self) -> Self;
    /// The error function.
    fn erf(self) -> Self;
    /// The absolute value.
    fn abs(self) -> Self;
    /// `self` to the power `p`.
    fn powf(self, p: Self) -> Self;
    /// The larger of the two (as `f32::max`: a NaN operand gives the other).
    fn max(self, other: Self) -> Self;
    /// True for a NaN.
    fn is_nan(self) -> bool;
    /// The sine.
    fn sin(self) -> Self;
    /// The cosine.
    fn cos(self) -> Self;
    /// The nearest integer, half to even.
    fn round_ties_even(self) -> Self;
    /// `n` in this type (rounded).
    fn from_usize(n: usize) -> Self {
        Self::from_f64(n as f64)
    }
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn erf(self) -> Self {
        libm::erff(self)
    }
    fn abs(self) -> Self {
        f32::abs(self)
    }
    fn powf(self, p: Self) -> Self {
        f32::powf(self, p)
    }
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn sin(self) -> Self {
        f32::sin(self)
    }
    fn cos(self) -> Self {
        f32::cos(self)
    }
    fn round_ties_even(self) -> Self {
        f32::round_ties_even(self)
    }
}

impl Float for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn erf(self) -> Self {
        libm::erf(self)
    }
    fn abs(self) -> Self {
        f64::abs(self)
    }
    fn powf(self, p: Self) -> Self {
        f64::powf(self, p)
    }
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn sin(self) -> Self {
        f64::sin(self)
    }
    fn cos(self) -> Self {
        f64::cos(self)
    }
    fn round_ties_even(self) -> Self {
        f64::round_ties_even(self)
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Tensor};

    #[test]
    fn f32_to_i8_rounds_half_to_even_and_saturates_at_127() {
        let x = [
            0.5f32,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.49,
            126.5,
            127.6,
            300.0,
            -127.5,
            -1e9,
            f32::NAN,
        ];
        let q = Tensor::from_slice(&x, &[x.len()]).unwrap().to_dtype(DType::I8).unwrap();
        assert_eq!(q.dtype(), DType::I8);
        // half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2; saturating at ±127 (never -128); NaN -> 0
        assert_eq!(
            q.to_vec::<i8>().unwrap(),
            [0, 2, 2, 0, -2, -2, 126, 127, 127, -127, -127, 0]
        );
        // and back to f32 exactly
        let back = q.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(
            back,
            [0.0, 2.0, 2.0, 0.0, -2.0, -2.0, 126.0, 127.0, 127.0, -127.0, -127.0, 0.0]
        );
        // an i8 tensor is storage: fills, copies and views work on it
        let z = Tensor::zeros(&[4], DType::I8);
        z.narrow(0, 1, 2)
            .unwrap()
            .copy_from(&q.narrow(0, 1, 2).unwrap())
            .unwrap();
        assert_eq!(z.to_vec::<i8>().unwrap(), [0, 2, 2, 0]);
    }

    #[test]
    fn f32_to_bf16_rounds_to_nearest_from_the_f32_itself() {
        // 1 + 2^-8 + 2^-23 lies just above the tie between bf16's 1 and 1 + 2^-7: it rounds up
        // (through f64, half's conversion would see an exact tie and round to even, down).
        let x = 1.0f32 + 2f32.powi(-8) + 2f32.powi(-23);
        let t = Tensor::from_slice(&[x, -x], &[2]).unwrap();
        let b = t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let up = 1.0f32 + 2f32.powi(-7);
        assert_eq!(b.to_vec::<f32>().unwrap(), [up, -up]);
        assert_eq!(half::bf16::from_f32(x).to_f32(), up, "the reference rounding");
        let h = t.to_dtype(DType::F16).unwrap().to_vec::<half::f16>().unwrap();
        assert_eq!(h, [half::f16::from_f32(x), half::f16::from_f32(-x)]);
    }
}
