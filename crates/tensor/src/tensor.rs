//! The tensor: shared storage viewed through a layout.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::layout::contiguous_strides;
use crate::storage::{CpuStorage, Storage};
use crate::{DType, Device, Element, Layout, Result, Rng, TensorError};

/// An n-d array: a reference-counted storage plus a [`Layout`] (shape, strides, offset).
///
/// Cloning a tensor or taking a view (transpose, narrow, broadcast, reshape of a
/// contiguous tensor) shares the storage; ops return new tensors. In-place methods
/// (`add_assign`, `fill`, `copy_from`, `with_slice_mut`) write through the view into the
/// shared storage: this is how a parameter's gradient can live inside a larger flat
/// buffer (a DDP bucket).
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<RwLock<Storage>>,
    layout: Layout,
    dtype: DType,
    device: Device,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor[{:?}, {:?}, {}]", self.shape(), self.dtype, self.device)
    }
}

impl Tensor {
    fn from_storage(storage: CpuStorage, shape: &[usize]) -> Tensor {
        let dtype = storage.dtype();
        Tensor {
            storage: Arc::new(RwLock::new(Storage::Cpu(storage))),
            layout: Layout::contiguous(shape),
            dtype,
            device: Device::Cpu,
        }
    }

    /// A contiguous tensor owning `data`, which must hold exactly `shape`'s element count.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if data.len() != numel {
            return Err(TensorError::ElementCount {
                op: "from_vec",
                len: data.len(),
                shape: shape.to_vec(),
                numel,
            });
        }
        Ok(Self::from_storage(T::wrap(data), shape))
    }

    /// A contiguous tensor copying `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Self::from_vec(data.to_vec(), shape)
    }

    /// A 0-d tensor holding `v`.
    pub fn scalar(v: f64, dtype: DType) -> Tensor {
        Self::full(&[], v, dtype)
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        Self::from_storage(CpuStorage::zeros(dtype, shape.iter().product()), shape)
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize], dtype: DType) -> Tensor {
        Self::full(shape, 1.0, dtype)
    }

    /// A tensor filled with `v` (converted to `dtype`).
    pub fn full(shape: &[usize], v: f64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        Self::from_storage(fill_storage(dtype, n, v), shape)
    }

    /// Standard-normal samples times `std`.
    pub fn randn(shape: &[usize], std: f64, dtype: DType, rng: &mut Rng) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| rng.normal() * std).collect();
        Self::from_f64_vec(v, shape, dtype)
    }

    /// Uniform samples in `[lo, hi)`.
    pub fn rand_uniform(shape: &[usize], lo: f64, hi: f64, dtype: DType, rng: &mut Rng) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| lo + (hi - lo) * rng.uniform()).collect();
        Self::from_f64_vec(v, shape, dtype)
    }

    /// A tensor of `dtype` from f64 values (rounded as the type requires).
    pub fn from_f64_vec(v: Vec<f64>, shape: &[usize], dtype: DType) -> Tensor {
        let s = match dtype {
            DType::F64 => CpuStorage::F64(v),
            DType::F32 => CpuStorage::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F16 => CpuStorage::F16(v.iter().map(|&x| half::f16::from_f64(x)).collect()),
            DType::BF16 => CpuStorage::BF16(v.iter().map(|&x| half::bf16::from_f64(x)).collect()),
            DType::I64 => CpuStorage::I64(v.iter().map(|&x| x as i64).collect()),
            DType::U8 => CpuStorage::U8(v.iter().map(|&x| x as u8).collect()),
        };
        Self::from_storage(s, shape)
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// Alias of [`Tensor::shape`].
    pub fn dims(&self) -> &[usize] {
        self.layout.shape()
    }

    /// Size of dimension `d`.
    pub fn dim(&self, d: usize) -> Result<usize> {
        self.shape().get(d).copied().ok_or(TensorError::DimOutOfRange {
            op: "dim",
            dim: d,
            rank: self.rank(),
        })
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device of the storage.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The view's layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// True when the view is row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// True when both tensors view the same storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// A view of the same storage through another layout (checked against the storage).
    pub fn view_with_layout(&self, layout: Layout) -> Result<Tensor> {
        let len = self.storage_len();
        if layout.storage_extent() > len {
            return Err(TensorError::OutOfRange {
                op: "view",
                msg: format!(
                    "layout {:?} reaches element {} of a storage of {len}",
                    layout,
                    layout.storage_extent()
                ),
            });
        }
        Ok(Tensor {
            storage: self.storage.clone(),
            layout,
            dtype: self.dtype,
            device: self.device,
        })
    }

    fn storage_len(&self) -> usize {
        match &*self.read_guard() {
            Storage::Cpu(s) => s.len(),
        }
    }

    pub(crate) fn read_guard(&self) -> RwLockReadGuard<'_, Storage> {
        self.storage.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn write_guard(&self) -> RwLockWriteGuard<'_, Storage> {
        self.storage.write().unwrap_or_else(|e| e.into_inner())
    }

    fn check_cpu(&self, op: &'static str) -> Result<()> {
        match self.device {
            Device::Cpu => Ok(()),
            d => Err(TensorError::DeviceUnavailable {
                device: d,
                reason: format!("{op} has no kernel for this device"),
            }),
        }
    }

    /// Calls `f` with the whole storage slice and this view's layout.
    pub fn with_storage<T: Element, R>(&self, op: &'static str, f: impl FnOnce(&[T], &Layout) -> R) -> Result<R> {
        self.check_cpu(op)?;
        let g = self.read_guard();
        let Storage::Cpu(s) = &*g;
        let data = T::slice(s).ok_or(TensorError::DTypeMismatch {
            op,
            lhs: self.dtype,
            rhs: T::DTYPE,
        })?;
        if self.layout.storage_extent() > data.len() {
            return Err(TensorError::StorageLent { op });
        }
        Ok(f(data, &self.layout))
    }

    /// Calls `f` with the elements in row-major order: borrowed when the view is
    /// contiguous, gathered into a temporary otherwise.
    pub fn with_contiguous<T: Element, R>(&self, op: &'static str, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        let n = self.numel();
        if self.is_contiguous() {
            self.with_storage(op, |d: &[T], l| {
                let o = l.offset();
                f(&d[o..o + n])
            })
        } else {
            let v = self.to_vec::<T>()?;
            Ok(f(&v))
        }
    }

    /// Calls `f` with the view's elements as one mutable slice. The view must be
    /// contiguous (a parameter, a gradient view into a bucket, an optimizer state).
    pub fn with_slice_mut<T: Element, R>(&self, op: &'static str, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        self.check_cpu(op)?;
        if !self.is_contiguous() {
            return Err(TensorError::Invalid {
                op,
                msg: "in-place update needs a contiguous view".into(),
            });
        }
        let n = self.numel();
        let o = self.layout.offset();
        let mut g = self.write_guard();
        let Storage::Cpu(s) = &mut *g;
        let dtype = s.dtype();
        let data = T::slice_mut(s).ok_or(TensorError::DTypeMismatch {
            op,
            lhs: dtype,
            rhs: T::DTYPE,
        })?;
        if o + n > data.len() {
            return Err(TensorError::StorageLent { op });
        }
        Ok(f(&mut data[o..o + n]))
    }

    /// The elements in row-major order (type must match the dtype).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.with_storage("to_vec", |d: &[T], l| {
            if l.is_contiguous() {
                d[l.offset()..l.offset() + l.numel()].to_vec()
            } else {
                let mut v = Vec::with_capacity(l.numel());
                l.for_each_offset(|o| v.push(d[o]));
                v
            }
        })
    }

    /// The elements converted to f64, in row-major order, whatever the dtype.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        fn conv<T: Element>(t: &Tensor) -> Result<Vec<f64>> {
            Ok(t.to_vec::<T>()?.into_iter().map(Element::to_f64).collect())
        }
        match self.dtype {
            DType::F32 => conv::<f32>(self),
            DType::F64 => conv::<f64>(self),
            DType::F16 => conv::<half::f16>(self),
            DType::BF16 => conv::<half::bf16>(self),
            DType::I64 => conv::<i64>(self),
            DType::U8 => conv::<u8>(self),
        }
    }

    /// The value of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(TensorError::Invalid {
                op: "item",
                msg: format!("tensor of shape {:?} is not a scalar", self.shape()),
            });
        }
        Ok(self.to_f64_vec()?[0])
    }

    /// A contiguous copy converted to `dtype` (shares storage when nothing changes).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype {
            return self.contiguous();
        }
        let v = self.to_f64_vec()?;
        Ok(Self::from_f64_vec(v, self.shape(), dtype))
    }

    /// This tensor on `device`. Only the CPU is served by this build.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu if self.device == Device::Cpu => Ok(self.clone()),
            d => Err(TensorError::DeviceUnavailable {
                device: d,
                reason: "this build has no CUDA backend yet; use --device cpu".into(),
            }),
        }
    }

    /// A contiguous tensor with the same elements (the same tensor if already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.copy()
    }

    /// A contiguous copy that shares nothing with `self`.
    pub fn copy(&self) -> Result<Tensor> {
        let s = match self.dtype {
            DType::F32 => CpuStorage::F32(self.to_vec()?),
            DType::F64 => CpuStorage::F64(self.to_vec()?),
            DType::F16 => CpuStorage::F16(self.to_vec()?),
            DType::BF16 => CpuStorage::BF16(self.to_vec()?),
            DType::I64 => CpuStorage::I64(self.to_vec()?),
            DType::U8 => CpuStorage::U8(self.to_vec()?),
        };
        Ok(Self::from_storage(s, self.shape()))
    }

    /// The same elements in another shape: a view when contiguous, else a copy.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let t = self.contiguous()?;
        let layout = t.layout.reshape(shape)?;
        t.view_with_layout(layout)
    }

    /// Swaps two dimensions (a view).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        self.view_with_layout(self.layout.transpose(a, b)?)
    }

    /// Swaps the last two dimensions (a view).
    pub fn t(&self) -> Result<Tensor> {
        let r = self.rank();
        if r < 2 {
            return Err(TensorError::Invalid {
                op: "t",
                msg: format!("needs rank >= 2, got {:?}", self.shape()),
            });
        }
        self.transpose(r - 2, r - 1)
    }

    /// Reorders dimensions (a view).
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        self.view_with_layout(self.layout.permute(perm)?)
    }

    /// Elements `start..start+len` along `dim` (a view).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        self.view_with_layout(self.layout.narrow(dim, start, len)?)
    }

    /// A broadcast view (stride 0 on expanded dims).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        self.view_with_layout(self.layout.broadcast_to(shape)?)
    }

    /// A contiguous view of `shape` at element `offset` of a contiguous tensor's storage:
    /// how a gradient becomes a slice of a flat bucket.
    pub fn flat_view(&self, offset: usize, shape: &[usize]) -> Result<Tensor> {
        if !self.is_contiguous() {
            return Err(TensorError::Invalid {
                op: "flat_view",
                msg: "base tensor must be contiguous".into(),
            });
        }
        let layout = Layout::new(shape.to_vec(), contiguous_strides(shape), self.layout.offset() + offset);
        if layout.storage_extent() > self.layout.offset() + self.numel() {
            return Err(TensorError::OutOfRange {
                op: "flat_view",
                msg: format!("{shape:?} at offset {offset} overruns {} elements", self.numel()),
            });
        }
        self.view_with_layout(layout)
    }

    /// Takes the storage out of this tensor (and every view of it), leaving an empty one
    /// behind until [`Tensor::restore_storage`]. Any access meanwhile is a
    /// [`TensorError::StorageLent`] error, never a read of stale data. This is how a
    /// bucket hands its flat buffer to the comm stream without a copy.
    pub fn lend_storage(&self) -> Result<CpuStorage> {
        let mut g = self.write_guard();
        let Storage::Cpu(s) = &mut *g;
        if s.len() < self.layout.storage_extent() {
            return Err(TensorError::StorageLent { op: "lend_storage" });
        }
        let empty = s.empty_like();
        Ok(std::mem::replace(s, empty))
    }

    /// Gives back storage taken with [`Tensor::lend_storage`]; type and length must match
    /// what the views need.
    pub fn restore_storage(&self, storage: CpuStorage) -> Result<()> {
        if storage.dtype() != self.dtype {
            return Err(TensorError::DTypeMismatch {
                op: "restore_storage",
                lhs: self.dtype,
                rhs: storage.dtype(),
            });
        }
        if storage.len() < self.layout.storage_extent() {
            return Err(TensorError::OutOfRange {
                op: "restore_storage",
                msg: format!(
                    "{} elements returned, the view needs {}",
                    storage.len(),
                    self.layout.storage_extent()
                ),
            });
        }
        let mut g = self.write_guard();
        *g = Storage::Cpu(storage);
        Ok(())
    }
}

fn fill_storage(dtype: DType, n: usize, v: f64) -> CpuStorage {
    match dtype {
        DType::F32 => CpuStorage::F32(vec![v as f32; n]),
        DType::F64 => CpuStorage::F64(vec![v; n]),
        DType::F16 => CpuStorage::F16(vec![half::f16::from_f64(v); n]),
        DType::BF16 => CpuStorage::BF16(vec![half::bf16::from_f64(v); n]),
        DType::I64 => CpuStorage::I64(vec![v as i64; n]),
        DType::U8 => CpuStorage::U8(vec![v as u8; n]),
    }
}
