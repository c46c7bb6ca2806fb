//! Device buffers of each element type, and the trait that lets one generic launch
//! wrapper serve them all.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use crate::DType;

/// One device allocation of one element type.
#[derive(Debug)]
pub(crate) enum CudaBuffer {
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
    /// Signed bytes (quantized payloads).
    I8(CudaSlice<i8>),
}

/// Runs `$e` with `$s` bound to the buffer's slice, whatever its element type.
macro_rules! with_slice {
    ($b:expr, $s:ident => $e:expr) => {
        match $b {
            $crate::cuda::element::CudaBuffer::F32($s) => $e,
            $crate::cuda::element::CudaBuffer::F64($s) => $e,
            $crate::cuda::element::CudaBuffer::F16($s) => $e,
            $crate::cuda::element::CudaBuffer::BF16($s) => $e,
            $crate::cuda::element::CudaBuffer::I64($s) => $e,
            $crate::cuda::element::CudaBuffer::U8($s) => $e,
            $crate::cuda::element::CudaBuffer::I8($s) => $e,
        }
    };
}
pub(crate) use with_slice;

/// A Rust element type with a device buffer variant and a kernel-name suffix.
pub(crate) trait CudaElement: DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + 'static {
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
cuda_element!(i8, I8, "i8");

/// A float type Brigade's kernels take: f32 and f64 compute in themselves, f16 and bf16 are
/// stored in 16 bits and computed in f32 (each output rounded once).
pub(crate) trait CudaFloat: CudaElement {
    /// The type the kernels compute in and take their scalars in.
    type Scalar: CudaElement;
    /// Rounds an f64 scalar to [`CudaFloat::Scalar`].
    fn scalar(x: f64) -> Self::Scalar;
    /// Rounds an f64 to an element of this type, through f32 for 16-bit types (as the CPU's
    /// 16-bit kernels round their f32 outputs).
    fn element(x: f64) -> Self;
}

impl CudaFloat for f32 {
    type Scalar = f32;
    fn scalar(x: f64) -> f32 {
        x as f32
    }
    fn element(x: f64) -> f32 {
        x as f32
    }
}

impl CudaFloat for f64 {
    type Scalar = f64;
    fn scalar(x: f64) -> f64 {
        x
    }
    fn element(x: f64) -> f64 {
        x
    }
}

impl CudaFloat for f16 {
    type Scalar = f32;
    fn scalar(x: f64) -> f32 {
        x as f32
    }
    fn element(x: f64) -> f16 {
        f16::from_f32(x as f32)
    }
}

impl CudaFloat for bf16 {
    type Scalar = f32;
    fn scalar(x: f64) -> f32 {
        x as f32
    }
    fn element(x: f64) -> bf16 {
        bf16::from_f32(x as f32)
    }
}
