//! Flat element buffers on some device, and the dispatch from an op to the backend that
//! holds its operands.

use std::sync::Arc;

use half::{bf16, f16};

use crate::backend::{AdamWScalars, BackendDevice, BackendStorage, BinaryOp, ReduceOp, SgdScalars, UnaryOp};
use crate::cpu::CpuDevice;
use crate::cuda::{CudaDevice, CudaStorage};
use crate::{DType, Device, Element, Layout, Result, TensorError};

/// A tensor's backing memory on the host: one flat vector of one element type. Only this
/// crate sees it (the CPU backend's storage); other crates copy explicitly.
#[derive(Debug, Clone, PartialEq)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    I8(Vec<i8>),
}

impl CpuStorage {
    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
            CpuStorage::I8(_) => DType::I8,
        }
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
            CpuStorage::U8(v) => v.len(),
            CpuStorage::I8(v) => v.len(),
        }
    }

    /// A zero-filled storage.
    pub(crate) fn zeros(dtype: DType, n: usize) -> Self {
        Self::full(dtype, n, 0.0)
    }

    /// `n` copies of `v` converted to `dtype`.
    pub(crate) fn full(dtype: DType, n: usize, v: f64) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![v as f32; n]),
            DType::F64 => CpuStorage::F64(vec![v; n]),
            DType::F16 => CpuStorage::F16(vec![f16::from_f64(v); n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::from_f64(v); n]),
            DType::I64 => CpuStorage::I64(vec![v as i64; n]),
            DType::U8 => CpuStorage::U8(vec![v as u8; n]),
            DType::I8 => CpuStorage::I8(vec![<i8 as Element>::from_f64(v); n]),
        }
    }

    /// `dtype` values from f64s (rounded as the type requires).
    pub(crate) fn from_f64_vec(v: Vec<f64>, dtype: DType) -> Self {
        match dtype {
            DType::F64 => CpuStorage::F64(v),
            DType::F32 => CpuStorage::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F16 => CpuStorage::F16(v.iter().map(|&x| f16::from_f64(x)).collect()),
            DType::BF16 => CpuStorage::BF16(v.iter().map(|&x| bf16::from_f64(x)).collect()),
            DType::I64 => CpuStorage::I64(v.iter().map(|&x| x as i64).collect()),
            DType::U8 => CpuStorage::U8(v.iter().map(|&x| x as u8).collect()),
            DType::I8 => CpuStorage::I8(v.iter().map(|&x| <i8 as Element>::from_f64(x)).collect()),
        }
    }
}

/// Storage on one device: the enum every op dispatches on, one variant per backend. Not
/// `Clone`: copying CUDA memory can fail, so a copy is the explicit, fallible
/// [`DeviceStorage::copy_strided`].
#[derive(Debug)]
pub(crate) enum DeviceStorage {
    /// Host memory, CPU kernels.
    Cpu(CpuStorage),
    /// Memory on one CUDA device, cuBLAS and NVRTC kernels (`crate::cuda`).
    Cuda(CudaStorage),
}

impl From<CpuStorage> for DeviceStorage {
    fn from(s: CpuStorage) -> Self {
        DeviceStorage::Cpu(s)
    }
}

impl From<CudaStorage> for DeviceStorage {
    fn from(s: CudaStorage) -> Self {
        DeviceStorage::Cuda(s)
    }
}

/// Runs `$e` with `$x` bound to the backend storage inside `$s`, and `$other` /
/// `$other_mut` bound to functions that take the same backend's storage out of another
/// `DeviceStorage` operand (a `DeviceMismatch` error if it lives elsewhere).
macro_rules! on_backend {
    ($s:expr, $x:ident, $other:ident, $other_mut:ident => $e:expr) => {{
        #[allow(unused_variables)]
        match $s {
            DeviceStorage::Cpu($x) => {
                let ($other, $other_mut) = (DeviceStorage::cpu, DeviceStorage::cpu_mut);
                $e
            }
            DeviceStorage::Cuda($x) => {
                let ($other, $other_mut) = (DeviceStorage::cuda, DeviceStorage::cuda_mut);
                $e
            }
        }
    }};
}

fn mismatch(found: Device, want: Device) -> TensorError {
    TensorError::DeviceMismatch {
        op: "backend dispatch",
        lhs: want,
        rhs: found,
    }
}

impl DeviceStorage {
    /// The CPU storage of an operand that must live on the CPU.
    fn cpu(&self) -> Result<&CpuStorage> {
        match self {
            DeviceStorage::Cpu(s) => Ok(s),
            s => Err(mismatch(s.device(), Device::Cpu)),
        }
    }

    /// The CPU storage of an operand that must live on the CPU, for writing.
    fn cpu_mut(&mut self) -> Result<&mut CpuStorage> {
        match self {
            DeviceStorage::Cpu(s) => Ok(s),
            s => Err(mismatch(s.device(), Device::Cpu)),
        }
    }

    /// The CUDA storage of an operand that must live on the same CUDA device as `self`'s
    /// first operand (the device itself is compared by the kernels' callers).
    fn cuda(&self) -> Result<&CudaStorage> {
        match self {
            DeviceStorage::Cuda(s) => Ok(s),
            s => Err(mismatch(s.device(), Device::Cuda(0))),
        }
    }

    /// The CUDA storage of an operand that must live on a CUDA device, for writing.
    fn cuda_mut(&mut self) -> Result<&mut CudaStorage> {
        match self {
            DeviceStorage::Cuda(s) => Ok(s),
            s => Err(mismatch(s.device(), Device::Cuda(0))),
        }
    }

    /// `n` zeros of `dtype` on `device`: the allocate half of the contract. A CUDA device
    /// is opened (and probed) on first use: a missing driver, library or GPU is a typed
    /// `DeviceUnavailable` naming what is missing.
    pub(crate) fn zeros(device: Device, dtype: DType, n: usize) -> Result<DeviceStorage> {
        match device {
            Device::Cpu => CpuDevice.zeros(dtype, n).map(Into::into),
            Device::Cuda(i) => CudaDevice::get(i)?.zeros(dtype, n).map(Into::into),
        }
    }

    /// Copy in: host data onto `device` (no copy for the CPU).
    pub(crate) fn from_cpu(device: Device, data: CpuStorage) -> Result<DeviceStorage> {
        match device {
            Device::Cpu => Ok(DeviceStorage::Cpu(data)),
            Device::Cuda(i) => CudaDevice::get(i)?.storage_from_cpu(&data).map(Into::into),
        }
    }

    /// The device the memory lives on.
    pub(crate) fn device(&self) -> Device {
        on_backend!(self, s, other, other_mut => BackendStorage::device(s))
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        on_backend!(self, s, other, other_mut => BackendStorage::dtype(s))
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        on_backend!(self, s, other, other_mut => BackendStorage::len(s))
    }

    /// A zero-length storage of the same dtype and device.
    pub(crate) fn empty_like(&self) -> DeviceStorage {
        on_backend!(self, s, other, other_mut => s.empty_like().into())
    }

    /// The elements of the view, row-major, in host memory: one gather on the CPU, a
    /// device-side gather and one copy out elsewhere.
    pub(crate) fn to_host_vec<T: Element>(&self, layout: &Layout, op: &'static str) -> Result<Vec<T>> {
        match self {
            DeviceStorage::Cpu(s) => crate::cpu::gather::<T>(s, layout, op),
            DeviceStorage::Cuda(s) => {
                let host = s.copy_strided(layout)?.to_cpu()?;
                let dtype = host.dtype();
                T::unwrap(host).ok_or(TensorError::DTypeMismatch {
                    op,
                    lhs: dtype,
                    rhs: T::DTYPE,
                })
            }
        }
    }

    /// Copy out of the whole storage into host memory.
    pub(crate) fn to_cpu(&self) -> Result<CpuStorage> {
        on_backend!(self, s, other, other_mut => s.to_cpu())
    }

    /// See [`BackendStorage::copy_strided`].
    pub(crate) fn copy_strided(&self, layout: &Layout) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.copy_strided(layout).map(Into::into))
    }

    /// See [`BackendStorage::to_dtype`].
    pub(crate) fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.to_dtype(layout, dtype).map(Into::into))
    }

    /// See [`BackendStorage::unary`].
    pub(crate) fn unary(&self, layout: &Layout, op: UnaryOp) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.unary(layout, op).map(Into::into))
    }

    /// See [`BackendStorage::binary`].
    pub(crate) fn binary(&self, l: &Layout, rhs: &DeviceStorage, rl: &Layout, op: BinaryOp) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.binary(l, other(rhs)?, rl, op).map(Into::into))
    }

    /// See [`BackendStorage::reduce`].
    pub(crate) fn reduce(&self, layout: &Layout, dims: &[usize], op: ReduceOp) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => BackendStorage::reduce(s, layout, dims, op).map(Into::into))
    }

    /// See [`BackendStorage::matmul`].
    pub(crate) fn matmul(&self, l: &Layout, rhs: &DeviceStorage, rl: &Layout) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.matmul(l, other(rhs)?, rl).map(Into::into))
    }

    /// See [`BackendStorage::matmul_bias`].
    pub(crate) fn matmul_bias(
        &self,
        l: &Layout,
        rhs: &DeviceStorage,
        rl: &Layout,
        bias: (&DeviceStorage, &Layout),
    ) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.matmul_bias(l, other(rhs)?, rl, (other(bias.0)?, bias.1)).map(Into::into))
    }

    /// See [`BackendStorage::softmax_last`].
    pub(crate) fn softmax_last(&self, layout: &Layout, log: bool) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.softmax_last(layout, log).map(Into::into))
    }

    /// See [`BackendStorage::softmax_backward`].
    pub(crate) fn softmax_backward(
        &self,
        l: &Layout,
        g: &DeviceStorage,
        gl: &Layout,
        log: bool,
    ) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.softmax_backward(l, other(g)?, gl, log).map(Into::into))
    }

    /// See [`BackendStorage::layer_norm`].
    pub(crate) fn layer_norm(
        &self,
        l: &Layout,
        w: (&DeviceStorage, &Layout),
        b: (&DeviceStorage, &Layout),
        eps: f64,
    ) -> Result<(DeviceStorage, DeviceStorage, DeviceStorage)> {
        on_backend!(self, s, other, other_mut => {
            let (y, mean, rstd) = s.layer_norm(l, (other(w.0)?, w.1), (other(b.0)?, b.1), eps)?;
            Ok((y.into(), mean.into(), rstd.into()))
        })
    }

    /// See [`BackendStorage::layer_norm_backward`].
    pub(crate) fn layer_norm_backward(
        &self,
        l: &Layout,
        w: (&DeviceStorage, &Layout),
        mean: (&DeviceStorage, &Layout),
        rstd: (&DeviceStorage, &Layout),
        gy: (&DeviceStorage, &Layout),
    ) -> Result<(DeviceStorage, DeviceStorage, DeviceStorage)> {
        on_backend!(self, s, other, other_mut => {
            let (dx, dw, db) = s.layer_norm_backward(
                l,
                (other(w.0)?, w.1),
                (other(mean.0)?, mean.1),
                (other(rstd.0)?, rstd.1),
                (other(gy.0)?, gy.1),
            )?;
            Ok((dx.into(), dw.into(), db.into()))
        })
    }

    /// See [`BackendStorage::embedding`].
    pub(crate) fn embedding(&self, l: &Layout, ids: (&DeviceStorage, &Layout)) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.embedding(l, (other(ids.0)?, ids.1)).map(Into::into))
    }

    /// See [`BackendStorage::embedding_backward`].
    pub(crate) fn embedding_backward(
        &self,
        l: &Layout,
        ids: (&DeviceStorage, &Layout),
        vocab: usize,
    ) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.embedding_backward(l, (other(ids.0)?, ids.1), vocab).map(Into::into))
    }

    /// See [`BackendStorage::causal_fill`].
    pub(crate) fn causal_fill(&self, l: &Layout, value: f64) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.causal_fill(l, value).map(Into::into))
    }

    /// See [`BackendStorage::causal_attention`].
    pub(crate) fn causal_attention(
        &self,
        l: &Layout,
        n_heads: usize,
        scale: f64,
    ) -> Result<(DeviceStorage, DeviceStorage)> {
        on_backend!(self, s, other, other_mut => {
            let (y, probs) = s.causal_attention(l, n_heads, scale)?;
            Ok((y.into(), probs.into()))
        })
    }

    /// See [`BackendStorage::causal_attention_backward`].
    pub(crate) fn causal_attention_backward(
        &self,
        l: &Layout,
        probs: (&DeviceStorage, &Layout),
        gy: (&DeviceStorage, &Layout),
        n_heads: usize,
        scale: f64,
    ) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s
            .causal_attention_backward(l, (other(probs.0)?, probs.1), (other(gy.0)?, gy.1), n_heads, scale)
            .map(Into::into))
    }

    /// See [`BackendStorage::cross_entropy`].
    pub(crate) fn cross_entropy(
        &self,
        l: &Layout,
        targets: (&DeviceStorage, &Layout),
    ) -> Result<(DeviceStorage, DeviceStorage)> {
        on_backend!(self, s, other, other_mut => {
            let (loss, probs) = s.cross_entropy(l, (other(targets.0)?, targets.1))?;
            Ok((loss.into(), probs.into()))
        })
    }

    /// See [`BackendStorage::cross_entropy_backward`].
    pub(crate) fn cross_entropy_backward(
        &self,
        l: &Layout,
        targets: (&DeviceStorage, &Layout),
        g: f64,
    ) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s.cross_entropy_backward(l, (other(targets.0)?, targets.1), g).map(Into::into))
    }

    /// See [`BackendStorage::fill`].
    pub(crate) fn fill(&mut self, l: &Layout, v: f64) -> Result<()> {
        on_backend!(self, s, other, other_mut => s.fill(l, v))
    }

    /// See [`BackendStorage::copy_from`].
    pub(crate) fn copy_from(&mut self, l: &Layout, src: (&DeviceStorage, &Layout)) -> Result<()> {
        on_backend!(self, s, other, other_mut => s.copy_from(l, (other(src.0)?, src.1)))
    }

    /// See [`BackendStorage::add_scaled_assign`].
    pub(crate) fn add_scaled_assign(&mut self, l: &Layout, src: (&DeviceStorage, &Layout), scale: f64) -> Result<()> {
        on_backend!(self, s, other, other_mut => s.add_scaled_assign(l, (other(src.0)?, src.1), scale))
    }

    /// See [`BackendStorage::sgd_step`].
    pub(crate) fn sgd_step(
        &mut self,
        l: &Layout,
        grad: (&DeviceStorage, &Layout),
        buf: Option<(&mut DeviceStorage, &Layout)>,
        sc: &SgdScalars,
    ) -> Result<()> {
        on_backend!(self, s, other, other_mut => {
            let buf = match buf {
                Some((b, bl)) => Some((other_mut(b)?, bl)),
                None => None,
            };
            BackendStorage::sgd_step(s, l, (other(grad.0)?, grad.1), buf, sc)
        })
    }

    /// See [`BackendStorage::adamw_step`].
    pub(crate) fn adamw_step(
        &mut self,
        l: &Layout,
        grad: (&DeviceStorage, &Layout),
        m: (&mut DeviceStorage, &Layout),
        v: (&mut DeviceStorage, &Layout),
        sc: &AdamWScalars,
    ) -> Result<()> {
        on_backend!(self, s, other, other_mut => {
            BackendStorage::adamw_step(s, l, (other(grad.0)?, grad.1), (other_mut(m.0)?, m.1), (other_mut(v.0)?, v.1), sc)
        })
    }
}

/// A tensor's memory on some device, as lent out by [`crate::Tensor::lend_storage`] and
/// given back with [`crate::Tensor::restore_storage`]. Opaque: other crates move its
/// elements to and from host vectors explicitly, without a copy when it lives on the CPU.
#[derive(Debug)]
pub struct Storage(pub(crate) DeviceStorage);

impl Storage {
    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        self.0.device()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as a host vector: the storage's own vector on the CPU (no copy), a
    /// copy out of device memory elsewhere (how a CUDA gradient bucket is staged through
    /// the host for a CPU all-reduce). `T` must be the storage's dtype.
    pub fn into_host_vec<T: Element>(self) -> Result<Vec<T>> {
        let dtype = self.dtype();
        let wrong = || TensorError::DTypeMismatch {
            op: "into_host_vec",
            lhs: dtype,
            rhs: T::DTYPE,
        };
        match self.0 {
            DeviceStorage::Cpu(s) => T::unwrap(s).ok_or_else(wrong),
            DeviceStorage::Cuda(s) => T::unwrap(s.to_cpu()?).ok_or_else(wrong),
        }
    }

    /// A storage on `device` holding `data`: the vector itself on the CPU (no copy), a
    /// copy into device memory elsewhere.
    pub fn from_host_vec<T: Element>(data: Vec<T>, device: Device) -> Result<Storage> {
        Ok(Storage(DeviceStorage::from_cpu(device, T::wrap(data))?))
    }
}

impl Storage {
    /// The f32 memory of a CUDA storage, moved out without a copy, with its device (for a
    /// collective on device memory such as NCCL's); a storage on the CPU comes back as the error.
    pub fn into_cuda_f32(self) -> std::result::Result<(cudarc::driver::CudaSlice<f32>, Arc<CudaDevice>), Storage> {
        match self.0 {
            DeviceStorage::Cuda(s) => {
                let dev = s.cuda_device().clone();
                match s.into_f32_slice() {
                    Ok(slice) => Ok((slice, dev)),
                    Err(_) => Err(Storage(DeviceStorage::Cuda(CudaStorage::empty(&dev, DType::F32)))),
                }
            }
            other => Err(Storage(other)),
        }
    }

    /// A storage holding f32 device memory of `dev` (the inverse of [`Storage::into_cuda_f32`]).
    pub fn from_cuda_f32(slice: cudarc::driver::CudaSlice<f32>, dev: &Arc<CudaDevice>) -> Storage {
        Storage(DeviceStorage::Cuda(CudaStorage::from_f32_slice(dev, slice)))
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Storage, Tensor, TensorError};

    #[test]
    fn a_lent_cpu_storage_moves_its_vector_out_and_back_without_a_copy() {
        let flat = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap();
        let before = match &*flat.read_guard_for_tests() {
            super::DeviceStorage::Cpu(super::CpuStorage::F32(v)) => v.as_ptr(),
            _ => unreachable!(),
        };
        let v = flat.lend_storage().unwrap().into_host_vec::<f32>().unwrap();
        assert_eq!(v.as_ptr(), before, "the host vector is the storage's own");
        let back = Storage::from_host_vec(v, Device::Cpu).unwrap();
        flat.restore_storage(back).unwrap();
        let after = match &*flat.read_guard_for_tests() {
            super::DeviceStorage::Cpu(super::CpuStorage::F32(v)) => v.as_ptr(),
            _ => unreachable!(),
        };
        assert_eq!(after, before);
        assert_eq!(flat.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        let wrong = flat.lend_storage().unwrap();
        assert!(matches!(
            wrong.into_host_vec::<f64>(),
            Err(TensorError::DTypeMismatch { .. })
        ));
    }

    #[test]
    fn asking_for_cuda_without_it_is_one_typed_error_naming_what_is_missing() {
        let missing = match crate::cuda::probe::require(0) {
            Err(missing) => missing,
            Ok(()) => {
                // A usable GPU: the device-wide op tests (test_device!) cover it instead.
                crate::testing::report_skip("storage::asking_for_cuda_without_it", &"cuda:0 is usable here");
                return;
            }
        };
        let e = Tensor::zeros(&[2], DType::F32).to_device(Device::Cuda(0)).unwrap_err();
        assert_eq!(e, missing.clone().on(Device::Cuda(0)));
        let text = e.to_string();
        assert!(text.starts_with("device cuda:0 is not available: "), "{text}");
        assert!(
            !text.contains("--device") && !text.contains("no CUDA backend"),
            "{text}"
        );
        if !crate::cuda::probe::driver_present() {
            assert!(text.contains("libcuda.so.1"), "{text}");
        }
        let e = Tensor::zeros_on(&[2], DType::F32, Device::Cuda(1)).unwrap_err();
        assert!(
            matches!(
                &e,
                TensorError::DeviceUnavailable {
                    device: Device::Cuda(1),
                    ..
                }
            ),
            "{e:?}"
        );
        let e = Storage::from_host_vec(vec![1.0f32], Device::Cuda(0)).unwrap_err();
        assert_eq!(e, missing.on(Device::Cuda(0)));
    }
}
