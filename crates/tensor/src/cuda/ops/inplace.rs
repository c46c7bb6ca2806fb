//! In-place updates behind the device contract: fills, copies and gradient accumulation through
//! a view (`copy.cu`), and the optimizers' fused steps (`optim.cu`), rounding for rounding as
//! `crates/autograd/src/optim.rs` computes them on the CPU.

use half::{bf16, f16};

use super::super::element::{CudaElement, CudaFloat};
use super::super::launch::{for_elements, StridedLayout};
use super::super::nvrtc::{COPY, OPTIM};
use super::super::storage::{launch, CudaStorage};
use super::float_only;
use crate::backend::{AdamWScalars, InPlace, SgdScalars};
use crate::{DType, Layout, Result, TensorError};

impl InPlace for CudaStorage {
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
            DType::I8 => go::<i8, u8>(self, &l, n, &n64, brigade_dtype::quantize_i8(v) as u8),
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
            let scale = <T as CudaFloat>::scalar(scale);
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
