//! The optimizers' fused steps behind the device contract (`optim.cu`), rounding for rounding
//! as `crates/autograd/src/optim.rs` computes them on the CPU.

use super::super::launch::for_elements;
use super::super::nvrtc::OPTIM;
use super::super::storage::{launch, CudaStorage};
use super::float_only;
use crate::backend::{AdamWScalars, SgdScalars};
use crate::{DType, Layout, Result, TensorError};

impl CudaStorage {
    /// The arithmetic of `Sgd::step` in `crates/autograd/src/optim.rs`, rounding for rounding.
    pub(super) fn launch_sgd_step(
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
    pub(super) fn launch_adamw_step(
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
