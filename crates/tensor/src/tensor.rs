//! The tensor: shared storage viewed through a layout.

use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::layout::contiguous_strides;
use crate::memory_meter::Charge;
use crate::storage::{dispatch, DeviceStorage, Storage};
use crate::{Buffer, DType, Device, Element, Layout, Result, Rng, TensorError};

/// An n-d array: a reference-counted storage plus a [`Layout`] (shape, strides, offset).
///
/// Cloning a tensor or taking a view (transpose, narrow, broadcast, reshape of a
/// contiguous tensor) shares the storage; ops return new tensors. In-place methods
/// (`add_assign`, `fill`, `copy_from`, the fused optimizer steps) write through the view
/// into the shared storage: this is how a parameter's gradient can live inside a larger
/// flat buffer (a DDP bucket). The storage lives on the tensor's [`Device`]; other crates
/// reach elements only by explicit copies (`to_vec`, `from_vec`, `to_device`).
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Stored>,
    layout: Layout,
    dtype: DType,
    device: Device,
}

/// A storage behind its lock, with the bytes it charged to this thread's [`crate::MemoryMeter`]
/// (given back when the last view drops it, or when [`Tensor::free_storage`] frees it).
struct Stored {
    lock: RwLock<DeviceStorage>,
    /// The bytes charged; `Err(())` while freed by [`Tensor::free_storage`].
    charge: Mutex<std::result::Result<Option<Charge>, ()>>,
}

impl std::ops::Deref for Stored {
    type Target = RwLock<DeviceStorage>;
    fn deref(&self) -> &RwLock<DeviceStorage> {
        &self.lock
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor[{:?}, {:?}, {}]", self.shape(), self.dtype, self.device)
    }
}

impl Tensor {
    /// A contiguous tensor over `storage`, on the storage's device.
    pub(crate) fn from_storage(storage: impl Into<DeviceStorage>, shape: &[usize]) -> Tensor {
        let storage = storage.into();
        let (dtype, device) = (storage.dtype(), storage.device());
        Tensor {
            storage: Arc::new(Stored {
                charge: Mutex::new(Ok(Charge::here(storage.len() * dtype.size_in_bytes()))),
                lock: RwLock::new(storage),
            }),
            layout: Layout::contiguous(shape),
            dtype,
            device,
        }
    }

    /// A contiguous tensor owning `data`, which must hold exactly `shape`'s element count.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Self::from_buffer(T::wrap(data), shape).map_err(|e| match e {
            TensorError::ElementCount { len, shape, numel, .. } => TensorError::ElementCount {
                op: "from_vec",
                len,
                shape,
                numel,
            },
            e => e,
        })
    }

    /// A contiguous tensor copying `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Self::from_vec(data.to_vec(), shape)
    }

    /// A 0-d tensor holding `v`.
    pub fn scalar(v: f64, dtype: DType) -> Tensor {
        Self::full(&[], v, dtype)
    }

    /// A tensor of `shape` and `dtype` on the CPU that holds no storage yet, as one freed by
    /// [`Tensor::free_storage`]: any access is a [`TensorError::StorageLent`] error until
    /// [`Tensor::restore_storage`] gives it its elements. How a parameter whose initial values
    /// are drawn later, shard by shard, exists before it is ever whole.
    pub fn unallocated(shape: &[usize], dtype: DType) -> Tensor {
        let t = Self::from_storage(Buffer::zeros(dtype, 0), shape);
        *t.charge() = Err(());
        t
    }

    /// A tensor of zeros (on the CPU).
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        Self::from_storage(Buffer::zeros(dtype, shape.iter().product()), shape)
    }

    /// A tensor of zeros on `device`, allocated there.
    pub fn zeros_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Ok(Self::from_storage(
            DeviceStorage::zeros(device, dtype, shape.iter().product())?,
            shape,
        ))
    }

    /// Zeros of this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Self::zeros_on(self.shape(), self.dtype, self.device)
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize], dtype: DType) -> Tensor {
        Self::full(shape, 1.0, dtype)
    }

    /// A tensor filled with `v` (converted to `dtype`) on `device`, filled there (no copy
    /// from the host).
    pub fn full_on(shape: &[usize], v: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if device == Device::Cpu {
            return Ok(Self::full(shape, v, dtype));
        }
        let t = Self::zeros_on(shape, dtype, device)?;
        if v != 0.0 || v.is_sign_negative() {
            t.fill(v)?;
        }
        Ok(t)
    }

    /// A tensor filled with `v` (converted to `dtype`).
    pub fn full(shape: &[usize], v: f64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        Self::from_storage(Buffer::full(dtype, n, v), shape)
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
        Self::from_storage(Buffer::from_f64_vec(v, dtype), shape)
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

    /// True when this handle alone views its storage, contiguously and whole: no other
    /// tensor (a clone, a view) shares it, so it can be kept as it is where a private copy
    /// would otherwise be made (autograd moves a parameter's first gradient in this way).
    pub fn is_sole_owner(&self) -> bool {
        Arc::strong_count(&self.storage) == 1
            && Arc::weak_count(&self.storage) == 0
            && self.layout.is_contiguous()
            && self.layout.offset() == 0
            && self.layout.numel() == self.storage_len()
    }

    /// Identifies the storage this tensor views (equal for tensors that share it): with
    /// [`Tensor::storage_numel`] and the layout's offset, enough to measure where a view lies
    /// without reading its elements.
    pub fn storage_id(&self) -> usize {
        Arc::as_ptr(&self.storage) as *const () as usize
    }

    /// Elements in the whole storage this tensor views (not just the view).
    pub fn storage_numel(&self) -> usize {
        self.storage_len()
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
        self.read_guard().len()
    }

    fn read_guard(&self) -> RwLockReadGuard<'_, DeviceStorage> {
        self.storage.read().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    pub(crate) fn read_guard_for_tests(&self) -> RwLockReadGuard<'_, DeviceStorage> {
        self.read_guard()
    }

    fn write_guard(&self) -> RwLockWriteGuard<'_, DeviceStorage> {
        self.storage.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The storage for reading through this view, or [`TensorError::StorageLent`] while
    /// it is lent out.
    pub(crate) fn storage(&self, op: &'static str) -> Result<RwLockReadGuard<'_, DeviceStorage>> {
        let g = self.read_guard();
        if self.layout.storage_extent() > g.len() {
            return Err(TensorError::StorageLent { op });
        }
        Ok(g)
    }

    /// The storage for writing through this view, or [`TensorError::StorageLent`] while
    /// it is lent out.
    pub(crate) fn storage_mut(&self, op: &'static str) -> Result<RwLockWriteGuard<'_, DeviceStorage>> {
        let g = self.write_guard();
        if self.layout.storage_extent() > g.len() {
            return Err(TensorError::StorageLent { op });
        }
        Ok(g)
    }

    /// This view made contiguous (a gather on its device when it is strided), for
    /// kernels that read rows.
    pub(crate) fn contiguous_for(&self, op: &'static str) -> Result<Tensor> {
        if self.is_contiguous() {
            drop(self.storage(op)?);
            return Ok(self.clone());
        }
        self.copy()
    }

    /// The elements in row-major order (type must match the dtype).
    /// A copy out of device memory when the tensor lives on a GPU.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let host = self.to_buffer()?;
        let dtype = host.dtype();
        T::unwrap(host).ok_or(TensorError::DTypeMismatch {
            op: "to_vec",
            lhs: dtype,
            rhs: T::DTYPE,
        })
    }

    /// The elements in row-major order as a host buffer of the tensor's dtype (a copy out of
    /// device memory when the tensor lives on a GPU).
    pub fn to_buffer(&self) -> Result<Buffer> {
        let l = &self.layout;
        dispatch!(plain &*self.storage("to_buffer")?, s => {
            if l.is_contiguous() && l.offset() == 0 && l.numel() == s.len() {
                s.to_cpu()
            } else {
                s.copy_strided(l)?.into_cpu()
            }
        })
    }

    /// A contiguous tensor of `shape` on the CPU owning `data` (no copy), which must hold
    /// exactly `shape`'s element count.
    pub fn from_buffer(data: Buffer, shape: &[usize]) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if data.len() != numel {
            return Err(TensorError::ElementCount {
                op: "from_buffer",
                len: data.len(),
                shape: shape.to_vec(),
                numel,
            });
        }
        Ok(Self::from_storage(data, shape))
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
            DType::I8 => conv::<i8>(self),
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

    /// A contiguous copy converted to `dtype` (shares storage when nothing changes), on every
    /// backend alike:
    /// - to a float type: rounded to nearest, ties to even (values past `F16`'s range become
    ///   infinities);
    /// - to `I8`, the quantizing cast: rounded to nearest, **ties to even** (`2.5 -> 2`,
    ///   `3.5 -> 4`, `-0.5 -> 0`), **saturating at ±127** (the symmetric range: `-128` is
    ///   never produced, so `-q` is always representable), NaN to 0. PyTorch's
    ///   `.to(torch.int8)` truncates toward zero and wraps instead; quantize with
    ///   `(x / scale).to_dtype(DType::I8)` and no explicit round or clamp;
    /// - to `I64` and `U8`: truncated toward zero and saturating at the type's bounds, NaN to 0
    ///   (Rust's `as`).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype {
            return self.contiguous();
        }
        let out = dispatch!(&*self.storage("to_dtype")?, s => s.to_dtype(&self.layout, dtype))?;
        Ok(Self::from_storage(out, self.shape()))
    }

    /// This tensor on `device`: the same tensor when it is already there, else a
    /// contiguous copy (out of the source device, into the target one). A device this
    /// build or machine cannot serve is a [`TensorError::DeviceUnavailable`].
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device {
            return Ok(self.clone());
        }
        let host = self.contiguous()?.to_buffer()?;
        Ok(Self::from_storage(DeviceStorage::from_cpu(device, host)?, self.shape()))
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
        let s = dispatch!(&*self.storage("copy")?, s => s.copy_strided(&self.layout))?;
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
    /// bucket hands its flat buffer to the comm stream without a copy (on the CPU,
    /// [`Storage::into_buffer`] then moves the buffer out as it is).
    pub fn lend_storage(&self) -> Result<Storage> {
        let mut g = self.storage_mut("lend_storage")?;
        let empty = dispatch!(&*g, s => s.empty_like());
        Ok(Storage(std::mem::replace(&mut *g, empty)))
    }

    /// Lends this tensor's elements out as a host buffer, for a collective to move: its own
    /// storage, taken out (every view reads [`TensorError::StorageLent`] until
    /// [`Tensor::restore_buffer`]), when the tensor spans it on the CPU (no copy), copied out of
    /// device memory when it lives on a GPU; a copy when it is a view of part of its storage
    /// (the tensor keeps its storage then). `true` beside the buffer: the storage was lent.
    /// One of the two changes of form a bucket's bytes take on their way to the wire.
    pub fn lend_buffer(&self) -> Result<(Buffer, bool)> {
        if self.spans_storage() {
            return Ok((self.lend_storage()?.into_buffer()?, true));
        }
        Ok((self.to_buffer()?, false))
    }

    /// Puts `data` (the result of an in-place collective, as many elements as the tensor) back
    /// under this tensor: as its storage when `lent` (what [`Tensor::lend_buffer`] said; no
    /// copy on the CPU), else copied into the tensor's elements. The other change of form.
    pub fn restore_buffer(&self, data: Buffer, lent: bool) -> Result<()> {
        if lent {
            return self.restore_storage(Storage::from_buffer(data, self.device)?);
        }
        self.copy_from(&Tensor::from_buffer(data, self.shape())?.to_device(self.device)?)
    }

    /// Whether this tensor covers its whole storage, in order: then the storage itself can be
    /// lent ([`Tensor::lend_buffer`]) or moved under other views.
    pub fn spans_storage(&self) -> bool {
        self.is_contiguous() && self.layout.offset() == 0 && self.numel() == self.storage_numel()
    }

    /// Frees this tensor's storage in place (PyTorch's resize-to-zero, as FSDP frees a
    /// parameter between uses): every view keeps its shape, any access is a
    /// [`TensorError::StorageLent`] error until [`Tensor::restore_storage`], and the bytes are
    /// given back to the [`crate::MemoryMeter`] they were charged to. (A storage lent with
    /// [`Tensor::lend_storage`] stays charged while it is in use elsewhere; freeing the tensor
    /// whose storage is lent says it will not come back, e.g. a collective consumed it, and
    /// gives its bytes back.)
    pub fn free_storage(&self) -> Result<()> {
        {
            let mut g = self.write_guard();
            if self.layout.storage_extent() <= g.len() {
                let empty = dispatch!(&*g, s => s.empty_like());
                drop(std::mem::replace(&mut *g, empty));
            }
        }
        *self.charge() = Err(());
        Ok(())
    }

    fn charge(&self) -> std::sync::MutexGuard<'_, std::result::Result<Option<Charge>, ()>> {
        self.storage.charge.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives back storage taken with [`Tensor::lend_storage`]; device, type and length
    /// must match what the views need. Into a tensor whose storage was freed
    /// ([`Tensor::free_storage`]), its bytes are charged to this thread's meter.
    pub fn restore_storage(&self, storage: Storage) -> Result<()> {
        if storage.device() != self.device {
            return Err(TensorError::DeviceMismatch {
                op: "restore_storage",
                lhs: self.device,
                rhs: storage.device(),
            });
        }
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
        let bytes = storage.len() * self.dtype.size_in_bytes();
        *self.write_guard() = storage.0;
        let mut charge = self.charge();
        if charge.is_err() {
            *charge = Ok(Charge::here(bytes));
        }
        Ok(())
    }
}

#[cfg(test)]
mod sole_owner_tests {
    use crate::{DType, Tensor};

    #[test]
    fn only_a_handle_alone_on_its_whole_contiguous_storage_is_the_sole_owner() {
        let t = Tensor::zeros(&[2, 3], DType::F32);
        assert!(t.is_sole_owner());
        let c = t.clone();
        assert!(!t.is_sole_owner() && !c.is_sole_owner());
        drop(c);
        assert!(t.is_sole_owner());
        // a view is not, even once the original is gone
        let v = t.narrow(1, 0, 2).unwrap();
        drop(t);
        assert!(!v.is_sole_owner());
        let tr = Tensor::zeros(&[2, 3], DType::F32).t().unwrap();
        assert!(!tr.is_sole_owner());
    }
}

#[cfg(test)]
mod cast_tests {
    use crate::{test_device, DType, Device, Tensor};

    fn the_int8_cast_rounds_half_to_even_and_saturates_at_127(d: Device) {
        let v = vec![
            2.5f32,
            3.5,
            -2.5,
            -0.5,
            0.49,
            126.5,
            127.5,
            1e9,
            -200.0,
            f32::NAN,
            f32::NEG_INFINITY,
        ];
        let t = Tensor::from_vec(v, &[11]).unwrap().to_device(d).unwrap();
        let q = t.to_dtype(DType::I8).unwrap().to_vec::<i8>().unwrap();
        assert_eq!(q, vec![2, 4, -2, 0, 0, 126, 127, 127, -127, 0, -127]);
    }
    test_device!(the_int8_cast_rounds_half_to_even_and_saturates_at_127);
}
