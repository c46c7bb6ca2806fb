//! Launch wrappers for every kernel the MLP and GPT need, shaped after the backend
//! contract (`crates/tensor/src/backend.rs` on the device-seam branch): each takes its
//! storages with their layouts and returns a fresh contiguous storage, or updates one in
//! place. Inputs the contract calls "contiguous" may start at an offset (a gradient is a
//! view into a flat DDP bucket); the wrappers slice there instead of copying.

use std::sync::Arc;

use cudarc::driver::CudaView;

use super::device::{fault, CudaDevice};
use super::element::{CudaElement, CudaFloat};
use super::launch::{for_elements, for_rows, single_block, StridedLayout};
use super::nvrtc::{ELEMENTWISE, NN, OPTIM, REDUCE};
use super::storage::{launch, CudaStorage};
use crate::{DType, Layout, Result, TensorError};

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

    /// Reads the bad-index flag of an indexed kernel: the smallest row whose index was out
    /// of range, if any (a 8-byte read that waits for the stream).
    fn check_bad_index(&self, op: &'static str, flag: &cudarc::driver::CudaSlice<u64>, bound: usize) -> Result<()> {
        let v = self
            .dev()
            .stream()
            .clone_dtoh(flag)
            .map_err(|e| fault(self.device(), "reading the index check", e))?;
        match v.first() {
            Some(&r) if r != u64::MAX => Err(TensorError::OutOfRange {
                op,
                msg: format!("the index at position {r} is outside 0..{bound}"),
            }),
            _ => Ok(()),
        }
    }

    fn bad_index_flag(&self) -> Result<cudarc::driver::CudaSlice<u64>> {
        self.dev()
            .stream()
            .clone_htod(&[u64::MAX])
            .map_err(|e| fault(self.device(), "allocating the index check", e))
    }

    /// Elementwise kernel `name` of `elementwise.cu` (`neg`, `exp`, `ln`, `sqrt`, `relu`,
    /// `gelu`, `sqr`, `affine` with `p0 = mul, p1 = add`, `powf` with `p0 = p`, `is_zero`)
    /// over the view (any layout); the scalars are rounded to the dtype first.
    pub fn unary_kernel(&self, layout: &Layout, name: &'static str, p0: f64, p1: f64) -> Result<Self> {
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

    /// Broadcasting binary kernel `name` of `elementwise.cu` (`add`, `sub`, `mul`, `div`,
    /// `relu_backward`, `gelu_backward`): both layouts (any layout) already broadcast to one
    /// shape; the output is contiguous of that shape.
    pub fn binary_kernel(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, name: &'static str) -> Result<Self> {
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

    /// Sum (`max == false`) or maximum over `dims` (sorted, distinct; none: a copy) of the
    /// view (any layout): the reduced dims are permuted last and gathered, then one block
    /// reduces each row. The output is contiguous over the kept dims.
    pub fn reduce(&self, layout: &Layout, dims: &[usize], max: bool) -> Result<Self> {
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
        let gathered = if cols == 0 {
            None
        } else {
            Some(self.copy_strided(&layout.permute(&perm)?)?)
        };
        float_dispatch!(op, self.dtype(), T => {
            let mut out = Self::alloc::<T>(self.dev(), rows)?;
            let (r64, c64) = (rows as u64, cols as u64);
            let name = format!("{op}_rows_{}", T::SUFFIX);
            match &gathered {
                Some(g) => launch!(self.dev(), REDUCE, name, for_rows(rows), g.data::<T>(op)?, &mut out, &r64, &c64)?,
                // nothing to reduce: the kernels still write each row's identity (0 or -inf)
                None => {
                    let dummy = Self::alloc::<T>(self.dev(), 1)?;
                    launch!(self.dev(), REDUCE, name, for_rows(rows), &dummy, &mut out, &r64, &c64)?
                }
            }
            Ok(Self::from_slice(self.dev(), out))
        })
    }

    fn rows_of(layout: &Layout, op: &'static str) -> Result<(usize, usize)> {
        let d = *layout.shape().last().ok_or(TensorError::Invalid {
            op,
            msg: "needs rank >= 1".into(),
        })?;
        Ok((if d == 0 { 0 } else { layout.numel() / d }, d))
    }

    /// Softmax (or log-softmax) of each row of the last axis (contiguous view).
    pub fn softmax_last(&self, layout: &Layout, log: bool) -> Result<Self> {
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

    /// Backward of [`CudaStorage::softmax_last`] from its output `y` (self) and gradient `g`.
    pub fn softmax_backward(&self, layout: &Layout, g: &Self, g_layout: &Layout, log: bool) -> Result<Self> {
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

    /// Layer norm of each row of `x` (self) with `[d]` weight and bias; returns
    /// `(y, mean [rows], rstd [rows])`.
    pub fn layer_norm(
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

    /// Gradients `(dx, dweight, dbias)` of [`CudaStorage::layer_norm`] from `x` (self),
    /// the weight, the saved mean and rstd, and the output gradient.
    pub fn layer_norm_backward(
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
            let mut dw = Self::alloc::<T>(self.dev(), d)?;
            let mut db = Self::alloc::<T>(self.dev(), d)?;
            let (r64, d64) = (rows as u64, d as u64);
            let name = format!("layer_norm_backward_dx_{}", T::SUFFIX);
            launch!(self.dev(), NN, name, for_rows(rows), &x, &w, &g, &m, &r, &mut dx, &r64, &d64)?;
            let name = format!("layer_norm_backward_dwdb_{}", T::SUFFIX);
            launch!(self.dev(), NN, name, for_elements(d), &x, &g, &m, &r, &mut dw, &mut db, &r64, &d64)?;
            Ok((Self::from_slice(self.dev(), dx), Self::from_slice(self.dev(), dw), Self::from_slice(self.dev(), db)))
        })
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

    /// Rows of the `[vocab, d]` table (self) picked by `ids` (I64/U8): `[ids.numel(), d]`.
    pub fn embedding(&self, layout: &Layout, ids: (&Self, &Layout)) -> Result<Self> {
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
            let mut bad = self.bad_index_flag()?;
            let (n64, v64, d64) = (n_ids as u64, vocab as u64, d as u64);
            let name = format!("embedding_{}_{isuf}", T::SUFFIX);
            match isuf {
                "i64" => {
                    let iv = ids.0.contiguous_view::<i64>(op, ids.1)?;
                    launch!(self.dev(), NN, name, for_elements(n_ids * d), &w, &iv, &mut out, &mut bad, &n64, &v64, &d64)?
                }
                _ => {
                    let iv = ids.0.contiguous_view::<u8>(op, ids.1)?;
                    launch!(self.dev(), NN, name, for_elements(n_ids * d), &w, &iv, &mut out, &mut bad, &n64, &v64, &d64)?
                }
            }
            self.check_bad_index(op, &bad, vocab)?;
            Ok(Self::from_slice(self.dev(), out))
        })
    }

    /// Scatter-add of the gradient rows (self, `[ids.numel(), d]`) into a zeroed
    /// `[vocab, d]` table; repeated ids add up in an unspecified order (atomics).
    pub fn embedding_backward(&self, layout: &Layout, ids: (&Self, &Layout), vocab: usize) -> Result<Self> {
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
            let mut table = Self::alloc_zeros::<T>(self.dev(), (vocab * d).max(1))?;
            if n_ids * d > 0 {
                let g = self.contiguous_view::<T>(op, layout)?;
                let mut bad = self.bad_index_flag()?;
                let (n64, v64, d64) = (n_ids as u64, vocab as u64, d as u64);
                let name = format!("embedding_backward_{}_{isuf}", T::SUFFIX);
                match isuf {
                    "i64" => {
                        let iv = ids.0.contiguous_view::<i64>(op, ids.1)?;
                        launch!(self.dev(), NN, name, for_elements(n_ids * d), &iv, &g, &mut table, &mut bad, &n64, &v64, &d64)?
                    }
                    _ => {
                        let iv = ids.0.contiguous_view::<u8>(op, ids.1)?;
                        launch!(self.dev(), NN, name, for_elements(n_ids * d), &iv, &g, &mut table, &mut bad, &n64, &v64, &d64)?
                    }
                }
                self.check_bad_index(op, &bad, vocab)?;
            }
            if vocab * d == 0 {
                return Ok(self.empty_like());
            }
            Ok(Self::from_slice(self.dev(), table))
        })
    }

    /// `[.., t, s]` scores (any layout) with key `j > i + (s - t)` of query `i` set to
    /// `value`, as a new contiguous storage.
    pub fn causal_fill(&self, layout: &Layout, value: f64) -> Result<Self> {
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

    /// Mean cross-entropy of `[n, c]` logits (self) against `n` targets (I64/U8): returns
    /// `(loss, probs)`, the loss accumulated in f64 over the rows as on the CPU.
    pub fn cross_entropy(&self, layout: &Layout, targets: (&Self, &Layout)) -> Result<(Self, Self)> {
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
            let mut bad = self.bad_index_flag()?;
            let (n64, c64) = (n as u64, c as u64);
            let name = format!("cross_entropy_rows_{}_{isuf}", T::SUFFIX);
            match isuf {
                "i64" => {
                    let iv = targets.0.contiguous_view::<i64>(op, targets.1)?;
                    launch!(self.dev(), NN, name, for_rows(n), &x, &iv, &mut probs, &mut loss_rows, &mut bad, &n64, &c64)?
                }
                _ => {
                    let iv = targets.0.contiguous_view::<u8>(op, targets.1)?;
                    launch!(self.dev(), NN, name, for_rows(n), &x, &iv, &mut probs, &mut loss_rows, &mut bad, &n64, &c64)?
                }
            }
            self.check_bad_index(op, &bad, c)?;
            let divisor = n.max(1) as f64;
            launch!(self.dev(), NN, format!("mean_f64_{}", T::SUFFIX), single_block(), &loss_rows, &mut loss, &n64, &divisor)?;
            Ok((Self::from_slice(self.dev(), loss), Self::from_slice(self.dev(), probs)))
        })
    }

    /// Gradient of [`CudaStorage::cross_entropy`] from `probs` (self, `[n, c]`):
    /// `(probs - onehot(targets)) * (g / max(n, 1))`.
    pub fn cross_entropy_backward(&self, layout: &Layout, targets: (&Self, &Layout), g: f64) -> Result<Self> {
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
            let mut out = Self::alloc::<T>(self.dev(), n * c)?;
            let (n64, c64, scale) = (n as u64, c as u64, T::from_f64(g / n.max(1) as f64));
            let name = format!("cross_entropy_backward_{}_{isuf}", T::SUFFIX);
            match isuf {
                "i64" => {
                    let iv = targets.0.contiguous_view::<i64>(op, targets.1)?;
                    launch!(self.dev(), NN, name, for_elements(n * c), &p, &iv, &mut out, &n64, &c64, &scale)?
                }
                _ => {
                    let iv = targets.0.contiguous_view::<u8>(op, targets.1)?;
                    launch!(self.dev(), NN, name, for_elements(n * c), &p, &iv, &mut out, &n64, &c64, &scale)?
                }
            }
            Ok(Self::from_slice(self.dev(), out))
        })
    }

    /// One fused SGD update of an f32 parameter (self, contiguous view) from its gradient,
    /// with the momentum buffer when given: the arithmetic of `Sgd::step` in
    /// `crates/autograd/src/optim.rs`, rounding for rounding.
    #[allow(clippy::too_many_arguments)]
    pub fn sgd_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        momentum_buffer: Option<(&mut Self, &Layout)>,
        lr: f32,
        momentum: f32,
        weight_decay: f32,
        is_first_step: bool,
    ) -> Result<()> {
        let op = "sgd_step";
        if self.dtype() != DType::F32 {
            return Err(float_only(op, self.dtype()));
        }
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        let dev = self.dev().clone();
        let g = grad.0.contiguous_view::<f32>(op, grad.1)?;
        let mode: i32 = match (&momentum_buffer, is_first_step) {
            (None, _) => 0,
            (Some(_), true) => 1,
            (Some(_), false) => 2,
        };
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

    /// One fused AdamW update of an f32 parameter (self) and its moments `m`, `v`: the
    /// arithmetic of `AdamW::step` in `crates/autograd/src/optim.rs`, rounding for rounding.
    /// `scalars` = `[decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size,
    /// bias_correction2_sqrt, eps]`, each already rounded to f32 by the front end.
    pub fn adamw_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        m: (&mut Self, &Layout),
        v: (&mut Self, &Layout),
        scalars: [f32; 8],
    ) -> Result<()> {
        let op = "adamw_step";
        if self.dtype() != DType::F32 {
            return Err(float_only(op, self.dtype()));
        }
        let n = layout.numel();
        if n == 0 {
            return Ok(());
        }
        let [decay, beta1, omb1, beta2, omb2, step_size, bc2_sqrt, eps] = scalars;
        let dev = self.dev().clone();
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
            &beta1,
            &beta2,
            &omb1,
            &omb2,
            &step_size,
            &bc2_sqrt,
            &eps,
            &decay
        )
    }
}
