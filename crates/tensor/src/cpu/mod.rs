//! The CPU backend: host buffers ([`Buffer`]) and the kernels of the device contract
//! ([`crate::backend`]). GEMM goes through oneDNN where it loads, the `gemm` crate otherwise
//! (`onednn.rs`); large elementwise and row kernels split across the calling thread's compute
//! pool ([`crate::set_compute_threads`]).
//! Each file is one family of kernels.

mod attention;
mod elementwise;
mod f16_storage;
mod gelu_f32;
mod indexing;
mod inplace;
mod matmul;
mod nn;
mod onednn;
mod reduce;
mod softmax_row;

pub use matmul::gemm_threads_for;
pub use onednn::{cpu_gemm, cpu_gemm_name, set_cpu_gemm, CpuGemm};

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{event_of, BackendEvent, BackendStorage, BackendStream};
use crate::scope::ScopedStream;
use crate::{Buffer, DType, Device, Element, Layout, Result, TensorError};

/// Runs `$body` with `$v` bound to the storage's elements and `$T` to their Rust type,
/// for the types kernels compute in (f32, f64); 16-bit float storage is widened before it
/// reaches a kernel body (`f16_storage.rs`).
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

/// The CPU's one stream: the calling thread, where work is done when the call returns.
struct HostStream;

/// An event of the CPU: complete when recorded; the instant it was recorded.
struct HostEvent(Instant);

impl BackendStream for HostStream {
    fn scoped(&self) -> ScopedStream {
        Arc::new(())
    }

    fn record(&self) -> Result<Arc<dyn BackendEvent>> {
        Ok(Arc::new(HostEvent(Instant::now())))
    }

    fn wait(&self, event: &dyn BackendEvent) -> Result<()> {
        event_of::<HostEvent>("wait_event", event).map(|_| ())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn spin(&self, duration: Duration) -> Result<()> {
        std::thread::sleep(duration);
        Ok(())
    }

    fn raw(&self) -> u64 {
        0
    }
}

impl BackendEvent for HostEvent {
    fn is_complete(&self) -> Result<bool> {
        Ok(true)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn elapsed_ms(&self, end: &dyn BackendEvent) -> Result<f64> {
        Ok(signed_ms(self.0, event_of::<HostEvent>("elapsed_ms", end)?.0))
    }

    fn raw(&self) -> u64 {
        0
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Milliseconds from `a` to `b`, negative when `b` came first.
pub(crate) fn signed_ms(a: Instant, b: Instant) -> f64 {
    if b >= a {
        (b - a).as_secs_f64() * 1e3
    } else {
        -((a - b).as_secs_f64() * 1e3)
    }
}

/// The CPU's storage is the host buffer itself; its kernels are in this folder, one family per
/// file.
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

    fn zeros_on(_ordinal: usize, dtype: DType, n: usize) -> Result<Self> {
        Ok(Buffer::zeros(dtype, n))
    }

    fn upload(_ordinal: usize, data: Buffer) -> Result<Self> {
        Ok(data)
    }

    fn lend_raw(&self) -> Result<u64> {
        Err(TensorError::Invalid {
            op: "device_memory",
            msg: "host memory has no device handle (lend a CPU storage with into_buffer)".into(),
        })
    }

    fn compute_stream(_ordinal: usize) -> Result<Arc<dyn BackendStream>> {
        Ok(Arc::new(HostStream))
    }

    fn new_stream(_ordinal: usize) -> Result<Arc<dyn BackendStream>> {
        Ok(Arc::new(HostStream))
    }

    fn scoped_stream(_entered: &ScopedStream) -> Option<Arc<dyn BackendStream>> {
        Some(Arc::new(HostStream))
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
        // f32 to and from 16 bits directly, a contiguous view sixteen elements an instruction
        // (`brigade_dtype::convert`): `half`'s f64 -> bf16 drops the low 32 bits before
        // rounding, so a value just above a tie would round down through f64 (as PyTorch and
        // the collectives' kernels, which round from f32, never do).
        use brigade_dtype::convert;
        match (self, dtype) {
            (Buffer::F32(d), DType::BF16) => {
                return Ok(Buffer::BF16(if layout.is_contiguous() {
                    convert::to_bf16_vec(view(d, layout))
                } else {
                    convert::to_bf16_vec(&gather::<f32>(self, layout, "to_dtype")?)
                }));
            }
            (Buffer::F32(d), DType::F16) => {
                return Ok(Buffer::F16(if layout.is_contiguous() {
                    convert::to_f16_vec(view(d, layout))
                } else {
                    convert::to_f16_vec(&gather::<f32>(self, layout, "to_dtype")?)
                }));
            }
            (Buffer::BF16(_) | Buffer::F16(_), DType::F32) => {
                return Ok(f16_storage::widen(self, layout).0.into_owned());
            }
            _ => {}
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
