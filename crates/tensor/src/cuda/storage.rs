//! A tensor's memory on a CUDA device: allocation, copies in and out, and the keep-alive rule
//! (memory used on a stream other than its own is freed only after that stream's work on it).

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::{bf16, f16};

use super::device::{fault, CudaDevice};
use super::element::{CudaBuffer, CudaElement};
use crate::Buffer;
use crate::{DType, Device, Layout, Result, TensorError};

/// Launches kernel `$name` of `$file` on `$dev`'s current stream with the given arguments,
/// every failure checked and named. `$dev` is anything with `function`, `stream` and
/// `location` (a `CudaDevice`, or a given stream in `streams.rs`).
macro_rules! launch {
    ($dev:expr, $file:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let name: &str = &$name;
        let f = $dev.function($file, name)?;
        let stream = $dev.stream();
        let mut b = stream.launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: the arguments follow the kernel's C signature in its .cu file (pointers,
        // then 64-bit counts and scalars, in order) and every buffer holds the elements the
        // counts and layouts name (checked by the front end and the caller).
        unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err(|e| $crate::cuda::device::fault($dev.location(), &format!("launching {name}"), e))
    }};
}
pub(crate) use launch;

/// Storage on a CUDA device: one buffer of one element type (none when empty), the device,
/// what is known of its integer values, and the other streams that used it.
pub(crate) struct CudaStorage {
    buf: Option<CudaBuffer>,
    dtype: DType,
    len: usize,
    dev: Arc<CudaDevice>,
    int_range: Option<(i64, i64)>,
    /// Streams other than the buffer's own that used it (kernels in a scope of theirs, raw
    /// memory lent for them): the free waits for them.
    used_on: Mutex<Vec<Arc<CudaStream>>>,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({:?} x {} on {:?})", self.dtype, self.len, self.dev)
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        let others = std::mem::take(&mut *self.used_on.get_mut().unwrap_or_else(|p| p.into_inner()));
        let Some(buf) = self.buf.take() else { return };
        if others.is_empty() {
            return; // freed on its own stream, after that stream's work
        }
        let events: std::result::Result<Vec<_>, _> = others.iter().map(|s| s.record_event(None)).collect();
        match events {
            Ok(events) => self.dev.defer_free(buf, events),
            Err(_) => {
                // Cannot record: wait for those streams instead of freeing under them.
                for s in &others {
                    let _ = s.synchronize();
                }
                drop(buf);
            }
        }
    }
}

impl CudaStorage {
    /// Wraps a device slice of `len` elements.
    pub(crate) fn from_slice<T: CudaElement>(dev: &Arc<CudaDevice>, s: CudaSlice<T>) -> Self {
        let len = s.len();
        CudaStorage {
            buf: Some(T::wrap(s)),
            dtype: T::DTYPE,
            len,
            dev: dev.clone(),
            int_range: None,
            used_on: Mutex::new(Vec::new()),
        }
    }

    /// An empty storage of `dtype` (nothing allocated).
    pub(crate) fn empty(dev: &Arc<CudaDevice>, dtype: DType) -> Self {
        CudaStorage {
            buf: None,
            dtype,
            len: 0,
            dev: dev.clone(),
            int_range: None,
            used_on: Mutex::new(Vec::new()),
        }
    }

    /// The same storage, remembering the range of its integer values.
    pub(crate) fn with_int_range(mut self, range: Option<(i64, i64)>) -> Self {
        self.int_range = range;
        self
    }

    /// The range of integer values known without reading them.
    pub(crate) fn known_int_range(&self) -> Option<(i64, i64)> {
        self.int_range
    }

    /// Forgets the range (the storage is being written on the device).
    pub(crate) fn forget_int_range(&mut self) {
        self.int_range = None;
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the memory lives on.
    pub(crate) fn device(&self) -> Device {
        self.dev.location()
    }

    /// The device handle.
    pub(crate) fn cuda_device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A zero-length storage of the same dtype and device (what a lent-out tensor keeps).
    pub(crate) fn empty_like(&self) -> Self {
        Self::empty(&self.dev, self.dtype)
    }

    fn used_on(&self) -> MutexGuard<'_, Vec<Arc<CudaStream>>> {
        self.used_on.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes a use on the current stream (the keep-alive rule).
    fn note_use(&self, own: &Arc<CudaStream>) {
        let now = self.dev.stream();
        if now.cu_stream() != own.cu_stream() {
            let mut u = self.used_on();
            if !u.iter().any(|s| s.cu_stream() == now.cu_stream()) {
                u.push(now);
            }
        }
    }

    /// The buffer as `T`, or a typed error; notes a use on the current stream.
    pub(crate) fn data<T: CudaElement>(&self, op: &'static str) -> Result<&CudaSlice<T>> {
        let buf = self.buf.as_ref().ok_or(TensorError::StorageLent { op })?;
        let s = T::slice(buf).ok_or(TensorError::DTypeMismatch {
            op,
            lhs: self.dtype,
            rhs: T::DTYPE,
        })?;
        self.note_use(s.stream());
        Ok(s)
    }

    /// The buffer as `T`, mutably; notes a use on the current stream.
    pub(crate) fn data_mut<T: CudaElement>(&mut self, op: &'static str) -> Result<&mut CudaSlice<T>> {
        self.int_range = None;
        let dtype = self.dtype;
        let own = match self.buf.as_ref() {
            Some(b) => b.stream().clone(),
            None => return Err(TensorError::StorageLent { op }),
        };
        self.note_use(&own);
        let buf = self.buf.as_mut().ok_or(TensorError::StorageLent { op })?;
        T::slice_mut(buf).ok_or(TensorError::DTypeMismatch {
            op,
            lhs: dtype,
            rhs: T::DTYPE,
        })
    }

    /// The address of the memory for code outside the contract that uses it on the current
    /// stream (noted for the keep-alive rule).
    pub(crate) fn lend_raw_on_current_stream(&self) -> Result<u64> {
        let op = "device_memory";
        let buf = self.buf.as_ref().ok_or(TensorError::StorageLent { op })?;
        self.note_use(buf.stream());
        Ok(buf.device_ptr())
    }

    /// `n` uninitialised elements on `dev`'s current stream, for a kernel that writes them
    /// all.
    pub(crate) fn alloc<T: CudaElement>(dev: &Arc<CudaDevice>, n: usize) -> Result<CudaSlice<T>> {
        dev.reap();
        // SAFETY: callers launch a kernel that writes every element before any read.
        unsafe { dev.stream().alloc::<T>(n) }
            .map_err(|e| fault(dev.location(), &format!("allocating {n} x {:?}", T::DTYPE), e))
    }

    /// `n` zeroed elements on `dev`'s current stream.
    pub(crate) fn alloc_zeros<T: CudaElement>(dev: &Arc<CudaDevice>, n: usize) -> Result<CudaSlice<T>> {
        dev.reap();
        dev.stream()
            .alloc_zeros::<T>(n)
            .map_err(|e| fault(dev.location(), &format!("allocating {n} x {:?}", T::DTYPE), e))
    }

    /// `n` zero-filled elements of `dtype` on `dev`.
    pub(crate) fn zeros(dev: &Arc<CudaDevice>, dtype: DType, n: usize) -> Result<Self> {
        if n == 0 {
            return Ok(Self::empty(dev, dtype));
        }
        Ok(match dtype {
            DType::F32 => Self::from_slice(dev, Self::alloc_zeros::<f32>(dev, n)?),
            DType::F64 => Self::from_slice(dev, Self::alloc_zeros::<f64>(dev, n)?),
            DType::F16 => Self::from_slice(dev, Self::alloc_zeros::<f16>(dev, n)?),
            DType::BF16 => Self::from_slice(dev, Self::alloc_zeros::<bf16>(dev, n)?),
            DType::I64 => Self::from_slice(dev, Self::alloc_zeros::<i64>(dev, n)?),
            DType::U8 => Self::from_slice(dev, Self::alloc_zeros::<u8>(dev, n)?),
            DType::I8 => Self::from_slice(dev, Self::alloc_zeros::<i8>(dev, n)?),
        })
    }

    /// Copy in: host data onto `dev` (on its current stream); integer data remembers its range.
    pub(crate) fn from_cpu(dev: &Arc<CudaDevice>, data: &Buffer) -> Result<Self> {
        fn up<T: CudaElement>(dev: &Arc<CudaDevice>, v: &[T]) -> Result<CudaStorage> {
            if v.is_empty() {
                return Ok(CudaStorage::empty(dev, T::DTYPE));
            }
            dev.reap();
            let s = dev
                .stream()
                .clone_htod(v)
                .map_err(|e| fault(dev.location(), "copying host data to the device", e))?;
            Ok(CudaStorage::from_slice(dev, s))
        }
        let s = match data {
            Buffer::F32(v) => up(dev, v),
            Buffer::F64(v) => up(dev, v),
            Buffer::F16(v) => up(dev, v),
            Buffer::BF16(v) => up(dev, v),
            Buffer::I64(v) => up(dev, v),
            Buffer::U8(v) => up(dev, v),
            Buffer::I8(v) => up(dev, v),
        }?;
        Ok(s.with_int_range(crate::cpu::int_range(data)))
    }

    /// Copy in from a host slice of any element type (the GEMM benchmark).
    pub(crate) fn from_host<T: CudaElement>(dev: &Arc<CudaDevice>, v: &[T]) -> Result<Self> {
        if v.is_empty() {
            return Ok(Self::empty(dev, T::DTYPE));
        }
        let s = dev
            .stream()
            .clone_htod(v)
            .map_err(|e| fault(dev.location(), "copying host data to the device", e))?;
        Ok(Self::from_slice(dev, s))
    }

    /// Copy out the whole storage as `T` (the host waits for the current stream).
    pub(crate) fn to_host<T: CudaElement>(&self) -> Result<Vec<T>> {
        if self.len == 0 {
            return Ok(Vec::new());
        }
        let d = self.data::<T>("to_host")?;
        self.dev
            .stream()
            .clone_dtoh(d)
            .map_err(|e| fault(self.device(), "copying device data to the host", e))
    }

    /// Checks that `layout` stays inside this storage (a kernel must never read past it).
    pub(crate) fn check_extent(&self, op: &'static str, layout: &Layout) -> Result<()> {
        if layout.storage_extent() > self.len {
            return Err(TensorError::OutOfRange {
                op,
                msg: format!(
                    "view {:?} reaches element {} of a {}-element storage",
                    layout.shape(),
                    layout.storage_extent(),
                    self.len
                ),
            });
        }
        Ok(())
    }
}

impl CudaBuffer {
    /// The stream the buffer was allocated on (and is freed on).
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        crate::cuda::element::with_slice!(self, s => s.stream())
    }

    /// The device address of the first element.
    pub(crate) fn device_ptr(&self) -> u64 {
        crate::cuda::element::with_slice!(self, s => {
            let stream = s.stream().clone();
            let (ptr, _sync) = s.device_ptr(&stream);
            ptr
        })
    }
}
