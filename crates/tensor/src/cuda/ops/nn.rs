//! The layers' kernels behind the device contract (`nn.cu`): softmax, layer norm, embedding,
//! the causal mask, cross-entropy, forward and backward, in f32, f64, f16 and bf16 (the 16-bit
//! storages computed in f32, each output rounded once).

use super::super::element::{CudaElement, CudaFloat};
use super::super::launch::{for_column_chunks, for_elements, for_rows, single_block, COL_CHUNK};
use super::super::nvrtc::NN;
use super::super::storage::{launch, CudaStorage};
use super::float_only;
use crate::backend::{BackendStorage, Nn};
use crate::{DType, Layout, Result, TensorError};

impl Nn for CudaStorage {
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
            let (r64, d64, eps) = (rows as u64, d as u64, T::scalar(eps));
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
            // the partial rows in the compute type: only the column sums are rounded
            let mut pw = Self::alloc::<<T as CudaFloat>::Scalar>(self.dev(), parts * d)?;
            let mut pb = Self::alloc::<<T as CudaFloat>::Scalar>(self.dev(), parts * d)?;
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
        if matches!(self.dtype(), DType::F16 | DType::BF16) {
            // repeated ids add up in f32 (the f32 kernel on the widened gradient), and the
            // table is rounded once, as on the CPU
            let wide = self.to_dtype(layout, DType::F32)?;
            let table = wide.embedding_backward(&Layout::contiguous(layout.shape()), ids, vocab)?;
            return table.to_dtype(&Layout::contiguous(&[vocab, d]), self.dtype());
        }
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
            let (n64, t64, s64, v) = (n as u64, t as u64, s as u64, T::element(value));
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
}
