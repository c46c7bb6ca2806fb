//! A tensor's memory on a CUDA device: allocation, copies in and out, and the data
//! movement kernels (strided gather, dtype conversion, fill, scaled accumulation).

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::{bf16, f16};

use super::device::{fault, CudaDevice};
use super::element::{CudaBuffer, CudaElement, CudaFloat};
use super::launch::{for_elements, StridedLayout};
use super::nvrtc::COPY;
use crate::storage::CpuStorage;
use crate::{DType, Device, Layout, Result, TensorError};

/// I8 storage is CPU-only for now (a reducer policy's quantized payload); CUDA kernels for it
/// come with the device seam's i8 casts.
fn no_i8(op: &'static str) -> TensorError {
    TensorError::UnsupportedDType {
        op,
        dtype: DType::I8,
        hint: " (i8 tensors live on the CPU for now)",
    }
}

/// Launches kernel `$name` of `$file` on `$dev`'s stream with the given arguments, every
/// failure checked and named.
macro_rules! launch {
    ($dev:expr, $file:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let name: &str = &$name;
        let f = $dev.function($file, name)?;
        let mut b = $dev.stream().launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: the arguments follow the kernel's C signature in its .cu file (pointers,
        // then 64-bit counts and scalars, in order) and every buffer holds the elements the
        // counts and layouts name (checked by the front end and the wrapper).
        unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err(|e| $crate::cuda::device::fault($dev.location(), &format!("launching {name}"), e))
    }};
}
pub(crate) use launch;

/// Storage on a CUDA device: one buffer of one element type (none when empty) and the
/// device whose stream orders every access.
pub struct CudaStorage {
    buf: Option<CudaBuffer>,
    dtype: DType,
    len: usize,
    dev: Arc<CudaDevice>,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({:?} x {} on {:?})", self.dtype, self.len, self.dev)
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
        }
    }

    /// An empty storage of `dtype` (nothing allocated).
    pub(crate) fn empty(dev: &Arc<CudaDevice>, dtype: DType) -> Self {
        CudaStorage {
            buf: None,
            dtype,
            len: 0,
            dev: dev.clone(),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        self.dev.location()
    }

    /// The device handle.
    pub fn cuda_device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A zero-length storage of the same dtype and device (what a lent-out tensor keeps).
    pub fn empty_like(&self) -> Self {
        Self::empty(&self.dev, self.dtype)
    }

    /// The buffer as `T`, or a typed error.
    pub(crate) fn data<T: CudaElement>(&self, op: &'static str) -> Result<&CudaSlice<T>> {
        let buf = self.buf.as_ref().ok_or(TensorError::StorageLent { op })?;
        T::slice(buf).ok_or(TensorError::DTypeMismatch {
            op,
            lhs: self.dtype,
            rhs: T::DTYPE,
        })
    }

    /// The buffer as `T`, mutably.
    pub(crate) fn data_mut<T: CudaElement>(&mut self, op: &'static str) -> Result<&mut CudaSlice<T>> {
        let dtype = self.dtype;
        let buf = self.buf.as_mut().ok_or(TensorError::StorageLent { op })?;
        T::slice_mut(buf).ok_or(TensorError::DTypeMismatch {
            op,
            lhs: dtype,
            rhs: T::DTYPE,
        })
    }

    /// The f32 buffer itself, moved out (no copy), for a collective on device memory (NCCL).
    pub fn into_f32_slice(self) -> Result<CudaSlice<f32>> {
        let op = "into_f32_slice";
        match self.buf {
            Some(super::element::CudaBuffer::F32(s)) => Ok(s),
            Some(other) => Err(TensorError::DTypeMismatch {
                op,
                lhs: other.dtype(),
                rhs: DType::F32,
            }),
            None => Err(TensorError::StorageLent { op }),
        }
    }

    /// Wraps an f32 device buffer of `dev` (the inverse of [`CudaStorage::into_f32_slice`]).
    pub fn from_f32_slice(dev: &Arc<CudaDevice>, s: CudaSlice<f32>) -> Self {
        Self::from_slice(dev, s)
    }

    /// `n` uninitialised elements on `dev`, for a kernel that writes them all.
    pub(crate) fn alloc<T: CudaElement>(dev: &Arc<CudaDevice>, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: callers launch a kernel that writes every element before any read.
        unsafe { dev.stream().alloc::<T>(n) }
            .map_err(|e| fault(dev.location(), &format!("allocating {n} x {:?}", T::DTYPE), e))
    }

    /// `n` zeroed elements on `dev`.
    pub(crate) fn alloc_zeros<T: CudaElement>(dev: &Arc<CudaDevice>, n: usize) -> Result<CudaSlice<T>> {
        dev.stream()
            .alloc_zeros::<T>(n)
            .map_err(|e| fault(dev.location(), &format!("allocating {n} x {:?}", T::DTYPE), e))
    }

    /// `n` zero-filled elements of `dtype` on `dev`.
    pub fn zeros(dev: &Arc<CudaDevice>, dtype: DType, n: usize) -> Result<Self> {
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
            DType::I8 => return Err(no_i8("zeros")),
        })
    }

    /// Copy in: host data onto `dev`.
    pub fn from_cpu(dev: &Arc<CudaDevice>, data: &CpuStorage) -> Result<Self> {
        fn up<T: CudaElement>(dev: &Arc<CudaDevice>, v: &[T]) -> Result<CudaStorage> {
            if v.is_empty() {
                return Ok(CudaStorage::empty(dev, T::DTYPE));
            }
            let s = dev
                .stream()
                .clone_htod(v)
                .map_err(|e| fault(dev.location(), "copying host data to the device", e))?;
            Ok(CudaStorage::from_slice(dev, s))
        }
        match data {
            CpuStorage::F32(v) => up(dev, v),
            CpuStorage::F64(v) => up(dev, v),
            CpuStorage::F16(v) => up(dev, v),
            CpuStorage::BF16(v) => up(dev, v),
            CpuStorage::I64(v) => up(dev, v),
            CpuStorage::U8(v) => up(dev, v),
            CpuStorage::I8(_) => Err(no_i8("from_cpu")),
        }
    }

    /// Copy in from a host slice of any element type (tests and staging).
    pub fn from_host<T: CudaElement>(dev: &Arc<CudaDevice>, v: &[T]) -> Result<Self> {
        if v.is_empty() {
            return Ok(Self::empty(dev, T::DTYPE));
        }
        let s = dev
            .stream()
            .clone_htod(v)
            .map_err(|e| fault(dev.location(), "copying host data to the device", e))?;
        Ok(Self::from_slice(dev, s))
    }

    /// Copy out the whole storage as `T` (waits for the stream).
    pub fn to_host<T: CudaElement>(&self) -> Result<Vec<T>> {
        if self.len == 0 {
            return Ok(Vec::new());
        }
        let d = self.data::<T>("to_host")?;
        self.dev
            .stream()
            .clone_dtoh(d)
            .map_err(|e| fault(self.device(), "copying device data to the host", e))
    }

    /// Copy out: the whole storage into host memory (waits for the stream).
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        fn down<T: CudaElement>(s: &CudaStorage) -> Result<Vec<T>> {
            if s.len == 0 {
                return Ok(Vec::new());
            }
            let d = s.data::<T>("to_cpu")?;
            s.dev
                .stream()
                .clone_dtoh(d)
                .map_err(|e| fault(s.device(), "copying device data to the host", e))
        }
        Ok(match self.dtype {
            DType::F32 => CpuStorage::F32(down(self)?),
            DType::F64 => CpuStorage::F64(down(self)?),
            DType::F16 => CpuStorage::F16(down(self)?),
            DType::BF16 => CpuStorage::BF16(down(self)?),
            DType::I64 => CpuStorage::I64(down(self)?),
            DType::U8 => CpuStorage::U8(down(self)?),
            DType::I8 => return Err(no_i8("to_cpu")),
        })
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

    /// The view (any layout) gathered row-major into a new contiguous storage.
    pub fn copy_strided(&self, layout: &Layout) -> Result<Self> {
        let op = "copy_strided";
        let n = layout.numel();
        if n == 0 {
            return Ok(self.empty_like());
        }
        self.check_extent(op, layout)?;
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        // Gathers move bits: one kernel per element size.
        fn go<T: CudaElement>(s: &CudaStorage, l: &StridedLayout, n: usize, n64: &u64) -> Result<CudaStorage> {
            let x = s.data::<T>("copy_strided")?;
            let mut out = CudaStorage::alloc::<T>(&s.dev, n)?;
            let name = format!("gather_b{}", std::mem::size_of::<T>());
            launch!(s.dev, COPY, name, for_elements(n), x, &mut out, l, n64)?;
            Ok(CudaStorage::from_slice(&s.dev, out))
        }
        match self.dtype {
            DType::F32 => go::<f32>(self, &l, n, &n64),
            DType::F64 => go::<f64>(self, &l, n, &n64),
            DType::F16 => go::<f16>(self, &l, n, &n64),
            DType::BF16 => go::<bf16>(self, &l, n, &n64),
            DType::I64 => go::<i64>(self, &l, n, &n64),
            DType::U8 => go::<u8>(self, &l, n, &n64),
            DType::I8 => Err(no_i8(op)),
        }
    }

    /// The view (any layout) converted to `dtype`, rounding once as the CPU does.
    pub fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Self> {
        let op = "to_dtype";
        if dtype == self.dtype {
            return self.copy_strided(layout);
        }
        let n = layout.numel();
        if n == 0 {
            return Ok(Self::empty(&self.dev, dtype));
        }
        self.check_extent(op, layout)?;
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        fn go<S: CudaElement, D: CudaElement>(
            s: &CudaStorage,
            l: &StridedLayout,
            n: usize,
            n64: &u64,
        ) -> Result<CudaStorage> {
            let x = s.data::<S>("to_dtype")?;
            let mut out = CudaStorage::alloc::<D>(&s.dev, n)?;
            let name = format!("cast_{}_{}", S::SUFFIX, D::SUFFIX);
            launch!(s.dev, COPY, name, for_elements(n), x, &mut out, l, n64)?;
            Ok(CudaStorage::from_slice(&s.dev, out))
        }
        macro_rules! to {
            ($S:ty) => {
                match dtype {
                    DType::F32 => go::<$S, f32>(self, &l, n, &n64),
                    DType::F64 => go::<$S, f64>(self, &l, n, &n64),
                    DType::F16 => go::<$S, f16>(self, &l, n, &n64),
                    DType::BF16 => go::<$S, bf16>(self, &l, n, &n64),
                    DType::I64 => go::<$S, i64>(self, &l, n, &n64),
                    DType::U8 => go::<$S, u8>(self, &l, n, &n64),
                    DType::I8 => Err(no_i8(op)),
                }
            };
        }
        match self.dtype {
            DType::F32 => to!(f32),
            DType::F64 => to!(f64),
            DType::F16 => to!(f16),
            DType::BF16 => to!(bf16),
            DType::I64 => to!(i64),
            DType::U8 => to!(u8),
            DType::I8 => Err(no_i8(op)),
        }
    }

    /// Sets every element of the view (any layout, any dtype) to `v` rounded to the dtype.
    pub fn fill(&mut self, layout: &Layout, v: f64) -> Result<()> {
        let op = "fill";
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        self.check_extent(op, layout)?;
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        fn go<T: CudaElement, B: cudarc::driver::DeviceRepr>(
            s: &mut CudaStorage,
            l: &StridedLayout,
            n: usize,
            n64: &u64,
            bits: B,
        ) -> Result<()> {
            let dev = s.dev.clone();
            let dst = s.data_mut::<T>("fill")?;
            let name = format!("fill_b{}", std::mem::size_of::<T>());
            launch!(dev, COPY, name, for_elements(n), dst, l, n64, &bits)
        }
        // The value's bits, rounded as the CPU's `from_f64` rounds.
        match self.dtype {
            DType::F32 => go::<f32, u32>(self, &l, n, &n64, (v as f32).to_bits()),
            DType::F64 => go::<f64, u64>(self, &l, n, &n64, v.to_bits()),
            DType::F16 => go::<f16, u16>(self, &l, n, &n64, f16::from_f64(v).to_bits()),
            DType::BF16 => go::<bf16, u16>(self, &l, n, &n64, bf16::from_f64(v).to_bits()),
            DType::I64 => go::<i64, u64>(self, &l, n, &n64, (v as i64) as u64),
            DType::U8 => go::<u8, u8>(self, &l, n, &n64, v as u8),
            DType::I8 => Err(no_i8(op)),
        }
    }

    /// `self[view] = src` bit for bit (any dtype; `src` contiguous of the view's shape, another
    /// storage).
    pub fn copy_from(&mut self, layout: &Layout, src: (&Self, &Layout)) -> Result<()> {
        let op = "copy_from";
        if src.0.dtype != self.dtype {
            return Err(TensorError::DTypeMismatch {
                op,
                lhs: self.dtype,
                rhs: src.0.dtype,
            });
        }
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        self.check_extent(op, layout)?;
        src.0.check_extent(op, src.1)?;
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        fn go<T: CudaElement>(
            dst: &mut CudaStorage,
            src: (&CudaStorage, &Layout),
            l: &StridedLayout,
            n64: &u64,
        ) -> Result<()> {
            let dev = dst.dev.clone();
            let n = *n64 as usize;
            let s = src.0.data::<T>("copy_from")?;
            let s = s
                .try_slice(src.1.offset()..src.1.offset() + n)
                .ok_or(TensorError::OutOfRange {
                    op: "copy_from",
                    msg: format!("source view {:?} outside its storage", src.1.shape()),
                })?;
            let d = dst.data_mut::<T>("copy_from")?;
            let name = format!("scatter_b{}", std::mem::size_of::<T>());
            launch!(dev, COPY, name, for_elements(n), d, &s, l, n64)
        }
        match self.dtype {
            DType::F32 => go::<f32>(self, src, &l, &n64),
            DType::F64 => go::<f64>(self, src, &l, &n64),
            DType::F16 => go::<f16>(self, src, &l, &n64),
            DType::BF16 => go::<bf16>(self, src, &l, &n64),
            DType::I64 => go::<i64>(self, src, &l, &n64),
            DType::U8 => go::<u8>(self, src, &l, &n64),
            DType::I8 => Err(no_i8(op)),
        }
    }

    /// `self[view] += scale * src` (f32/f64; `src` contiguous of the view's shape, another
    /// storage).
    pub fn add_scaled_assign(&mut self, layout: &Layout, src: (&Self, &Layout), scale: f64) -> Result<()> {
        let op = "add_scaled_assign";
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        self.check_extent(op, layout)?;
        src.0.check_extent(op, src.1)?;
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        fn go<T: CudaFloat>(
            dst: &mut CudaStorage,
            src: (&CudaStorage, &Layout),
            l: &StridedLayout,
            n64: &u64,
            scale: f64,
        ) -> Result<()> {
            let dev = dst.dev.clone();
            let n = *n64 as usize;
            let s = src.0.data::<T>("add_scaled_assign")?;
            let s = s
                .try_slice(src.1.offset()..src.1.offset() + n)
                .ok_or(TensorError::OutOfRange {
                    op: "add_scaled_assign",
                    msg: format!("source view {:?} outside its storage", src.1.shape()),
                })?;
            let d = dst.data_mut::<T>("add_scaled_assign")?;
            let scale = T::from_f64(scale);
            let name = format!("scaled_add_{}", T::SUFFIX);
            launch!(dev, COPY, name, for_elements(n), d, &s, l, n64, &scale)
        }
        match self.dtype {
            DType::F32 => go::<f32>(self, src, &l, &n64, scale),
            DType::F64 => go::<f64>(self, src, &l, &n64, scale),
            d => Err(TensorError::UnsupportedDType {
                op,
                dtype: d,
                hint: " (accumulation is f32/f64)",
            }),
        }
    }
}
