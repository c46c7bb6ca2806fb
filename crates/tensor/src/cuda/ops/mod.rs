//! The device contract of `crate::backend` implemented by the CUDA storage: every method
//! launches its kernels (NVRTC, `kernels/*.cu`) or cuBLAS GEMMs (`gemm.rs`) on the current
//! stream of the device, and never waits on the host except `to_cpu`. Inputs the contract
//! calls "contiguous" may start at an offset (a gradient is a view into a flat DDP bucket):
//! the wrappers slice there instead of copying.
//!
//! The layers' kernels (`nn.rs`) and the optimizers' fused steps (`optim.rs`) live in rooms of
//! their own; the contract's methods for them hand over to those.

use std::sync::Arc;

use cudarc::driver::CudaView;
use half::{bf16, f16};

use super::device::CudaDevice;
use super::element::{CudaElement, CudaFloat};
use super::launch::{for_elements, for_rows, StridedLayout};
use super::nvrtc::{COPY, ELEMENTWISE, REDUCE};
use super::storage::{launch, CudaStorage};
use crate::backend::{AdamWScalars, BackendStorage, BinaryOp, ReduceOp, SgdScalars, UnaryOp};
use crate::cpu::storage::CpuStorage;
use crate::{DType, Device, Layout, Result, TensorError};

fn float_only(op: &'static str, dtype: DType) -> TensorError {
    TensorError::UnsupportedDType {
        op,
        dtype,
        hint: " (CUDA kernels compute in f32/f64: convert with to_dtype first)",
    }
}

/// Runs `$body` with `$T` bound to the storage's compute type (f32 or f64).
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
mod nn;
mod optim;

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

    fn to_cpu(&self) -> Result<CpuStorage> {
        self.download()
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
        let range = crate::cpu::storage::range_in(self.known_int_range(), dtype);
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
            let (n64, p0, p1) = (n as u64, T::from_f64(p0), T::from_f64(p1));
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

    fn matmul(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self> {
        super::gemm::matmul(self, lhs, rhs, rhs_layout)
    }

    fn softmax_last(&self, layout: &Layout, log: bool) -> Result<Self> {
        self.launch_softmax_last(layout, log)
    }

    fn softmax_backward(&self, layout: &Layout, g: &Self, g_layout: &Layout, log: bool) -> Result<Self> {
        self.launch_softmax_backward(layout, g, g_layout, log)
    }

    fn layer_norm(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        bias: (&Self, &Layout),
        eps: f64,
    ) -> Result<(Self, Self, Self)> {
        self.launch_layer_norm(layout, weight, bias, eps)
    }

    /// `dx` one block per row; `dweight`, `dbias` by a two-stage column reduction (chunks of
    /// rows into partial rows, then the partial rows of each column in order): deterministic.
    fn layer_norm_backward(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        mean: (&Self, &Layout),
        rstd: (&Self, &Layout),
        gy: (&Self, &Layout),
    ) -> Result<(Self, Self, Self)> {
        self.launch_layer_norm_backward(layout, weight, mean, rstd, gy)
    }

    fn embedding(&self, layout: &Layout, ids: (&Self, &Layout)) -> Result<Self> {
        self.launch_embedding(layout, ids)
    }

    fn embedding_backward(&self, layout: &Layout, ids: (&Self, &Layout), vocab: usize) -> Result<Self> {
        self.launch_embedding_backward(layout, ids, vocab)
    }

    fn causal_fill(&self, layout: &Layout, value: f64) -> Result<Self> {
        self.launch_causal_fill(layout, value)
    }

    /// The loss is accumulated in f64 over the rows, as on the CPU.
    fn cross_entropy(&self, layout: &Layout, targets: (&Self, &Layout)) -> Result<(Self, Self)> {
        self.launch_cross_entropy(layout, targets)
    }

    fn cross_entropy_backward(&self, layout: &Layout, targets: (&Self, &Layout), g: (&Self, &Layout)) -> Result<Self> {
        self.launch_cross_entropy_backward(layout, targets, g)
    }

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

    fn fill(&mut self, layout: &Layout, v: f64) -> Result<()> {
        let op = "fill";
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        self.check_extent(op, layout)?;
        self.forget_int_range();
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        fn go<T: CudaElement, B: cudarc::driver::DeviceRepr>(
            s: &mut CudaStorage,
            l: &StridedLayout,
            n: usize,
            n64: &u64,
            bits: B,
        ) -> Result<()> {
            let dev = s.cuda_device().clone();
            let dst = s.data_mut::<T>("fill")?;
            let name = format!("fill_b{}", std::mem::size_of::<T>());
            launch!(dev, COPY, name, for_elements(n), dst, l, n64, &bits)
        }
        // The value's bits, rounded as the CPU's `from_f64` rounds.
        match self.dtype() {
            DType::F32 => go::<f32, u32>(self, &l, n, &n64, (v as f32).to_bits()),
            DType::F64 => go::<f64, u64>(self, &l, n, &n64, v.to_bits()),
            DType::F16 => go::<f16, u16>(self, &l, n, &n64, f16::from_f64(v).to_bits()),
            DType::BF16 => go::<bf16, u16>(self, &l, n, &n64, bf16::from_f64(v).to_bits()),
            DType::I64 => go::<i64, u64>(self, &l, n, &n64, (v as i64) as u64),
            DType::U8 => go::<u8, u8>(self, &l, n, &n64, v as u8),
            DType::I8 => go::<i8, u8>(self, &l, n, &n64, crate::cpu::storage::quantize_i8(v) as u8),
        }
    }

    fn copy_from(&mut self, layout: &Layout, src: (&Self, &Layout)) -> Result<()> {
        let op = "copy_from";
        if src.0.dtype() != self.dtype() {
            return Err(TensorError::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: src.0.dtype(),
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
        let dev = self.cuda_device().clone();
        any_dispatch!(self.dtype(), T => {
            let s = Self::source_view::<T>(op, src, n)?;
            let d = self.data_mut::<T>(op)?;
            let name = format!("scatter_b{}", std::mem::size_of::<T>());
            launch!(dev, COPY, name, for_elements(n), d, &s, &l, &n64)
        })
    }

    fn add_scaled_assign(&mut self, layout: &Layout, src: (&Self, &Layout), scale: f64) -> Result<()> {
        let op = "add_scaled_assign";
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        self.check_extent(op, layout)?;
        src.0.check_extent(op, src.1)?;
        let l = StridedLayout::of(op, layout)?;
        let n64 = n as u64;
        let dev = self.cuda_device().clone();
        float_dispatch!(op, self.dtype(), T => {
            let s = Self::source_view::<T>(op, src, n)?;
            let d = self.data_mut::<T>(op)?;
            let scale = <T as CudaFloat>::from_f64(scale);
            let name = format!("scaled_add_{}", T::SUFFIX);
            launch!(dev, COPY, name, for_elements(n), d, &s, &l, &n64, &scale)
        })
    }

    /// The arithmetic of `Sgd::step` in `crates/autograd/src/optim.rs`, rounding for rounding.
    fn sgd_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        momentum_buffer: Option<(&mut Self, &Layout)>,
        s: &SgdScalars,
    ) -> Result<()> {
        self.launch_sgd_step(layout, grad, momentum_buffer, s)
    }

    /// The arithmetic of `AdamW::step` in `crates/autograd/src/optim.rs`, rounding for rounding.
    fn adamw_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        m: (&mut Self, &Layout),
        v: (&mut Self, &Layout),
        s: &AdamWScalars,
    ) -> Result<()> {
        self.launch_adamw_step(layout, grad, m, v, s)
    }
}

#[cfg(test)]
mod kernel_names;
