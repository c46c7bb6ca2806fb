//! brigade-dtype: the element types of Brigade and its host buffer.
//!
//! A tensor's storage (`brigade-tensor`) and a collective's flat buffer (`brigade-comm`, which
//! knows no tensors) name their elements with the same [`DType`] and hold them in the same
//! [`Buffer`], so a bucket's memory goes from the tensor down to the wire and back as it is.

#![warn(missing_docs)]

mod buffer;

use std::fmt;
use std::str::FromStr;

pub use buffer::{quantize_i8, Buffer, Element};

/// An element type.
///
/// Tensor kernels compute in `F32` (and `F64`, for the finite-difference gradient checker);
/// `F16` and `BF16` are storage and wire formats: the CPU's kernels read and write them,
/// computing in f32 and rounding each output (mixed precision); `I64` and `U8`
/// hold indices and tokens; `I8` holds quantized values (a reducer policy's int8 payload; converted
/// from floats by rounding half to even and saturating at ±127). Not every type is supported
/// everywhere: a collective reduces floats only, and says so for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte.
    U8,
    /// Signed byte (quantized payloads).
    I8,
}

impl DType {
    /// Every element type, in declaration order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::U8,
        DType::I8,
    ];

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::I8 => 1,
        }
    }

    /// True for the types tensor kernels compute in (`F32`, `F64`).
    pub fn is_compute(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }

    /// True for floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The lower-case name (`f32`, `bf16`, `u8`, `i8`), as PyTorch and numpy spell it.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::I8 => "i8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not an element type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownDType(pub String);

impl fmt::Display for UnknownDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown dtype '{}' (f32, f64, f16, bf16, i64, u8, i8)", self.0)
    }
}

impl std::error::Error for UnknownDType {}

impl FromStr for DType {
    type Err = UnknownDType;

    /// Parses a [`DType::name`] (case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        DType::ALL
            .into_iter()
            .find(|d| d.name() == lower)
            .ok_or_else(|| UnknownDType(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_to_its_dtype() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.to_string().to_uppercase().parse::<DType>(), Ok(d));
        }
        assert!("f8".parse::<DType>().unwrap_err().to_string().contains("'f8'"));
    }

    #[test]
    fn sizes_are_the_bytes_of_one_element() {
        let sizes: Vec<usize> = DType::ALL.iter().map(|d| d.size_in_bytes()).collect();
        assert_eq!(sizes, [4, 8, 2, 2, 8, 1, 1]);
    }
}
