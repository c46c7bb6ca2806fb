//! brigade-dtype: the element types of Brigade and its host buffer.
//!
//! A tensor's storage (`brigade-tensor`) and a collective's flat buffer (`brigade-comm`, which
//! knows no tensors) name their elements with the same [`DType`] and hold them in the same
//! [`Buffer`], so a bucket's memory goes from the tensor down to the wire and back as it is.

#![warn(missing_docs)]

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

pub mod convert;

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

// The host buffer: one flat vector of one element type. A CPU tensor's storage is one, and a
// collective moves one, so a tensor's memory reaches the wire without a conversion.

/// An `f64` rounded to `i8` as the quantizing cast does: half to even, saturating at ±127 (the
/// symmetric range: -128 is never produced), NaN to 0.
pub fn quantize_i8(x: f64) -> i8 {
    if x.is_nan() {
        return 0;
    }
    x.round_ties_even().clamp(-127.0, 127.0) as i8
}

/// A Rust type that is the element of one [`DType`], and that a [`Buffer`] holds.
pub trait Element: Copy + Send + Sync + std::fmt::Debug + Default + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Borrows the buffer's elements if it holds this type.
    fn slice(b: &Buffer) -> Option<&[Self]>;
    /// Borrows the buffer's elements mutably if it holds this type.
    fn slice_mut(b: &mut Buffer) -> Option<&mut [Self]>;
    /// Wraps a vector into a buffer (no copy).
    fn wrap(v: Vec<Self>) -> Buffer;
    /// Takes the vector out of a buffer if it holds this type (no copy).
    fn unwrap(b: Buffer) -> Option<Vec<Self>>;
    /// Converts to f64 (lossless for every type but large i64).
    fn to_f64(self) -> f64;
    /// Converts from f64, rounding as the type requires (floats to nearest even, `i64` and `u8`
    /// as Rust's `as`, `i8` by [`quantize_i8`]).
    fn from_f64(x: f64) -> Self;
}

/// A flat vector of one element type in host memory: a CPU tensor's storage, and what a
/// collective is handed by value and hands back (the same `Vec`, never a copy, so the caller
/// regains its allocation).
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// i64 elements (indices, tokens).
    I64(Vec<i64>),
    /// Bytes (tokens; serialized records compared across ranks).
    U8(Vec<u8>),
    /// Signed bytes: quantized payloads.
    I8(Vec<i8>),
}

/// Runs `$e` with `$v` bound to the buffer's vector, whatever its element type.
macro_rules! each {
    ($b:expr, $v:ident => $e:expr) => {
        match $b {
            Buffer::F32($v) => $e,
            Buffer::F64($v) => $e,
            Buffer::F16($v) => $e,
            Buffer::BF16($v) => $e,
            Buffer::I64($v) => $e,
            Buffer::U8($v) => $e,
            Buffer::I8($v) => $e,
        }
    };
}

macro_rules! element {
    ($t:ty, $variant:ident, $to:expr, $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn slice(b: &Buffer) -> Option<&[Self]> {
                match b {
                    Buffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(b: &mut Buffer) -> Option<&mut [Self]> {
                match b {
                    Buffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> Buffer {
                Buffer::$variant(v)
            }
            fn unwrap(b: Buffer) -> Option<Vec<Self>> {
                match b {
                    Buffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
            fn from_f64(x: f64) -> Self {
                ($from)(x)
            }
        }

        impl From<Vec<$t>> for Buffer {
            fn from(v: Vec<$t>) -> Self {
                Buffer::$variant(v)
            }
        }
    };
}

element!(f32, F32, |x: f32| x as f64, |x: f64| x as f32);
element!(f64, F64, |x: f64| x, |x: f64| x);
element!(f16, F16, |x: f16| x.to_f64(), f16::from_f64);
element!(bf16, BF16, |x: bf16| x.to_f64(), bf16::from_f64);
element!(i64, I64, |x: i64| x as f64, |x: f64| x as i64);
element!(u8, U8, |x: u8| x as f64, |x: f64| x as u8);
element!(i8, I8, |x: i8| x as f64, quantize_i8);

macro_rules! accessors {
    ($variant:ident, $ty:ty, $as:ident, $into:ident) => {
        #[doc = concat!("The elements, if this is a `", stringify!($variant), "` buffer.")]
        pub fn $as(&self) -> Option<&[$ty]> {
            <$ty as Element>::slice(self)
        }
        #[doc = concat!("The `Vec`, if this is a `", stringify!($variant), "` buffer; otherwise the buffer back.")]
        pub fn $into(self) -> Result<Vec<$ty>, Buffer> {
            match self {
                Buffer::$variant(v) => Ok(v),
                other => Err(other),
            }
        }
    };
}

impl Buffer {
    /// `len` zeros of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        Buffer::full(dtype, len, 0.0)
    }

    /// `len` copies of `v` converted to `dtype` (as [`Element::from_f64`]).
    pub fn full(dtype: DType, len: usize, v: f64) -> Buffer {
        fn of<T: Element>(len: usize, v: f64) -> Buffer {
            T::wrap(vec![T::from_f64(v); len])
        }
        match dtype {
            DType::F32 => of::<f32>(len, v),
            DType::F64 => of::<f64>(len, v),
            DType::F16 => of::<f16>(len, v),
            DType::BF16 => of::<bf16>(len, v),
            DType::I64 => of::<i64>(len, v),
            DType::U8 => of::<u8>(len, v),
            DType::I8 => of::<i8>(len, v),
        }
    }

    /// `dtype` values from f64s, each converted as [`Element::from_f64`].
    pub fn from_f64_vec(v: Vec<f64>, dtype: DType) -> Buffer {
        fn of<T: Element>(v: Vec<f64>) -> Buffer {
            T::wrap(v.into_iter().map(T::from_f64).collect())
        }
        match dtype {
            DType::F64 => Buffer::F64(v),
            DType::F32 => of::<f32>(v),
            DType::F16 => of::<f16>(v),
            DType::BF16 => of::<bf16>(v),
            DType::I64 => of::<i64>(v),
            DType::U8 => of::<u8>(v),
            DType::I8 => of::<i8>(v),
        }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F64(_) => DType::F64,
            Buffer::F16(_) => DType::F16,
            Buffer::BF16(_) => DType::BF16,
            Buffer::I64(_) => DType::I64,
            Buffer::U8(_) => DType::U8,
            Buffer::I8(_) => DType::I8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        each!(self, v => v.len())
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the elements in bytes.
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// Address of the first element (for checking that a collective handed back the same
    /// allocation).
    pub fn as_ptr(&self) -> *const u8 {
        each!(self, v => v.as_ptr().cast())
    }

    /// Raw mutable pointer to the first element, for code that shares the buffer with peers
    /// for the duration of one collective.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        each!(self, v => v.as_mut_ptr().cast())
    }

    /// Resizes to `len` elements, padding with zeros.
    pub fn resize(&mut self, len: usize) {
        each!(self, v => v.resize(len, Default::default()))
    }

    /// Keeps the first `len` elements (the allocation stays).
    pub fn truncate(&mut self, len: usize) {
        each!(self, v => v.truncate(len))
    }

    /// Gives spare capacity back to the allocator.
    pub fn shrink_to_fit(&mut self) {
        each!(self, v => v.shrink_to_fit())
    }

    /// Copies elements `src..src+count` to `dst..dst+count` (ranges may overlap).
    pub fn copy_within(&mut self, src: usize, count: usize, dst: usize) {
        each!(self, v => v.copy_within(src..src + count, dst))
    }

    accessors!(F32, f32, as_f32, into_f32);
    accessors!(F64, f64, as_f64, into_f64);
    accessors!(F16, f16, as_f16, into_f16);
    accessors!(BF16, bf16, as_bf16, into_bf16);
    accessors!(I64, i64, as_i64, into_i64);
    accessors!(U8, u8, as_u8, into_u8);
    accessors!(I8, i8, as_i8, into_i8);

    /// The elements' little-endian bytes, in order.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            Buffer::U8(v) => v.clone(),
            Buffer::I8(v) => v.iter().map(|&x| x as u8).collect(),
            b => each!(b, v => v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        }
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

    #[test]
    fn the_i8_cast_rounds_half_to_even_and_saturates_at_127() {
        let got: Vec<i8> = [0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.4, 200.0, -127.6, -1e9, f64::NAN]
            .into_iter()
            .map(quantize_i8)
            .collect();
        assert_eq!(got, [0, 2, 2, 0, -2, 126, 127, 127, -127, -127, 0]);
        let s = Buffer::from_f64_vec(vec![-3.0, 250.0, 2.5], DType::I8);
        assert_eq!(s, Buffer::I8(vec![-3, 127, 2]));
    }

    #[test]
    fn a_buffer_hands_its_vector_back_without_a_copy() {
        let v = vec![1.5f32, -2.0];
        let at = v.as_ptr();
        let b = Buffer::from(v);
        assert_eq!((b.dtype(), b.len(), b.byte_len()), (DType::F32, 2, 8));
        assert_eq!(b.as_ptr(), at.cast());
        assert!(f64::unwrap(b.clone()).is_none());
        let back = b.into_f32().unwrap();
        assert_eq!(back.as_ptr(), at);
        for d in DType::ALL {
            let z = Buffer::full(d, 3, 1.0);
            assert_eq!((z.dtype(), z.len()), (d, 3));
            assert_eq!(z.to_le_bytes().len(), 3 * d.size_in_bytes());
        }
    }
}
