//! Typed flat buffers that collectives move, and the reduction operators.

use std::fmt;

use half::{bf16, f16};

/// Element type of a [`Buffer`]: Brigade's one [`DType`] (a tensor's storage names its
/// elements with the same type). Buffers hold `F32`, `F16`, `BF16` (reduced with f32
/// accumulation), and the integer payloads `U8` (raw bytes) and `I8` (quantized values).
///
/// **Integer payloads are never reduced in their own type**: a sum of `k` int8 values needs
/// more than 8 bits, and each rank's values mean something only with that rank's scale. They
/// move with broadcast and all-gather; an all-reduce or reduce-scatter of one returns
/// [`crate::CommError::Unsupported`]. The rule for a quantizing policy is PyTorch's
/// (`quantization_pertensor_hook`): all-gather every rank's payload **and** its scales (one
/// collective: [`crate::all_gather_with_side`]), then dequantize each rank's piece with its own
/// scales and sum in f32 on every rank, in rank order.
pub use brigade_dtype::DType;

/// How a reduction combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks, accumulated in f32 in rank order (rank 0 first).
    Sum,
    /// Sum (as above) divided by the world size.
    Avg,
    /// Element-wise maximum; a NaN on any rank makes the result NaN, as `torch.max` and
    /// `torch.distributed`'s `MAX` do (see `nan_max`), so a diverged rank is never hidden.
    Max,
}

/// The maximum of `a` and `b`, NaN when either is NaN (unlike `f32::max`, which drops it).
/// Both backends reduce `Max` with this, so they agree whatever the order of the ranks.
pub(crate) fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        })
    }
}

/// A flat typed buffer handed to a collective by value and handed back by
/// [`crate::Work::wait`]: the same `Vec`, never a copy, so the caller regains its allocation.
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// Bytes (e.g. serialized parameter signatures compared across ranks).
    U8(Vec<u8>),
    /// Signed bytes: quantized payloads (moved, never reduced: see [`DType`]).
    I8(Vec<i8>),
}

macro_rules! accessors {
    ($variant:ident, $ty:ty, $as:ident, $into:ident) => {
        #[doc = concat!("The elements, if this is a `", stringify!($variant), "` buffer.")]
        pub fn $as(&self) -> Option<&[$ty]> {
            match self {
                Buffer::$variant(v) => Some(v),
                _ => None,
            }
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
    /// A buffer of `len` zeros of type `dtype`, or `None` for a type buffers do not hold
    /// (`F64`, `I64`, `I8`).
    pub fn zeros(dtype: DType, len: usize) -> Option<Buffer> {
        Some(match dtype {
            DType::F32 => Buffer::F32(vec![0.0; len]),
            DType::F16 => Buffer::F16(vec![f16::ZERO; len]),
            DType::BF16 => Buffer::BF16(vec![bf16::ZERO; len]),
            DType::U8 => Buffer::U8(vec![0; len]),
            DType::I8 => Buffer::I8(vec![0; len]),
            DType::F64 | DType::I64 => return None,
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::F16(v) => v.len(),
            Buffer::BF16(v) => v.len(),
            Buffer::U8(v) => v.len(),
            Buffer::I8(v) => v.len(),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F16(_) => DType::F16,
            Buffer::BF16(_) => DType::BF16,
            Buffer::U8(_) => DType::U8,
            Buffer::I8(_) => DType::I8,
        }
    }

    /// Size of the elements in bytes.
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// Address of the first element (for checking that a collective handed back the same
    /// allocation).
    pub fn as_ptr(&self) -> *const u8 {
        match self {
            Buffer::F32(v) => v.as_ptr().cast(),
            Buffer::F16(v) => v.as_ptr().cast(),
            Buffer::BF16(v) => v.as_ptr().cast(),
            Buffer::U8(v) => v.as_ptr(),
            Buffer::I8(v) => v.as_ptr().cast(),
        }
    }

    /// Raw mutable pointer to the first element, for backends that share the buffer with
    /// peers for the duration of one collective.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Buffer::F32(v) => v.as_mut_ptr().cast(),
            Buffer::F16(v) => v.as_mut_ptr().cast(),
            Buffer::BF16(v) => v.as_mut_ptr().cast(),
            Buffer::U8(v) => v.as_mut_ptr(),
            Buffer::I8(v) => v.as_mut_ptr().cast(),
        }
    }

    /// Resizes to `len` elements, padding with zeros.
    pub(crate) fn resize(&mut self, len: usize) {
        match self {
            Buffer::F32(v) => v.resize(len, 0.0),
            Buffer::F16(v) => v.resize(len, f16::ZERO),
            Buffer::BF16(v) => v.resize(len, bf16::ZERO),
            Buffer::U8(v) => v.resize(len, 0),
            Buffer::I8(v) => v.resize(len, 0),
        }
    }

    /// Copies elements `src..src+count` to `dst..dst+count` (ranges may overlap).
    pub(crate) fn copy_within(&mut self, src: usize, count: usize, dst: usize) {
        match self {
            Buffer::F32(v) => v.copy_within(src..src + count, dst),
            Buffer::F16(v) => v.copy_within(src..src + count, dst),
            Buffer::BF16(v) => v.copy_within(src..src + count, dst),
            Buffer::U8(v) => v.copy_within(src..src + count, dst),
            Buffer::I8(v) => v.copy_within(src..src + count, dst),
        }
    }

    accessors!(F32, f32, as_f32, into_f32);
    accessors!(F16, f16, as_f16, into_f16);
    accessors!(BF16, bf16, as_bf16, into_bf16);
    accessors!(U8, u8, as_u8, into_u8);
    accessors!(I8, i8, as_i8, into_i8);

    /// The elements' little-endian bytes, in order (how a side buffer travels packed beside its
    /// payload in [`crate::all_gather_with_side`]).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            Buffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Buffer::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Buffer::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Buffer::U8(v) => v.clone(),
            Buffer::I8(v) => v.iter().map(|&x| x as u8).collect(),
        }
    }

    /// A buffer of `dtype` from little-endian bytes (a whole number of elements), or `None` for
    /// a type buffers do not hold or a length that is not a multiple of the element size.
    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Option<Buffer> {
        let size = dtype.size_in_bytes();
        if bytes.len() % size != 0 {
            return None;
        }
        Some(match dtype {
            DType::F32 => Buffer::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::F16 => Buffer::F16(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            DType::BF16 => Buffer::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            DType::U8 => Buffer::U8(bytes.to_vec()),
            DType::I8 => Buffer::I8(bytes.iter().map(|&b| b as i8).collect()),
            DType::F64 | DType::I64 => return None,
        })
    }
}

impl From<Vec<f32>> for Buffer {
    fn from(v: Vec<f32>) -> Self {
        Buffer::F32(v)
    }
}

impl From<Vec<f16>> for Buffer {
    fn from(v: Vec<f16>) -> Self {
        Buffer::F16(v)
    }
}

impl From<Vec<bf16>> for Buffer {
    fn from(v: Vec<bf16>) -> Self {
        Buffer::BF16(v)
    }
}

impl From<Vec<u8>> for Buffer {
    fn from(v: Vec<u8>) -> Self {
        Buffer::U8(v)
    }
}

impl From<Vec<i8>> for Buffer {
    fn from(v: Vec<i8>) -> Self {
        Buffer::I8(v)
    }
}
