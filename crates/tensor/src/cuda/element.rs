//! Device buffers of each element type, and the trait that lets one generic launch
//! wrapper serve them all.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use crate::DType;

/// One device allocation of one element type.
#[derive(Debug)]
pub enum CudaBuffer {
    /// f32 elements.
    F32(CudaSlice<f32>),
    /// f64 elements.
    F64(CudaSlice<f64>),
    /// IEEE half-precision elements.
    F16(CudaSlice<f16>),
    /// bfloat16 elements.
    BF16(CudaSlice<bf16>),
    /// i64 elements (token ids, class labels).
    I64(CudaSlice<i64>),
    /// Bytes.
    U8(CudaSlice<u8>),
}

impl CudaBuffer {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            CudaBuffer::F32(_) => DType::F32,
            CudaBuffer::F64(_) => DType::F64,
            CudaBuffer::F16(_) => DType::F16,
            CudaBuffer::BF16(_) => DType::BF16,
            CudaBuffer::I64(_) => DType::I64,
            CudaBuffer::U8(_) => DType::U8,
        }
    }
}

/// A Rust element type with a device buffer variant and a kernel-name suffix.
pub trait CudaElement: DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + 'static {
    /// The matching dtype.
    const DTYPE: DType;
    /// The suffix of this type's kernels (`"f32"`, `"i64"`, ...).
    const SUFFIX: &'static str;
    /// Borrows the buffer if it holds this type.
    fn slice(b: &CudaBuffer) -> Option<&CudaSlice<Self>>;
    /// Borrows the buffer mutably if it holds this type.
    fn slice_mut(b: &mut CudaBuffer) -> Option<&mut CudaSlice<Self>>;
    /// Wraps a slice of this type.
    fn wrap(s: CudaSlice<Self>) -> CudaBuffer;
}

macro_rules! cuda_element {
    ($t:ty, $variant:ident, $suffix:literal) => {
        impl CudaElement for $t {
            const DTYPE: DType = DType::$variant;
            const SUFFIX: &'static str = $suffix;
            fn slice(b: &CudaBuffer) -> Option<&CudaSlice<Self>> {
                match b {
                    CudaBuffer::$variant(s) => Some(s),
                    _ => None,
                }
            }
            fn slice_mut(b: &mut CudaBuffer) -> Option<&mut CudaSlice<Self>> {
                match b {
                    CudaBuffer::$variant(s) => Some(s),
                    _ => None,
                }
            }
            fn wrap(s: CudaSlice<Self>) -> CudaBuffer {
                CudaBuffer::$variant(s)
            }
        }
    };
}

cuda_element!(f32, F32, "f32");
cuda_element!(f64, F64, "f64");
cuda_element!(f16, F16, "f16");
cuda_element!(bf16, BF16, "bf16");
cuda_element!(i64, I64, "i64");
cuda_element!(u8, U8, "u8");

/// A float type Brigade's kernels compute in (f32, f64).
pub trait CudaFloat: CudaElement {
    /// Rounds an f64 to this type.
    fn from_f64(x: f64) -> Self;
}

impl CudaFloat for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl CudaFloat for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
}
