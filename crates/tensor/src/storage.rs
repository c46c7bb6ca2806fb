//! Flat element buffers on some device, and the dispatch from an op to the backend that
//! holds its operands.

use crate::backend::{AdamWScalars, BackendStorage, BinaryOp, ReduceOp, SgdScalars, UnaryOp};
#[cfg(feature = "cuda")]
use crate::cuda::CudaStorage;
use crate::fake::FakeStorage;
use crate::stream::{DeviceMemory, Stream};
use crate::{Buffer, DType, Device, Element, Layout, Result, TensorError};

/// Storage on one device: the enum every op dispatches on, one variant per backend. Not
/// `Clone`: copying CUDA memory can fail, so a copy is the explicit, fallible
/// [`DeviceStorage::copy_strided`].
#[derive(Debug)]
pub(crate) enum DeviceStorage {
    /// Host memory, CPU kernels.
    Cpu(Buffer),
    /// The counting fake device (`crate::fake`): host memory behind the contract (boxed, as
    /// CUDA's: a lent `Storage` moves by value and stays small).
    Fake(Box<FakeStorage>),
    /// Memory on one CUDA device, cuBLAS and NVRTC kernels (`crate::cuda`).
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaStorage>),
}

impl From<Buffer> for DeviceStorage {
    fn from(s: Buffer) -> Self {
        DeviceStorage::Cpu(s)
    }
}

impl From<FakeStorage> for DeviceStorage {
    fn from(s: FakeStorage) -> Self {
        DeviceStorage::Fake(Box::new(s))
    }
}

#[cfg(feature = "cuda")]
impl From<CudaStorage> for DeviceStorage {
    fn from(s: CudaStorage) -> Self {
        DeviceStorage::Cuda(Box::new(s))
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
            DeviceStorage::Fake($x) => {
                let ($other, $other_mut) = (DeviceStorage::fake, DeviceStorage::fake_mut);
                $e
            }
            #[cfg(feature = "cuda")]
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
    fn cpu(&self) -> Result<&Buffer> {
        match self {
            DeviceStorage::Cpu(s) => Ok(s),
            s => Err(mismatch(s.device(), Device::Cpu)),
        }
    }

    /// The CPU storage of an operand that must live on the CPU, for writing.
    fn cpu_mut(&mut self) -> Result<&mut Buffer> {
        match self {
            DeviceStorage::Cpu(s) => Ok(s),
            s => Err(mismatch(s.device(), Device::Cpu)),
        }
    }

    /// The fake-device storage of an operand that must live on the fake device.
    fn fake(&self) -> Result<&FakeStorage> {
        match self {
            DeviceStorage::Fake(s) => Ok(&**s),
            s => Err(mismatch(s.device(), Device::Fake(0))),
        }
    }

    /// The fake-device storage of an operand that must live on the fake device, for writing.
    fn fake_mut(&mut self) -> Result<&mut FakeStorage> {
        match self {
            DeviceStorage::Fake(s) => Ok(&mut **s),
            s => Err(mismatch(s.device(), Device::Fake(0))),
        }
    }

    /// The CUDA storage of an operand that must live on the same CUDA device as `self`'s
    /// first operand (the device itself is compared by the kernels' callers).
    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Result<&CudaStorage> {
        match self {
            DeviceStorage::Cuda(s) => Ok(&**s),
            s => Err(mismatch(s.device(), Device::Cuda(0))),
        }
    }

    /// The CUDA storage of an operand that must live on a CUDA device, for writing.
    #[cfg(feature = "cuda")]
    fn cuda_mut(&mut self) -> Result<&mut CudaStorage> {
        match self {
            DeviceStorage::Cuda(s) => Ok(&mut **s),
            s => Err(mismatch(s.device(), Device::Cuda(0))),
        }
    }

    /// `n` zeros of `dtype` on `device`: the allocate half of the contract. A CUDA device
    /// is opened (and probed) on first use: a missing driver, library or GPU is a typed
    /// `DeviceUnavailable` naming what is missing.
    pub(crate) fn zeros(device: Device, dtype: DType, n: usize) -> Result<DeviceStorage> {
        match device {
            Device::Cpu => Ok(Buffer::zeros(dtype, n).into()),
            Device::Fake(i) => FakeStorage::zeros(i, dtype, n).map(Into::into),
            #[cfg(feature = "cuda")]
            Device::Cuda(i) => CudaStorage::zeros(&crate::cuda::CudaDevice::get(i)?, dtype, n).map(Into::into),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(crate::cuda::probe::Unavailable::NotBuilt.on(device)),
        }
    }

    /// Copy in: host data onto `device` (no copy for the CPU).
    pub(crate) fn from_cpu(device: Device, data: Buffer) -> Result<DeviceStorage> {
        match device {
            Device::Cpu => Ok(DeviceStorage::Cpu(data)),
            Device::Fake(i) => Ok(FakeStorage::upload(i, data).into()),
            #[cfg(feature = "cuda")]
            Device::Cuda(i) => CudaStorage::from_cpu(&crate::cuda::CudaDevice::get(i)?, &data).map(Into::into),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(crate::cuda::probe::Unavailable::NotBuilt.on(device)),
        }
    }

    /// The device the memory lives on.
    pub(crate) fn device(&self) -> Device {
        on_backend!(self, s, other, other_mut => s.device())
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        on_backend!(self, s, other, other_mut => s.dtype())
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        on_backend!(self, s, other, other_mut => s.len())
    }

    /// A zero-length storage of the same dtype and device.
    pub(crate) fn empty_like(&self) -> DeviceStorage {
        on_backend!(self, s, other, other_mut => s.empty_like().into())
    }

    /// See [`BackendStorage::int_range`].
    pub(crate) fn int_range(&self) -> Option<(i64, i64)> {
        on_backend!(self, s, other, other_mut => s.int_range())
    }

    /// The elements of the view, row-major, in host memory: one gather on the CPU; on a
    /// device one copy out (after a device-side gather unless the view is the whole storage).
    pub(crate) fn to_host(&self, layout: &Layout) -> Result<Buffer> {
        fn out<S: BackendStorage>(s: &S, l: &Layout) -> Result<Buffer> {
            if l.is_contiguous() && l.offset() == 0 && l.numel() == s.len() {
                s.to_cpu()
            } else {
                s.copy_strided(l)?.into_cpu()
            }
        }
        match self {
            DeviceStorage::Cpu(s) => out(s, layout),
            DeviceStorage::Fake(s) => out(&**s, layout),
            #[cfg(feature = "cuda")]
            DeviceStorage::Cuda(s) => out(&**s, layout),
        }
    }

    /// Copy out of the whole storage into host memory.
    pub(crate) fn to_cpu(&self) -> Result<Buffer> {
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
        on_backend!(self, s, other, other_mut => s.reduce(layout, dims, op).map(Into::into))
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
        g: (&DeviceStorage, &Layout),
    ) -> Result<DeviceStorage> {
        on_backend!(self, s, other, other_mut => s
            .cross_entropy_backward(l, (other(targets.0)?, targets.1), (other(g.0)?, g.1))
            .map(Into::into))
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
            s.sgd_step(l, (other(grad.0)?, grad.1), buf, sc)
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
            s.adamw_step(l, (other(grad.0)?, grad.1), (other_mut(m.0)?, m.1), (other_mut(v.0)?, v.1), sc)
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

    /// The elements as a host buffer: the storage's own buffer on the CPU (no copy), a copy
    /// out of device memory elsewhere (how a device gradient bucket is staged through the host
    /// for a CPU all-reduce).
    pub fn into_buffer(self) -> Result<Buffer> {
        match self.0 {
            DeviceStorage::Cpu(s) => s.into_cpu(),
            DeviceStorage::Fake(s) => s.into_cpu(),
            #[cfg(feature = "cuda")]
            DeviceStorage::Cuda(s) => s.into_cpu(),
        }
    }

    /// The elements as a host vector of `T`, which must be the storage's dtype (as
    /// [`Storage::into_buffer`]).
    pub fn into_host_vec<T: Element>(self) -> Result<Vec<T>> {
        let dtype = self.dtype();
        T::unwrap(self.into_buffer()?).ok_or(TensorError::DTypeMismatch {
            op: "into_host_vec",
            lhs: dtype,
            rhs: T::DTYPE,
        })
    }

    /// A storage on `device` holding `data`: the buffer itself on the CPU (no copy), a copy
    /// into device memory elsewhere.
    pub fn from_buffer(data: Buffer, device: Device) -> Result<Storage> {
        Ok(Storage(DeviceStorage::from_cpu(device, data)?))
    }

    /// A storage on `device` holding `data` (as [`Storage::from_buffer`]).
    pub fn from_host_vec<T: Element>(data: Vec<T>, device: Device) -> Result<Storage> {
        Storage::from_buffer(T::wrap(data), device)
    }

    /// The raw handles of this device memory for code outside the tensor crate (a collective)
    /// that reads and writes it on `used_on`, a stream of the same device. The memory counts
    /// as used on that stream (the keep-alive rule of [`crate::Stream`]'s docs): the caller orders
    /// that use against the storage's other streams with events, and keeps the storage alive
    /// (e.g. lent out of its tensor) until the collective's done event was waited on. Host
    /// memory has no device handle: a CPU storage is an error.
    pub fn device_memory(&self, used_on: &Stream) -> Result<DeviceMemory> {
        if used_on.device() != self.device() {
            return Err(TensorError::DeviceMismatch {
                op: "device_memory",
                lhs: self.device(),
                rhs: used_on.device(),
            });
        }
        let ptr = match &self.0 {
            DeviceStorage::Cpu(_) => {
                return Err(TensorError::Invalid {
                    op: "device_memory",
                    msg: "host memory has no device handle (lend a CPU storage with into_host_vec)".into(),
                })
            }
            DeviceStorage::Fake(s) => used_on.scope(|| s.lend_raw())?,
            #[cfg(feature = "cuda")]
            DeviceStorage::Cuda(s) => used_on.scope(|| s.lend_raw())?,
        };
        Ok(DeviceMemory {
            ptr,
            len: self.len(),
            dtype: self.dtype(),
            device: self.device(),
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Storage, Tensor, TensorError};

    #[test]
    fn a_lent_cpu_storage_moves_its_vector_out_and_back_without_a_copy() {
        let flat = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap();
        let before = match &*flat.read_guard_for_tests() {
            super::DeviceStorage::Cpu(super::Buffer::F32(v)) => v.as_ptr(),
            _ => unreachable!(),
        };
        let v = flat.lend_storage().unwrap().into_host_vec::<f32>().unwrap();
        assert_eq!(v.as_ptr(), before, "the host vector is the storage's own");
        let back = Storage::from_host_vec(v, Device::Cpu).unwrap();
        flat.restore_storage(back).unwrap();
        let after = match &*flat.read_guard_for_tests() {
            super::DeviceStorage::Cpu(super::Buffer::F32(v)) => v.as_ptr(),
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
        assert!(!text.contains("--device"), "{text}");
        if cfg!(feature = "cuda") {
            assert!(!text.contains("no CUDA backend"), "{text}");
        } else {
            assert!(
                text.contains("no CUDA backend") && text.contains("`cuda` cargo feature"),
                "{text}"
            );
        }
        if cfg!(feature = "cuda") && !crate::cuda::probe::driver_present() {
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
