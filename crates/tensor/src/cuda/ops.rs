//! The device contract of `crate::backend` implemented by the CUDA storage: every method
//! launches its kernels (NVRTC, `kernels/*.cu`) or cuBLAS GEMMs (`gemm.rs`) on the current
//! stream of the device, and never waits on the host except `to_cpu`. Inputs the contract
//! calls "contiguous" may start at an offset (a gradient is a view into a flat DDP bucket):
//! the wrappers slice there instead of copying.

use std::sync::Arc;

use cudarc::driver::CudaView;
use half::{bf16, f16};

use super::device::CudaDevice;
use super::element::{CudaElement, CudaFloat};
use super::launch::{for_column_chunks, for_elements, for_rows, single_block, StridedLayout, COL_CHUNK};
use super::nvrtc::{COPY, ELEMENTWISE, NN, OPTIM, REDUCE};
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
        let op = if log { "log_softmax" } else { "softmax" };
        let (rows, d) = Self::rows_of(layout, op)?;
        if rows * d == 0 {
            return Ok(self.empty_like());
        }
        float_dispatch!(op, self.dtype(), T => {
            let x = self.contiguous_view::<T>(op, layout)?;
            let mut out = Self::alloc::<T>(self.dev(), rows * d)?;
            let (r64, d64, flag) = (rows as u64, d as u64, log as i32);
            launch!(self.dev(), NN, format!("softmax_rows_{}", T::SUFFIX), for_rows(rows), &x, &mut out, &r64, &d64, &flag)?;
            Ok(Self::from_slice(self.dev(), out))
        })
    }

    fn softmax_backward(&self, layout: &Layout, g: &Self, g_layout: &Layout, log: bool) -> Result<Self> {
        let op = if log {
            "log_softmax_backward"
        } else {
            "softmax_backward"
        };
        let (rows, d) = Self::rows_of(layout, op)?;
        if rows * d == 0 {
            return Ok(self.empty_like());
        }
        float_dispatch!(op, self.dtype(), T => {
            let (y, gv) = (self.contiguous_view::<T>(op, layout)?, g.contiguous_view::<T>(op, g_layout)?);
            let mut out = Self::alloc::<T>(self.dev(), rows * d)?;
            let (r64, d64, flag) = (rows as u64, d as u64, log as i32);
            let name = format!("softmax_backward_rows_{}", T::SUFFIX);
            launch!(self.dev(), NN, name, for_rows(rows), &y, &gv, &mut out, &r64, &d64, &flag)?;
            Ok(Self::from_slice(self.dev(), out))
        })
    }

    fn layer_norm(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        bias: (&Self, &Layout),
        eps: f64,
    ) -> Result<(Self, Self, Self)> {
        let op = "layer_norm";
        let (rows, d) = Self::rows_of(layout, op)?;
        if rows * d == 0 {
            return Ok((
                self.empty_like(),
                Self::zeros(self.dev(), self.dtype(), rows)?,
                Self::zeros(self.dev(), self.dtype(), rows)?,
            ));
        }
        float_dispatch!(op, self.dtype(), T => {
            let x = self.contiguous_view::<T>(op, layout)?;
            let (w, b) = (weight.0.contiguous_view::<T>(op, weight.1)?, bias.0.contiguous_view::<T>(op, bias.1)?);
            let mut y = Self::alloc::<T>(self.dev(), rows * d)?;
            let mut mean = Self::alloc::<T>(self.dev(), rows)?;
            let mut rstd = Self::alloc::<T>(self.dev(), rows)?;
            let (r64, d64, eps) = (rows as u64, d as u64, T::from_f64(eps));
            let name = format!("layer_norm_rows_{}", T::SUFFIX);
            launch!(self.dev(), NN, name, for_rows(rows), &x, &w, &b, &mut y, &mut mean, &mut rstd, &r64, &d64, &eps)?;
            Ok((Self::from_slice(self.dev(), y), Self::from_slice(self.dev(), mean), Self::from_slice(self.dev(), rstd)))
        })
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
        let op = "layer_norm_backward";
        let (rows, d) = Self::rows_of(layout, op)?;
        let dtype = self.dtype();
        if rows * d == 0 {
            return Ok((
                self.empty_like(),
                Self::zeros(self.dev(), dtype, d)?,
                Self::zeros(self.dev(), dtype, d)?,
            ));
        }
        float_dispatch!(op, dtype, T => {
            let x = self.contiguous_view::<T>(op, layout)?;
            let w = weight.0.contiguous_view::<T>(op, weight.1)?;
            let m = mean.0.contiguous_view::<T>(op, mean.1)?;
            let r = rstd.0.contiguous_view::<T>(op, rstd.1)?;
            let g = gy.0.contiguous_view::<T>(op, gy.1)?;
            let mut dx = Self::alloc::<T>(self.dev(), rows * d)?;
            let (r64, d64) = (rows as u64, d as u64);
            let name = format!("layer_norm_backward_dx_{}", T::SUFFIX);
            launch!(self.dev(), NN, name, for_rows(rows), &x, &w, &g, &m, &r, &mut dx, &r64, &d64)?;
            let parts = rows.div_ceil(COL_CHUNK).clamp(1, 65535);
            let mut pw = Self::alloc::<T>(self.dev(), parts * d)?;
            let mut pb = Self::alloc::<T>(self.dev(), parts * d)?;
            let name = format!("layer_norm_dwdb_partial_{}", T::SUFFIX);
            launch!(self.dev(), NN, name, for_column_chunks(d, parts), &x, &g, &m, &r, &mut pw, &mut pb, &r64, &d64)?;
            let mut dw = Self::alloc::<T>(self.dev(), d)?;
            let mut db = Self::alloc::<T>(self.dev(), d)?;
            let (p64, name) = (parts as u64, format!("column_sum_{}", T::SUFFIX));
            launch!(self.dev(), NN, name, for_elements(d), &pw, &mut dw, &p64, &d64)?;
            launch!(self.dev(), NN, name, for_elements(d), &pb, &mut db, &p64, &d64)?;
            Ok((Self::from_slice(self.dev(), dx), Self::from_slice(self.dev(), dw), Self::from_slice(self.dev(), db)))
        })
    }

    fn embedding(&self, layout: &Layout, ids: (&Self, &Layout)) -> Result<Self> {
        let op = "embedding";
        let (vocab, d) = match layout.shape() {
            &[v, d] => (v, d),
            s => {
                return Err(TensorError::Invalid {
                    op,
                    msg: format!("table must be [vocab, d], got {s:?}"),
                })
            }
        };
        let n_ids = ids.1.numel();
        if n_ids * d == 0 {
            return Ok(self.empty_like());
        }
        let isuf = Self::index_suffix(op, ids.0)?;
        float_dispatch!(op, self.dtype(), T => {
            let w = self.contiguous_view::<T>(op, layout)?;
            let mut out = Self::alloc::<T>(self.dev(), n_ids * d)?;
            let (n64, v64, d64) = (n_ids as u64, vocab as u64, d as u64);
            let name = format!("embedding_{}_{isuf}", T::SUFFIX);
            match isuf {
                "i64" => {
                    let iv = ids.0.contiguous_view::<i64>(op, ids.1)?;
                    launch!(self.dev(), NN, name, for_elements(n_ids * d), &w, &iv, &mut out, &n64, &v64, &d64)?
                }
                _ => {
                    let iv = ids.0.contiguous_view::<u8>(op, ids.1)?;
                    launch!(self.dev(), NN, name, for_elements(n_ids * d), &w, &iv, &mut out, &n64, &v64, &d64)?
                }
            }
            Ok(Self::from_slice(self.dev(), out))
        })
    }

    fn embedding_backward(&self, layout: &Layout, ids: (&Self, &Layout), vocab: usize) -> Result<Self> {
        let op = "embedding_backward";
        let d = *layout.shape().last().ok_or(TensorError::Invalid {
            op,
            msg: "needs rank >= 1".into(),
        })?;
        let n_ids = ids.1.numel();
        if n_ids * d != layout.numel() {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: ids.1.shape().to_vec(),
                rhs: layout.shape().to_vec(),
            });
        }
        let isuf = Self::index_suffix(op, ids.0)?;
        float_dispatch!(op, self.dtype(), T => {
            if vocab * d == 0 {
                return Ok(self.empty_like());
            }
            let mut table = Self::alloc_zeros::<T>(self.dev(), vocab * d)?;
            if n_ids * d > 0 {
                let g = self.contiguous_view::<T>(op, layout)?;
                let (n64, v64, d64) = (n_ids as u64, vocab as u64, d as u64);
                let name = format!("embedding_backward_{}_{isuf}", T::SUFFIX);
                match isuf {
                    "i64" => {
                        let iv = ids.0.contiguous_view::<i64>(op, ids.1)?;
                        launch!(self.dev(), NN, name, for_elements(n_ids * d), &iv, &g, &mut table, &n64, &v64, &d64)?
                    }
                    _ => {
                        let iv = ids.0.contiguous_view::<u8>(op, ids.1)?;
                        launch!(self.dev(), NN, name, for_elements(n_ids * d), &iv, &g, &mut table, &n64, &v64, &d64)?
                    }
                }
            }
            Ok(Self::from_slice(self.dev(), table))
        })
    }

    fn causal_fill(&self, layout: &Layout, value: f64) -> Result<Self> {
        let op = "causal_mask";
        let r = layout.rank();
        if r < 2 || layout.shape()[r - 2] > layout.shape()[r - 1] {
            return Err(TensorError::Invalid {
                op,
                msg: format!("needs [.., T, S] with T <= S, got {:?}", layout.shape()),
            });
        }
        let (t, s) = (layout.shape()[r - 2], layout.shape()[r - 1]);
        let mut out = self.copy_strided(layout)?;
        let n = layout.numel();
        if n == 0 {
            return Ok(out);
        }
        float_dispatch!(op, self.dtype(), T => {
            let dev = self.dev().clone();
            let x = out.data_mut::<T>(op)?;
            let (n64, t64, s64, v) = (n as u64, t as u64, s as u64, T::from_f64(value));
            launch!(dev, NN, format!("causal_fill_{}", T::SUFFIX), for_elements(n), x, &n64, &t64, &s64, &v)?;
            Ok(())
        })?;
        Ok(out)
    }

    /// The loss is accumulated in f64 over the rows, as on the CPU.
    fn cross_entropy(&self, layout: &Layout, targets: (&Self, &Layout)) -> Result<(Self, Self)> {
        let op = "cross_entropy";
        let (n, c) = match layout.shape() {
            &[n, c] => (n, c),
            s => {
                return Err(TensorError::Invalid {
                    op,
                    msg: format!("logits must be [n, c], got {s:?}"),
                })
            }
        };
        let isuf = Self::index_suffix(op, targets.0)?;
        float_dispatch!(op, self.dtype(), T => {
            let mut loss = Self::alloc_zeros::<T>(self.dev(), 1)?;
            if n * c == 0 {
                return Ok((Self::from_slice(self.dev(), loss), self.empty_like()));
            }
            let x = self.contiguous_view::<T>(op, layout)?;
            let mut probs = Self::alloc::<T>(self.dev(), n * c)?;
            let mut loss_rows = Self::alloc::<T>(self.dev(), n)?;
            let (n64, c64) = (n as u64, c as u64);
            let name = format!("cross_entropy_rows_{}_{isuf}", T::SUFFIX);
            match isuf {
                "i64" => {
                    let iv = targets.0.contiguous_view::<i64>(op, targets.1)?;
                    launch!(self.dev(), NN, name, for_rows(n), &x, &iv, &mut probs, &mut loss_rows, &n64, &c64)?
                }
                _ => {
                    let iv = targets.0.contiguous_view::<u8>(op, targets.1)?;
                    launch!(self.dev(), NN, name, for_rows(n), &x, &iv, &mut probs, &mut loss_rows, &n64, &c64)?
                }
            }
            let divisor = n.max(1) as f64;
            launch!(self.dev(), NN, format!("mean_f64_{}", T::SUFFIX), single_block(), &loss_rows, &mut loss, &n64, &divisor)?;
            Ok((Self::from_slice(self.dev(), loss), Self::from_slice(self.dev(), probs)))
        })
    }

    fn cross_entropy_backward(&self, layout: &Layout, targets: (&Self, &Layout), g: (&Self, &Layout)) -> Result<Self> {
        let op = "cross_entropy_backward";
        let (n, c) = match layout.shape() {
            &[n, c] => (n, c),
            s => {
                return Err(TensorError::Invalid {
                    op,
                    msg: format!("probs must be [n, c], got {s:?}"),
                })
            }
        };
        if n * c == 0 {
            return Ok(self.empty_like());
        }
        let isuf = Self::index_suffix(op, targets.0)?;
        float_dispatch!(op, self.dtype(), T => {
            let p = self.contiguous_view::<T>(op, layout)?;
            let gv = g.0.contiguous_view::<T>(op, g.1)?;
            let mut out = Self::alloc::<T>(self.dev(), n * c)?;
            // the kernel computes scale = g / divisor in f64 from the device scalar
            let (n64, c64, divisor) = (n as u64, c as u64, n.max(1) as f64);
            let name = format!("cross_entropy_backward_{}_{isuf}", T::SUFFIX);
            match isuf {
                "i64" => {
                    let iv = targets.0.contiguous_view::<i64>(op, targets.1)?;
                    launch!(self.dev(), NN, name, for_elements(n * c), &p, &iv, &gv, &mut out, &n64, &c64, &divisor)?
                }
                _ => {
                    let iv = targets.0.contiguous_view::<u8>(op, targets.1)?;
                    launch!(self.dev(), NN, name, for_elements(n * c), &p, &iv, &gv, &mut out, &n64, &c64, &divisor)?
                }
            }
            Ok(Self::from_slice(self.dev(), out))
        })
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
        let op = "sgd_step";
        if self.dtype() != DType::F32 {
            return Err(float_only(op, self.dtype()));
        }
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        let dev = self.cuda_device().clone();
        let g = grad.0.contiguous_view::<f32>(op, grad.1)?;
        let mode: i32 = match (&momentum_buffer, s.is_first_step) {
            (None, _) => 0,
            (Some(_), true) => 1,
            (Some(_), false) => 2,
        };
        let (lr, momentum, weight_decay) = (s.lr, s.momentum, s.weight_decay);
        let (start, n64) = (layout.offset(), n as u64);
        let mut p = self
            .data_mut::<f32>(op)?
            .try_slice_mut(start..start + n)
            .ok_or(TensorError::OutOfRange {
                op,
                msg: format!("parameter view at {start} + {n} outside its storage"),
            })?;
        let name = "sgd_step_f32";
        match momentum_buffer {
            Some((buf, bl)) => {
                let bs = bl.offset();
                let mut b = buf
                    .data_mut::<f32>(op)?
                    .try_slice_mut(bs..bs + n)
                    .ok_or(TensorError::OutOfRange {
                        op,
                        msg: format!("momentum buffer view at {bs} + {n} outside its storage"),
                    })?;
                launch!(
                    dev,
                    OPTIM,
                    name,
                    for_elements(n),
                    &mut p,
                    &g,
                    &mut b,
                    &n64,
                    &lr,
                    &momentum,
                    &weight_decay,
                    &mode
                )
            }
            None => {
                // The kernel never touches the buffer in mode 0: a null pointer stands in.
                let null: u64 = 0;
                launch!(
                    dev,
                    OPTIM,
                    name,
                    for_elements(n),
                    &mut p,
                    &g,
                    &null,
                    &n64,
                    &lr,
                    &momentum,
                    &weight_decay,
                    &mode
                )
            }
        }
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
        let op = "adamw_step";
        if self.dtype() != DType::F32 {
            return Err(float_only(op, self.dtype()));
        }
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        let dev = self.cuda_device().clone();
        let g = grad.0.contiguous_view::<f32>(op, grad.1)?;
        let range = |l: &Layout| l.offset()..l.offset() + n;
        let oob = |what: &str| TensorError::OutOfRange {
            op,
            msg: format!("{what} view outside its storage"),
        };
        let mut p = self
            .data_mut::<f32>(op)?
            .try_slice_mut(range(layout))
            .ok_or_else(|| oob("parameter"))?;
        let mut mv =
            m.0.data_mut::<f32>(op)?
                .try_slice_mut(range(m.1))
                .ok_or_else(|| oob("exp_avg"))?;
        let mut vv =
            v.0.data_mut::<f32>(op)?
                .try_slice_mut(range(v.1))
                .ok_or_else(|| oob("exp_avg_sq"))?;
        let n64 = n as u64;
        launch!(
            dev,
            OPTIM,
            "adamw_step_f32",
            for_elements(n),
            &mut p,
            &g,
            &mut mv,
            &mut vv,
            &n64,
            &s.beta1,
            &s.beta2,
            &s.one_minus_beta1,
            &s.one_minus_beta2,
            &s.step_size,
            &s.bias_correction2_sqrt,
            &s.eps,
            &s.decay
        )
    }
}

/// Every kernel name a launch above can ask for is in its file's compiled CUBIN: a name typo
/// would otherwise first show on a GPU. Needs NVRTC (CI has it; elsewhere the test says it
/// skipped).
#[cfg(test)]
mod kernel_names {
    use super::super::nvrtc::{self, KernelFile, COPY, ELEMENTWISE, LINK, NN, OPTIM, REDUCE};
    use super::{binary_kernel, unary_kernel};
    use crate::backend::{BinaryOp, UnaryOp};

    fn has_symbol(cubin: &[u8], name: &str) -> bool {
        let needle: Vec<u8> = [&[0u8][..], name.as_bytes(), &[0u8][..]].concat();
        cubin.windows(needle.len()).any(|w| w == needle.as_slice())
    }

    #[test]
    fn every_launched_kernel_exists_in_its_cubin() {
        if !super::super::probe::nvrtc_present() {
            crate::testing::report_skip("cuda::ops::kernel_names", &"libnvrtc is not on LD_LIBRARY_PATH");
            return;
        }
        let floats = ["f32", "f64"];
        let all = ["f32", "f64", "f16", "bf16", "i64", "u8", "i8"];
        let mut want: Vec<(KernelFile, String)> = vec![];
        let unary = [
            UnaryOp::Neg,
            UnaryOp::Exp,
            UnaryOp::Ln,
            UnaryOp::Sqrt,
            UnaryOp::Relu,
            UnaryOp::Gelu,
            UnaryOp::Sqr,
            UnaryOp::Affine { mul: 1.0, add: 0.0 },
            UnaryOp::Powf(2.0),
        ];
        let binary = [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::ReluBackward,
            BinaryOp::GeluBackward,
        ];
        for t in floats {
            want.extend(
                unary
                    .iter()
                    .map(|&op| (ELEMENTWISE, format!("{}_{t}", unary_kernel(op).0))),
            );
            want.extend(
                binary
                    .iter()
                    .map(|&op| (ELEMENTWISE, format!("{}_{t}", binary_kernel(op)))),
            );
            want.push((COPY, format!("scaled_add_{t}")));
            for k in ["sum_rows", "max_rows"] {
                want.push((REDUCE, format!("{k}_{t}")));
            }
            for k in [
                "softmax_rows",
                "softmax_backward_rows",
                "layer_norm_rows",
                "layer_norm_backward_dx",
                "layer_norm_dwdb_partial",
                "column_sum",
                "causal_fill",
                "mean_f64",
            ] {
                want.push((NN, format!("{k}_{t}")));
            }
            for i in ["i64", "u8"] {
                for k in [
                    "embedding",
                    "embedding_backward",
                    "cross_entropy_rows",
                    "cross_entropy_backward",
                ] {
                    want.push((NN, format!("{k}_{t}_{i}")));
                }
            }
        }
        for b in [1, 2, 4, 8] {
            for k in ["gather", "fill", "scatter"] {
                want.push((COPY, format!("{k}_b{b}")));
            }
        }
        for s in all {
            for d in all {
                want.push((COPY, format!("cast_{s}_{d}")));
            }
        }
        want.push((OPTIM, "sgd_step_f32".into()));
        want.push((OPTIM, "adamw_step_f32".into()));
        want.push((LINK, "spin_ns".into()));
        let mut missing = vec![];
        for file in nvrtc::KERNEL_FILES {
            let cubin = nvrtc::compile(file, "sm_80").expect("compiles").cubin;
            for (f, name) in &want {
                if f.name == file.name && !has_symbol(&cubin, name) {
                    missing.push(format!("{name} in {}", file.name));
                }
            }
        }
        assert!(missing.is_empty(), "kernels launched but not compiled: {missing:?}");
        assert!(!has_symbol(
            &nvrtc::compile(LINK, "sm_80").unwrap().cubin,
            "no_such_kernel"
        ));
    }
}
