//! Where a tensor's memory lives: the [`Device`] every tensor carries and the storage enum every
//! op dispatches on, one variant per backend each, and the one dispatch from an op to the
//! backend that holds its operands ([`dispatch!`], and [`on_device!`] for what is
//! made on a device: allocations, copies in, streams).

use crate::backend::BackendStorage;
#[cfg(feature = "cuda")]
use crate::cuda::CudaStorage;
use crate::fake::FakeStorage;
use crate::{Buffer, DType, Element, Result, TensorError};

/// A compute device. Every tensor carries one; CPU kernels are built in, and a device
/// that this build or machine cannot serve answers with [`crate::TensorError::DeviceUnavailable`]
/// instead of panicking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, CPU kernels (GEMM through the `gemm` crate, the rest on rayon).
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
    /// The counting fake device with this ordinal (`brigade_tensor::fake`): host memory behind
    /// the device contract, for tests. It counts every host<->device transfer and host wait,
    /// refuses any host access that does not go through the contract, and checks that its
    /// streams are ordered by events, so the device logic of a training step is tested on the
    /// CPU. Each ordinal keeps its own counts.
    Fake(usize),
}

impl Device {
    /// True for [`Device::Cpu`].
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// True for memory the host cannot read directly (CUDA, and the fake device that stands
    /// in for it in tests): every read goes through a copy out.
    pub fn is_device(&self) -> bool {
        !self.is_cpu()
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Fake(i) => write!(f, "fake:{i}"),
        }
    }
}

/// Storage on one device: the enum every op dispatches on, one variant per backend. Not
/// `Clone`: copying CUDA memory can fail, so a copy is the explicit, fallible
/// [`BackendStorage::copy_strided`].
#[derive(Debug)]
pub(crate) enum DeviceStorage {
    /// Host memory, CPU kernels (`crate::cpu`).
    Cpu(Buffer),
    /// The counting fake device (`crate::fake`): host memory behind the contract (boxed, as
    /// CUDA's: a lent `Storage` moves by value and stays small).
    Fake(Box<FakeStorage>),
    /// Memory on one CUDA device, cuBLAS and NVRTC kernels (`crate::cuda`).
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaStorage>),
}

/// One backend's storage inside [`DeviceStorage`]: how it is wrapped, and how an op finds the
/// storage of its other operands (a `DeviceMismatch` error if one lives elsewhere).
pub(crate) trait Variant: BackendStorage {
    /// The device an operand of this backend is expected on, for the mismatch error.
    const WANT: Device;
    /// Wraps the storage.
    fn wrap(self) -> DeviceStorage;
    /// The storage of an operand that must be of this backend.
    fn of(s: &DeviceStorage) -> Result<&Self>;
    /// The storage of an operand that must be of this backend, for writing.
    fn of_mut(s: &mut DeviceStorage) -> Result<&mut Self>;
}

fn mismatch(found: Device, want: Device) -> TensorError {
    TensorError::DeviceMismatch {
        op: "backend dispatch",
        lhs: want,
        rhs: found,
    }
}

macro_rules! variant {
    ($ty:ty, $variant:ident, $want:expr, $wrap:expr) => {
        impl From<$ty> for DeviceStorage {
            fn from(s: $ty) -> DeviceStorage {
                s.wrap()
            }
        }

        impl Variant for $ty {
            const WANT: Device = $want;
            fn wrap(self) -> DeviceStorage {
                DeviceStorage::$variant(($wrap)(self))
            }
            fn of(s: &DeviceStorage) -> Result<&Self> {
                match s {
                    DeviceStorage::$variant(x) => Ok(x),
                    s => Err(mismatch(s.device(), Self::WANT)),
                }
            }
            fn of_mut(s: &mut DeviceStorage) -> Result<&mut Self> {
                match s {
                    DeviceStorage::$variant(x) => Ok(x),
                    s => Err(mismatch(s.device(), Self::WANT)),
                }
            }
        }
    };
}

variant!(Buffer, Cpu, Device::Cpu, |s| s);
variant!(FakeStorage, Fake, Device::Fake(0), Box::new);
#[cfg(feature = "cuda")]
variant!(CudaStorage, Cuda, Device::Cuda(0), Box::new);

/// A backend's result as [`dispatch!`] returns it: its storages wrapped as [`DeviceStorage`].
pub(crate) trait IntoDevice {
    /// The wrapped result.
    type Out;
    /// Wraps it.
    fn into_device(self) -> Self::Out;
}

impl<S: Variant> IntoDevice for S {
    type Out = DeviceStorage;
    fn into_device(self) -> DeviceStorage {
        self.wrap()
    }
}

impl<S: Variant> IntoDevice for (S, S) {
    type Out = (DeviceStorage, DeviceStorage);
    fn into_device(self) -> Self::Out {
        (self.0.wrap(), self.1.wrap())
    }
}

impl<S: Variant> IntoDevice for (S, S, S) {
    type Out = (DeviceStorage, DeviceStorage, DeviceStorage);
    fn into_device(self) -> Self::Out {
        (self.0.wrap(), self.1.wrap(), self.2.wrap())
    }
}

impl IntoDevice for () {
    type Out = ();
    fn into_device(self) {}
}

impl<T: IntoDevice> IntoDevice for Result<T> {
    type Out = Result<T::Out>;
    fn into_device(self) -> Self::Out {
        self.map(T::into_device)
    }
}

/// The one dispatch from an op to its backend: runs `$e` with `$s` bound to the backend storage
/// inside the [`DeviceStorage`] `$storage` (by reference, mutable reference or value, as
/// `$storage` is), `$other` / `$other_mut` bound to [`Variant::of`] / [`Variant::of_mut`] of
/// that backend (the storage of another operand), and the backend's storages in the result
/// wrapped back ([`IntoDevice`]). `dispatch!(plain ...)` returns the result as it is.
#[collapse_debuginfo(yes)]
macro_rules! dispatch {
    (plain $storage:expr, $s:ident => $e:expr) => {{
        #[allow(unused_imports)]
        use $crate::backend::{Attention as _, BackendStorage as _, Elementwise as _, InPlace as _, Indexing as _, Matmul as _, Nn as _, Reduce as _};
        match $storage {
            $crate::storage::DeviceStorage::Cpu($s) => $e,
            $crate::storage::DeviceStorage::Fake($s) => $e,
            #[cfg(feature = "cuda")]
            $crate::storage::DeviceStorage::Cuda($s) => $e,
        }
    }};
    ($storage:expr, $s:ident, $other:ident, $other_mut:ident => $e:expr) => {{
        #[allow(unused_imports)]
        use $crate::backend::{Attention as _, BackendStorage as _, Elementwise as _, InPlace as _, Indexing as _, Matmul as _, Nn as _, Reduce as _};
        #[allow(unused_imports)]
        use $crate::storage::Variant as _;
        #[allow(unused_variables)]
        match $storage {
            $crate::storage::DeviceStorage::Cpu($s) => {
                let ($other, $other_mut) = ($crate::Buffer::of, $crate::Buffer::of_mut);
                $crate::storage::IntoDevice::into_device($e)
            }
            $crate::storage::DeviceStorage::Fake($s) => {
                let ($other, $other_mut) = ($crate::fake::FakeStorage::of, $crate::fake::FakeStorage::of_mut);
                $crate::storage::IntoDevice::into_device($e)
            }
            #[cfg(feature = "cuda")]
            $crate::storage::DeviceStorage::Cuda($s) => {
                let ($other, $other_mut) = ($crate::cuda::CudaStorage::of, $crate::cuda::CudaStorage::of_mut);
                $crate::storage::IntoDevice::into_device($e)
            }
        }
    }};
    ($storage:expr, $s:ident, $other:ident => $e:expr) => {
        $crate::storage::dispatch!($storage, $s, $other, other_mut => $e)
    };
    ($storage:expr, $s:ident => $e:expr) => {
        $crate::storage::dispatch!($storage, $s, other, other_mut => $e)
    };
}
pub(crate) use dispatch;

/// Runs `$e` with `$B` naming the storage type of the backend that serves `$device` and `$i`
/// bound to the device's ordinal (0 on the CPU); without the `cuda` feature a CUDA device is
/// the typed error saying so.
#[collapse_debuginfo(yes)]
macro_rules! on_device {
    ($device:expr, $B:ident, $i:ident => $e:expr) => {{
        #[allow(unused_imports)]
        use $crate::backend::BackendStorage as _;
        #[allow(unused_imports)]
        use $crate::storage::IntoDevice as _;
        match $device {
            $crate::Device::Cpu => {
                type $B = $crate::Buffer;
                let $i = 0usize;
                $e
            }
            $crate::Device::Fake($i) => {
                type $B = $crate::fake::FakeStorage;
                $e
            }
            #[cfg(feature = "cuda")]
            $crate::Device::Cuda($i) => {
                type $B = $crate::cuda::CudaStorage;
                $e
            }
            #[cfg(not(feature = "cuda"))]
            d @ $crate::Device::Cuda(_) => Err($crate::cuda::probe::Unavailable::NotBuilt.on(d)),
        }
    }};
}
pub(crate) use on_device;

impl DeviceStorage {
    /// `n` zeros of `dtype` on `device` ([`BackendStorage::zeros_on`]).
    pub(crate) fn zeros(device: Device, dtype: DType, n: usize) -> Result<DeviceStorage> {
        on_device!(device, B, i => B::zeros_on(i, dtype, n).into_device())
    }

    /// Copy in: host data onto `device` ([`BackendStorage::upload`]; no copy for the CPU).
    pub(crate) fn from_cpu(device: Device, data: Buffer) -> Result<DeviceStorage> {
        on_device!(device, B, i => B::upload(i, data).into_device())
    }

    /// The device the memory lives on.
    pub(crate) fn device(&self) -> Device {
        dispatch!(plain self, s => s.device())
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        dispatch!(plain self, s => s.dtype())
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        dispatch!(plain self, s => s.len())
    }
}

/// A tensor's memory on some device, as lent out by [`crate::Tensor::lend_storage`] and
/// given back with [`crate::Tensor::restore_storage`]. Opaque: other crates move its
/// elements to and from host buffers explicitly, without a copy when it lives on the CPU.
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
        dispatch!(plain self.0, s => s.into_cpu())
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
