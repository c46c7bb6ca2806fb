//! The device contract of `crate::backend` implemented by the CUDA storage: every method
//! launches its kernels (NVRTC, `kernels/*.cu`) or cuBLAS GEMMs (`gemm.rs`) on the current
//! stream of the device, and never waits on the host except `to_cpu`. Inputs the contract
//! calls "contiguous" may start at an offset (a gradient is a view into a flat DDP bucket):
//! the wrappers slice there instead of copying.
//!
//! This file holds the memory half of the contract and the elementwise maps and reductions;
//! the layers' kernels (`nn.rs`), the in-place updates (`inplace.rs`) and the GEMMs
//! (`../gemm.rs`) implement their families of the contract in rooms of their own.

use std::sync::Arc;

use cudarc::driver::CudaView;
use half::{bf16, f16};

use super::device::{CudaDevice, CudaStreamRef};
use super::element::{CudaElement, CudaFloat};
use super::launch::{for_elements, for_rows, StridedLayout};
use super::nvrtc::{COPY, ELEMENTWISE, REDUCE};
use super::storage::{launch, CudaStorage};
use crate::backend::{Attention, BackendStorage, BackendStream, BinaryOp, Elementwise, Reduce, ReduceOp, UnaryOp};
use crate::scope::ScopedStream;
use crate::Buffer;
use crate::{DType, Device, Layout, Result, TensorError};

fn float_only(op: &'static str, dtype: DType) -> TensorError {
    TensorError::UnsupportedDType {
        op,
        dtype,
        hint: " (CUDA kernels take f32, f64, f16 and bf16: convert with to_dtype first)",
    }
}

/// Runs `$body` with `$T` bound to the storage's float type (f32, f64, or f16 and bf16, which
/// the kernels compute in f32: [`CudaFloat`]).
macro_rules! float_dispatch {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            d => Err(float_only($op, d)),
        }
    };
}

/// Runs `$body` with `$T` bound to the storage's element type, whatever it is.
macro_rules! any_dispatch {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::I8 => {
                type $T = i8;
                $body
            }
        }
    };
}

// After the dispatch macros: the kernel rooms use them.
mod indexing;
mod inplace;
mod nn;

/// The kernel name and scalars of a unary op (`elementwise.cu`).
fn unary_kernel(op: UnaryOp) -> (&'static str, f64, f64) {
    match op {
        UnaryOp::Neg => ("neg", 0.0, 0.0),
        UnaryOp::Exp => ("exp", 0.0, 0.0),
        UnaryOp::Ln => ("ln", 0.0, 0.0),
        UnaryOp::Sqrt => ("sqrt", 0.0, 0.0),
        UnaryOp::Relu => ("relu", 0.0, 0.0),
        UnaryOp::Gelu => ("gelu", 0.0, 0.0),
        UnaryOp::Sqr => ("sqr", 0.0, 0.0),
        UnaryOp::Affine { mul, add } => ("affine", mul, add),
        UnaryOp::Powf(p) => ("powf", p, 0.0),
        UnaryOp::Sin => ("sin", 0.0, 0.0),
        UnaryOp::Cos => ("cos", 0.0, 0.0),
        UnaryOp::Abs => ("abs", 0.0, 0.0),
        UnaryOp::Sign => ("sign", 0.0, 0.0),
        UnaryOp::Round => ("round", 0.0, 0.0),
        UnaryOp::Clamp { min, max } => ("clamp", min, max),
        UnaryOp::InRange { min, max } => ("in_range", min, max),
        UnaryOp::IsZero => ("is_zero", 0.0, 0.0),
    }
}

/// The kernel name of a binary op (`elementwise.cu`).
fn binary_kernel(op: BinaryOp) -> &'static str {
    match op {
        BinaryOp::Add => "add",
        BinaryOp::Sub => "sub",
        BinaryOp::Mul => "mul",
        BinaryOp::Div => "div",
        BinaryOp::ReluBackward => "relu_backward",
        BinaryOp::GeluBackward => "gelu_backward",
    }
}

impl CudaStorage {
    /// The `n` elements of a contiguous view starting at its offset.
    fn contiguous_view<T: CudaElement>(&self, op: &'static str, layout: &Layout) -> Result<CudaView<'_, T>> {
        if !layout.is_contiguous() {
            return Err(TensorError::Invalid {
                op,
                msg: format!("expects a contiguous view, got strides {:?}", layout.strides()),
            });
        }
        let (start, n) = (layout.offset(), layout.numel());
        self.data::<T>(op)?
            .try_slice(start..start + n)
            .ok_or(TensorError::OutOfRange {
                op,
                msg: format!(
                    "view of {n} elements at offset {start} in a {}-element storage",
                    self.len()
                ),
            })
    }

    fn dev(&self) -> &Arc<CudaDevice> {
        self.cuda_device()
    }

    fn rows_of(layout: &Layout, op: &'static str) -> Result<(usize, usize)> {
        let d = *layout.shape().last().ok_or(TensorError::Invalid {
            op,
            msg: "needs rank >= 1".into(),
        })?;
        Ok((layout.numel().checked_div(d).unwrap_or(0), d))
    }

    /// The suffix of an index storage's kernels, or a typed error.
    fn index_suffix(op: &'static str, ids: &Self) -> Result<&'static str> {
        match ids.dtype() {
            DType::I64 => Ok("i64"),
            DType::U8 => Ok("u8"),
            d => Err(TensorError::UnsupportedDType {
                op,
                dtype: d,
                hint: " (indices are I64 or U8)",
            }),
        }
    }

    /// The `n` elements of a contiguous source view (another storage) at its offset.
    fn source_view<'a, T: CudaElement>(
        op: &'static str,
        src: (&'a Self, &Layout),
        n: usize,
    ) -> Result<CudaView<'a, T>> {
        let s = src.0.data::<T>(op)?;
        s.try_slice(src.1.offset()..src.1.offset() + n)
            .ok_or(TensorError::OutOfRange {
                op,
                msg: format!("source view {:?} outside its storage", src.1.shape()),
            })
    }
}

impl BackendStorage for CudaStorage {
    fn dtype(&self) -> DType {
        CudaStorage::dtype(self)
    }

    fn device(&self) -> Device {
        CudaStorage::device(self)
    }

    fn len(&self) -> usize {
        CudaStorage::len(self)
    }

    fn empty_like(&self) -> Self {
        CudaStorage::empty_like(self)
    }

    fn int_range(&self) -> Option<(i64, i64)> {
        self.known_int_range()
    }

    fn zeros_on(ordinal: usize, dtype: DType, n: usize) -> Result<Self> {
        CudaStorage::zeros(&CudaDevice::get(ordinal)?, dtype, n)
    }

    /// On the device's current stream; integer data remembers its range.
    fn upload(ordinal: usize, data: Buffer) -> Result<Self> {
        CudaStorage::from_cpu(&CudaDevice::get(ordinal)?, &data)
    }

    fn lend_raw(&self) -> Result<u64> {
        self.lend_raw_on_current_stream()
    }

    fn compute_stream(ordinal: usize) -> Result<Arc<dyn BackendStream>> {
        Ok(Arc::new(CudaStreamRef::compute(ordinal)?))
    }

    fn new_stream(ordinal: usize) -> Result<Arc<dyn BackendStream>> {
        Ok(Arc::new(CudaStreamRef::new(ordinal)?))
    }

    fn scoped_stream(entered: &ScopedStream) -> Option<Arc<dyn BackendStream>> {
        let s = entered.downcast_ref::<CudaStreamRef>()?;
        Some(Arc::new(s.clone()))
    }

    /// The host waits for the current stream.
    fn to_cpu(&self) -> Result<Buffer> {
        Ok(match self.dtype() {
            DType::F32 => Buffer::F32(self.to_host()?),
            DType::F64 => Buffer::F64(self.to_host()?),
            DType::F16 => Buffer::F16(self.to_host()?),
            DType::BF16 => Buffer::BF16(self.to_host()?),
            DType::I64 => Buffer::I64(self.to_host()?),
            DType::U8 => Buffer::U8(self.to_host()?),
            DType::I8 => Buffer::I8(self.to_host()?),
        })
    }

    fn copy_strided(&self, layout: &Layout) -> Result<Self> {
        let op = "copy_strided";
        let n = layout.numel();
        if n == 0 {
            return Ok(self.empty_like());
        }
        self.check_extent(op, layout)?;
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        // Gathers move bits: one kernel per element size.
        let out = any_dispatch!(self.dtype(), T => {
            let x = self.data::<T>(op)?;
            let mut out = Self::alloc::<T>(self.dev(), n)?;
            let name = format!("gather_b{}", std::mem::size_of::<T>());
            launch!(self.dev(), COPY, name, for_elements(n), x, &mut out, &l, &n64)?;
            Self::from_slice(self.dev(), out)
        });
        // a gather of integer data stays inside the range of what it was gathered from
        Ok(out.with_int_range(self.known_int_range()))
    }

    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Self> {
        let op = "to_dtype";
        if dtype == self.dtype() {
            return self.copy_strided(layout);
        }
        let n = layout.numel();
        if n == 0 {
            return Ok(Self::empty(self.dev(), dtype));
        }
        self.check_extent(op, layout)?;
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        let range = crate::cpu::range_in(self.known_int_range(), dtype);
        any_dispatch!(self.dtype(), S => {
            any_dispatch!(dtype, D => {
                let x = self.data::<S>(op)?;
                let mut out = Self::alloc::<D>(self.dev(), n)?;
                let name = format!("cast_{}_{}", S::SUFFIX, D::SUFFIX);
                launch!(self.dev(), COPY, name, for_elements(n), x, &mut out, &l, &n64)?;
                Ok(Self::from_slice(self.dev(), out).with_int_range(range))
            })
        })
    }
}

impl Elementwise for CudaStorage {
    fn unary(&self, layout: &Layout, op: UnaryOp) -> Result<Self> {
        let (name, p0, p1) = unary_kernel(op);
        let n = layout.numel();
        if n == 0 {
            return Ok(self.empty_like());
        }
        self.check_extent(name, layout)?;
        let l = StridedLayout::of(name, layout)?;
        float_dispatch!(name, self.dtype(), T => {
            let x = self.data::<T>(name)?;
            let mut out = Self::alloc::<T>(self.dev(), n)?;
            let (n64, p0, p1) = (n as u64, T::scalar(p0), T::scalar(p1));
            launch!(self.dev(), ELEMENTWISE, format!("{name}_{}", T::SUFFIX), for_elements(n), x, &mut out, &l, &n64, &p0, &p1)?;
            Ok(Self::from_slice(self.dev(), out))
        })
    }

    fn binary(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, op: BinaryOp) -> Result<Self> {
        let name = binary_kernel(op);
        if lhs.shape() != rhs_layout.shape() {
            return Err(TensorError::ShapeMismatch {
                op: name,
                lhs: lhs.shape().to_vec(),
                rhs: rhs_layout.shape().to_vec(),
            });
        }
        let n = lhs.numel();
        if n == 0 {
            return Ok(self.empty_like());
        }
        self.check_extent(name, lhs)?;
        rhs.check_extent(name, rhs_layout)?;
        let (la, lb) = (StridedLayout::of(name, lhs)?, StridedLayout::of(name, rhs_layout)?);
        float_dispatch!(name, self.dtype(), T => {
            let (a, b) = (self.data::<T>(name)?, rhs.data::<T>(name)?);
            let mut out = Self::alloc::<T>(self.dev(), n)?;
            let n64 = n as u64;
            launch!(self.dev(), ELEMENTWISE, format!("{name}_{}", T::SUFFIX), for_elements(n), a, b, &mut out, &la, &lb, &n64)?;
            Ok(Self::from_slice(self.dev(), out))
        })
    }
}

impl Reduce for CudaStorage {
    /// The reduced dims are permuted last and gathered, then one block reduces each row.
    fn reduce(&self, layout: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self> {
        let max = matches!(op, ReduceOp::Max);
        let op = if max { "max" } else { "sum" };
        if dims.is_empty() {
            return self.copy_strided(layout);
        }
        let kept: Vec<usize> = (0..layout.rank()).filter(|d| !dims.contains(d)).collect();
        let perm: Vec<usize> = kept.iter().chain(dims).copied().collect();
        let rows: usize = kept.iter().map(|&d| layout.shape()[d]).product();
        let cols: usize = dims.iter().map(|&d| layout.shape()[d]).product();
        if rows == 0 {
            return Ok(self.empty_like());
        }
        let permuted = layout.permute(&perm)?;
        // already [rows, cols] in order: no gather
        let gathered = if cols == 0 || permuted.is_contiguous() {
            None
        } else {
            Some(self.copy_strided(&permuted)?)
        };
        float_dispatch!(op, self.dtype(), T => {
            let mut out = Self::alloc::<T>(self.dev(), rows)?;
            let (r64, c64) = (rows as u64, cols as u64);
            let name = format!("{op}_rows_{}", T::SUFFIX);
            match (&gathered, cols) {
                (Some(g), _) => launch!(self.dev(), REDUCE, name, for_rows(rows), g.data::<T>(op)?, &mut out, &r64, &c64)?,
                // nothing to reduce: the kernels still write each row's identity (0 or -inf)
                (None, 0) => {
                    let dummy = Self::alloc::<T>(self.dev(), 1)?;
                    launch!(self.dev(), REDUCE, name, for_rows(rows), &dummy, &mut out, &r64, &c64)?
                }
                (None, _) => {
                    let x = self.contiguous_view::<T>(op, &permuted)?;
                    launch!(self.dev(), REDUCE, name, for_rows(rows), &x, &mut out, &r64, &c64)?
                }
            }
            Ok(Self::from_slice(self.dev(), out))
        })
    }
}

impl Attention for CudaStorage {
    fn causal_attention(&self, layout: &Layout, n_heads: usize, scale: f64) -> Result<(Self, Self)> {
        crate::composed::causal_attention(self, layout, n_heads, scale)
    }

    fn causal_attention_backward(
        &self,
        layout: &Layout,
        probs: (&Self, &Layout),
        gy: (&Self, &Layout),
        n_heads: usize,
        scale: f64,
    ) -> Result<Self> {
        crate::composed::causal_attention_backward(self, layout, probs, gy, n_heads, scale)
    }
}

#[cfg(test)]
mod kernel_names;
