//! In-place updates through a view: gradient accumulation, zeroing, copies, and the fused
//! optimizer updates (one op per parameter that reads its gradient and updates the parameter
//! and the optimizer state in place, on the parameter's device, so optimizers never touch host
//! memory). The backend's half is the contract's `InPlace`.

use super::{compute_dtype, same_device, same_dtype, same_shape};
use crate::backend::{AdamWScalars, SgdScalars};
use crate::storage::dispatch;
use crate::{DType, Result, Tensor, TensorError};

impl Tensor {
    /// `self += other` through this view (same shape and dtype).
    pub fn add_assign(&self, other: &Tensor) -> Result<()> {
        self.add_scaled_assign(other, 1.0)
    }

    /// `self += scale * other` through this view (same shape and dtype).
    pub fn add_scaled_assign(&self, other: &Tensor, scale: f64) -> Result<()> {
        let op = "add_assign";
        same_shape(op, self, other)?;
        same_dtype(op, self, other)?;
        compute_dtype(op, self)?;
        same_device(op, self, other)?;
        // `other` may share storage with `self`: gather it first so no read lock is held
        // while the write lock is taken.
        let src = if other.shares_storage(self) {
            other.copy()?
        } else {
            other.contiguous_for(op)?
        };
        let s = src.storage(op)?;
        dispatch!(&mut *self.storage_mut(op)?, d, other => d.add_scaled_assign(self.layout(), (other(&s)?, src.layout()), scale))
    }

    /// Overwrites this view's elements with `other`'s, bit for bit (same shape and dtype,
    /// any dtype).
    pub fn copy_from(&self, other: &Tensor) -> Result<()> {
        let op = "copy_from";
        same_shape(op, self, other)?;
        same_dtype(op, self, other)?;
        same_device(op, self, other)?;
        let src = if other.shares_storage(self) {
            other.copy()?
        } else {
            other.contiguous_for(op)?
        };
        let s = src.storage(op)?;
        dispatch!(&mut *self.storage_mut(op)?, d, other => d.copy_from(self.layout(), (other(&s)?, src.layout())))
    }

    /// Sets every element of this view to `v`.
    pub fn fill(&self, v: f64) -> Result<()> {
        dispatch!(&mut *self.storage_mut("fill")?, d => d.fill(self.layout(), v))
    }
}

/// Hyper-parameters of one SGD update (`torch.optim.SGD` with dampening 0, no Nesterov).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor; 0 means no momentum buffer.
    pub momentum: f64,
    /// L2 penalty added to the gradient (`g += weight_decay * p`).
    pub weight_decay: f64,
    /// True on the buffer's first update, which sets it to the gradient (PyTorch's
    /// `is_first_step` of its fused SGD) instead of decaying into it.
    pub is_first_step: bool,
}

/// Hyper-parameters of one AdamW update (`torch.optim.AdamW`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Term added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay (`p *= 1 - lr * weight_decay`).
    pub weight_decay: f64,
    /// The step number, 1 on the first update (for bias correction).
    pub step: u64,
}

impl AdamWStep {
    /// The f32 scalars every backend's kernel uses, derived in f64 exactly as PyTorch does.
    fn scalars(&self) -> AdamWScalars {
        let t = self.step as i32;
        let (beta1, beta2) = self.betas;
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        AdamWScalars {
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            step_size: (self.lr / bc1) as f32,
            bias_correction2_sqrt: bc2.sqrt() as f32,
            eps: self.eps as f32,
        }
    }
}

/// Checks one operand of a fused step: f32, the parameter's shape and device, a
/// contiguous view of its own storage.
fn check_state(op: &'static str, what: &str, p: &Tensor, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(TensorError::Invalid {
            op,
            msg: format!("{what} is {:?}; optimizer steps run in f32", t.dtype()),
        });
    }
    check_layout(op, what, p, t)
}

/// Checks that one operand of a fused step is laid out as the parameter: its shape and device,
/// a contiguous view of its own storage.
fn check_layout(op: &'static str, what: &str, p: &Tensor, t: &Tensor) -> Result<()> {
    same_shape(op, p, t)?;
    same_device(op, p, t)?;
    if !t.is_contiguous() {
        return Err(TensorError::Invalid {
            op,
            msg: format!("{what} must be a contiguous view"),
        });
    }
    Ok(())
}

fn distinct(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    for (i, a) in ts.iter().enumerate() {
        if ts[i + 1..].iter().any(|b| a.shares_storage(b)) {
            return Err(TensorError::Invalid {
                op,
                msg: "parameter, gradient and state must not share storage".into(),
            });
        }
    }
    Ok(())
}

impl Tensor {
    /// One fused SGD update of this parameter (f32, contiguous) from `grad`, in place on
    /// the parameter and on `momentum_buffer` (required iff `momentum != 0`):
    /// `g += wd * p; buf = momentum * buf + g (or g on the first step); p -= lr * buf`.
    pub fn sgd_step(&self, grad: &Tensor, momentum_buffer: Option<&Tensor>, hp: SgdStep) -> Result<()> {
        let op = "sgd_step";
        check_state(op, "the parameter", self, self)?;
        check_state(op, "the gradient", self, grad)?;
        let s = SgdScalars {
            lr: hp.lr as f32,
            momentum: hp.momentum as f32,
            weight_decay: hp.weight_decay as f32,
            is_first_step: hp.is_first_step,
        };
        if (s.momentum != 0.0) != momentum_buffer.is_some() {
            return Err(TensorError::Invalid {
                op,
                msg: "a momentum buffer goes with a nonzero momentum, and only then".into(),
            });
        }
        let mut operands = vec![self, grad];
        if let Some(b) = momentum_buffer {
            check_state(op, "the momentum buffer", self, b)?;
            operands.push(b);
        }
        distinct(op, &operands)?;
        let g = grad.storage(op)?;
        let mut b = momentum_buffer.map(|b| b.storage_mut(op)).transpose()?;
        dispatch!(&mut *self.storage_mut(op)?, p, other, other_mut => {
            let buf = match (&mut b, momentum_buffer) {
                (Some(guard), Some(t)) => Some((other_mut(guard)?, t.layout())),
                _ => None,
            };
            p.sgd_step(self.layout(), (other(&g)?, grad.layout()), buf, &s)
        })
    }

    /// One fused AdamW update of this parameter (f32, contiguous) from `grad`, in place
    /// on the parameter and its moments `exp_avg`, `exp_avg_sq`, with PyTorch's
    /// arithmetic: `p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    /// p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`.
    pub fn adamw_step(&self, grad: &Tensor, exp_avg: &Tensor, exp_avg_sq: &Tensor, hp: &AdamWStep) -> Result<()> {
        let op = "adamw_step";
        check_state(op, "the parameter", self, self)?;
        check_state(op, "the gradient", self, grad)?;
        check_state(op, "exp_avg", self, exp_avg)?;
        check_state(op, "exp_avg_sq", self, exp_avg_sq)?;
        distinct(op, &[self, grad, exp_avg, exp_avg_sq])?;
        let g = grad.storage(op)?;
        let (mut m, mut v) = (exp_avg.storage_mut(op)?, exp_avg_sq.storage_mut(op)?);
        dispatch!(&mut *self.storage_mut(op)?, p, other, other_mut => p.adamw_step(
            self.layout(),
            (other(&g)?, grad.layout()),
            (other_mut(&mut m)?, exp_avg.layout()),
            (other_mut(&mut v)?, exp_avg_sq.layout()),
            &hp.scalars(),
        ))
    }
}

/// Checks the operands of a master-weight step beside [`check_state`]'s: the copy is `F16` or
/// `BF16`, contiguous, of the parameter's shape and device; the gradient is f32 or the copy's
/// dtype, contiguous, of the parameter's shape and device.
fn check_copy(op: &'static str, p: &Tensor, grad: &Tensor, copy: &Tensor) -> Result<()> {
    check_state(op, "the parameter", p, p)?;
    if !matches!(copy.dtype(), DType::BF16 | DType::F16) {
        return Err(TensorError::Invalid {
            op,
            msg: format!("the copy is {:?}; master weights keep a bf16 or f16 copy", copy.dtype()),
        });
    }
    if grad.dtype() != DType::F32 && grad.dtype() != copy.dtype() {
        return Err(TensorError::Invalid {
            op,
            msg: format!(
                "the gradient is {:?}; expected f32 or the copy's {:?}",
                grad.dtype(),
                copy.dtype()
            ),
        });
    }
    for (what, t) in [("the copy", copy), ("the gradient", grad)] {
        check_layout(op, what, p, t)?;
    }
    Ok(())
}

impl Tensor {
    /// [`Tensor::sgd_step`] of f32 master weights (this tensor) beside their 16-bit compute
    /// copy `copy` (bf16 or f16, contiguous): `grad` is f32 or in the copy's dtype, and the
    /// updated masters are written, rounded to nearest even, into `copy`. On the CPU one pass
    /// over memory (the gradient widened and the masters rounded a cache-sized chunk at a
    /// time); elsewhere the three passes. The same bits either way.
    pub fn sgd_step_with_copy(
        &self,
        grad: &Tensor,
        momentum_buffer: Option<&Tensor>,
        hp: SgdStep,
        copy: &Tensor,
    ) -> Result<()> {
        let op = "sgd_step_with_copy";
        check_copy(op, self, grad, copy)?;
        if matches!(self.device(), crate::Device::Cuda(_)) {
            self.sgd_step(&grad.to_dtype(DType::F32)?, momentum_buffer, hp)?;
            return copy.copy_from(&self.to_dtype(copy.dtype())?);
        }
        let s = SgdScalars {
            lr: hp.lr as f32,
            momentum: hp.momentum as f32,
            weight_decay: hp.weight_decay as f32,
            is_first_step: hp.is_first_step,
        };
        if (s.momentum != 0.0) != momentum_buffer.is_some() {
            return Err(TensorError::Invalid {
                op,
                msg: "a momentum buffer goes with a nonzero momentum, and only then".into(),
            });
        }
        let mut operands = vec![self, grad, copy];
        if let Some(b) = momentum_buffer {
            check_state(op, "the momentum buffer", self, b)?;
            operands.push(b);
        }
        distinct(op, &operands)?;
        let g = grad.storage(op)?;
        let mut b = momentum_buffer.map(|b| b.storage_mut(op)).transpose()?;
        let mut c = copy.storage_mut(op)?;
        dispatch!(&mut *self.storage_mut(op)?, p, other, other_mut => {
            let buf = match (&mut b, momentum_buffer) {
                (Some(guard), Some(t)) => Some((other_mut(guard)?, t.layout())),
                _ => None,
            };
            p.sgd_step_with_copy(self.layout(), (other(&g)?, grad.layout()), buf, (other_mut(&mut c)?, copy.layout()), &s)
        })
    }

    /// [`Tensor::adamw_step`] of f32 master weights beside their 16-bit compute copy, as
    /// [`Tensor::sgd_step_with_copy`].
    pub fn adamw_step_with_copy(
        &self,
        grad: &Tensor,
        exp_avg: &Tensor,
        exp_avg_sq: &Tensor,
        hp: &AdamWStep,
        copy: &Tensor,
    ) -> Result<()> {
        let op = "adamw_step_with_copy";
        check_copy(op, self, grad, copy)?;
        if matches!(self.device(), crate::Device::Cuda(_)) {
            self.adamw_step(&grad.to_dtype(DType::F32)?, exp_avg, exp_avg_sq, hp)?;
            return copy.copy_from(&self.to_dtype(copy.dtype())?);
        }
        check_state(op, "exp_avg", self, exp_avg)?;
        check_state(op, "exp_avg_sq", self, exp_avg_sq)?;
        distinct(op, &[self, grad, exp_avg, exp_avg_sq, copy])?;
        let g = grad.storage(op)?;
        let (mut m, mut v) = (exp_avg.storage_mut(op)?, exp_avg_sq.storage_mut(op)?);
        let mut c = copy.storage_mut(op)?;
        dispatch!(&mut *self.storage_mut(op)?, p, other, other_mut => p.adamw_step_with_copy(
            self.layout(),
            (other(&g)?, grad.layout()),
            (other_mut(&mut m)?, exp_avg.layout()),
            (other_mut(&mut v)?, exp_avg_sq.layout()),
            (other_mut(&mut c)?, copy.layout()),
            &hp.scalars(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::{AdamWStep, SgdStep};
    use crate::{test_device, DType, Device, Rng, Tensor};

    fn accumulating_into_a_flat_view_writes_the_shared_buffer(d: Device) {
        let flat = Tensor::zeros_on(&[10], DType::F32, d).unwrap();
        let g = flat.flat_view(4, &[2, 3]).unwrap();
        let x = Tensor::ones(&[2, 3], DType::F32).to_device(d).unwrap();
        g.add_assign(&x).unwrap();
        g.add_assign(&x).unwrap();
        assert_eq!(
            flat.to_vec::<f32>().unwrap(),
            vec![0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
        );
        // through a transposed view: flat[4..10] as [2,3], written as its [3,2] transpose
        let t = g.t().unwrap();
        t.add_scaled_assign(
            &Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2])
                .unwrap()
                .to_device(d)
                .unwrap(),
            10.0,
        )
        .unwrap();
        assert_eq!(
            flat.to_vec::<f32>().unwrap(),
            vec![0.0, 0.0, 0.0, 0.0, 12.0, 32.0, 52.0, 22.0, 42.0, 62.0]
        );
    }
    test_device!(accumulating_into_a_flat_view_writes_the_shared_buffer);

    fn a_lent_storage_is_an_error_until_it_comes_back(d: Device) {
        let flat = Tensor::zeros_on(&[4], DType::F32, d).unwrap();
        let view = flat.flat_view(2, &[2]).unwrap();
        let s = flat.lend_storage().unwrap();
        assert_eq!((s.device(), s.dtype(), s.len()), (d, DType::F32, 4));
        assert!(view.to_vec::<f32>().is_err());
        assert!(view
            .add_assign(&Tensor::ones(&[2], DType::F32).to_device(d).unwrap())
            .is_err());
        assert!(view.exp().is_err());
        flat.restore_storage(s).unwrap();
        view.fill(3.0).unwrap();
        assert_eq!(flat.to_vec::<f32>().unwrap(), vec![0.0, 0.0, 3.0, 3.0]);
    }
    test_device!(a_lent_storage_is_an_error_until_it_comes_back);

    fn copy_from_keeps_every_bit_through_a_strided_view(d: Device) {
        let dst = Tensor::full(&[2, 2], 7.0, DType::F64).to_device(d).unwrap();
        let src = Tensor::from_vec(vec![-0.0f64, 1.5, f64::NEG_INFINITY, 3.0], &[2, 2])
            .unwrap()
            .to_device(d)
            .unwrap();
        dst.t().unwrap().copy_from(&src).unwrap();
        // dst^T = src: dst = [[-0, -inf], [1.5, 3]]
        let got = dst.to_vec::<f64>().unwrap();
        assert_eq!(got[0].to_bits(), (-0.0f64).to_bits(), "the sign of zero survives");
        assert_eq!(&got[1..], &[f64::NEG_INFINITY, 1.5, 3.0]);
        let ids = Tensor::zeros_on(&[2], DType::I64, d).unwrap();
        ids.copy_from(&Tensor::from_vec(vec![4i64, 5], &[2]).unwrap().to_device(d).unwrap())
            .unwrap();
        assert_eq!(ids.to_vec::<i64>().unwrap(), vec![4, 5]);
    }
    test_device!(copy_from_keeps_every_bit_through_a_strided_view);

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn randn(n: usize, rng: &mut Rng, d: Device) -> (Vec<f32>, Tensor) {
        let t = Tensor::randn(&[n], 1.0, DType::F32, rng);
        (t.to_vec().unwrap(), t.to_device(d).unwrap())
    }

    /// The loops `crates/autograd/src/optim.rs` ran on host slices before the fused op:
    /// the fused op must give the same bits.
    fn sgd_matches_the_host_loop_bit_for_bit(d: Device) {
        let mut rng = Rng::new(7);
        let (mut pv, p) = randn(37, &mut rng, d);
        let mut bv: Option<Vec<f32>> = None;
        // stale contents: the first step must overwrite them, not decay into them
        let buf = Tensor::full(&[37], 5.0, DType::F32).to_device(d).unwrap();
        let (lr, mom, wd) = (0.1f64, 0.9f64, 0.01f64);
        for step in 0..3 {
            let (gv, g) = randn(37, &mut rng, d);
            let mut g2 = gv.clone();
            for (g, &p) in g2.iter_mut().zip(&pv) {
                *g += wd as f32 * p;
            }
            match &mut bv {
                None => bv = Some(g2.clone()),
                Some(b) => {
                    for (b, gi) in b.iter_mut().zip(g2.iter_mut()) {
                        *b = mom as f32 * *b + *gi;
                        *gi = *b;
                    }
                }
            }
            for (p, &g) in pv.iter_mut().zip(&g2) {
                *p -= lr as f32 * g;
            }
            p.sgd_step(
                &g,
                Some(&buf),
                SgdStep {
                    lr,
                    momentum: mom,
                    weight_decay: wd,
                    is_first_step: step == 0,
                },
            )
            .unwrap();
            assert_eq!(bits(&p.to_vec::<f32>().unwrap()), bits(&pv), "step {step}");
            assert_eq!(
                bits(&buf.to_vec::<f32>().unwrap()),
                bits(bv.as_ref().unwrap()),
                "step {step}"
            );
        }
        // no momentum: no buffer, and a buffer without momentum is refused
        let (gv, g) = randn(37, &mut rng, d);
        p.sgd_step(
            &g,
            None,
            SgdStep {
                lr,
                momentum: 0.0,
                weight_decay: 0.0,
                is_first_step: false,
            },
        )
        .unwrap();
        let want: Vec<f32> = pv.iter().zip(&gv).map(|(&p, &g)| p - lr as f32 * g).collect();
        assert_eq!(bits(&p.to_vec::<f32>().unwrap()), bits(&want));
        assert!(p
            .sgd_step(
                &g,
                Some(&buf),
                SgdStep {
                    lr,
                    momentum: 0.0,
                    weight_decay: 0.0,
                    is_first_step: false
                }
            )
            .is_err());
    }
    test_device!(sgd_matches_the_host_loop_bit_for_bit);

    fn adamw_matches_the_host_loop_bit_for_bit(d: Device) {
        let mut rng = Rng::new(8);
        let (mut pv, p) = randn(41, &mut rng, d);
        let (mut mv, mut vv) = (vec![0f32; 41], vec![0f32; 41]);
        let (m, v) = (
            Tensor::zeros_on(&[41], DType::F32, d).unwrap(),
            Tensor::zeros_on(&[41], DType::F32, d).unwrap(),
        );
        let (lr, beta1, beta2, eps, wd) = (1e-3f64, 0.9f64, 0.999f64, 1e-8f64, 0.01f64);
        for step in 1..=3u64 {
            let (gv, g) = randn(41, &mut rng, d);
            let t = step as i32;
            let (b1, b2) = (beta1 as f32, beta2 as f32);
            let (one_m_b1, one_m_b2) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32);
            let step_size = (lr / (1.0 - beta1.powi(t))) as f32;
            let bc2_sqrt = (1.0 - beta2.powi(t)).sqrt() as f32;
            let (eps32, decay) = (eps as f32, (1.0 - lr * wd) as f32);
            for (((p, m), v), &g) in pv.iter_mut().zip(mv.iter_mut()).zip(vv.iter_mut()).zip(&gv) {
                *p *= decay;
                *m = b1 * *m + one_m_b1 * g;
                *v = b2 * *v + one_m_b2 * g * g;
                *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps32);
            }
            p.adamw_step(
                &g,
                &m,
                &v,
                &AdamWStep {
                    lr,
                    betas: (beta1, beta2),
                    eps,
                    weight_decay: wd,
                    step,
                },
            )
            .unwrap();
            assert_eq!(bits(&p.to_vec::<f32>().unwrap()), bits(&pv), "step {step}");
            assert_eq!(bits(&m.to_vec::<f32>().unwrap()), bits(&mv), "step {step}");
            assert_eq!(bits(&v.to_vec::<f32>().unwrap()), bits(&vv), "step {step}");
        }
        // state aliasing the parameter is refused, not deadlocked
        let g = Tensor::zeros_on(&[41], DType::F32, d).unwrap();
        assert!(p
            .adamw_step(
                &g,
                &p,
                &v,
                &AdamWStep {
                    lr,
                    betas: (beta1, beta2),
                    eps,
                    weight_decay: wd,
                    step: 4
                }
            )
            .is_err());
    }
    test_device!(adamw_matches_the_host_loop_bit_for_bit);

    /// The 16-bit copy's bits, whatever its dtype.
    fn half_bits(t: &Tensor) -> Vec<u16> {
        match t.dtype() {
            DType::BF16 => t.to_vec::<half::bf16>().unwrap().iter().map(|x| x.to_bits()).collect(),
            _ => t.to_vec::<half::f16>().unwrap().iter().map(|x| x.to_bits()).collect(),
        }
    }

    /// The fused master-weight steps against the three passes they replace (the gradient
    /// widened, the f32 step, the masters rounded), over lengths that end inside and on a
    /// chunk of the CPU kernel, with f32 and 16-bit gradients.
    fn master_weight_steps_give_the_bits_of_three_passes(d: Device) {
        let mut rng = Rng::new(9);
        for dtype in [DType::BF16, DType::F16] {
            for n in [5, 1024, 2500] {
                for wide_grad in [true, false] {
                    let (_, p) = randn(n, &mut rng, d);
                    let (want_p, copy) = (p.copy().unwrap(), p.to_dtype(dtype).unwrap());
                    let zeros = || Tensor::zeros_on(&[n], DType::F32, d).unwrap();
                    let (m, v, want_m, want_v) = (zeros(), zeros(), zeros(), zeros());
                    let (buf, want_buf) = (zeros(), zeros());
                    for step in 1..=2u64 {
                        let (_, g) = randn(n, &mut rng, d);
                        let g = if wide_grad { g } else { g.to_dtype(dtype).unwrap() };
                        let hp = AdamWStep {
                            lr: 1e-2,
                            betas: (0.9, 0.999),
                            eps: 1e-8,
                            weight_decay: 0.01,
                            step,
                        };
                        p.adamw_step_with_copy(&g, &m, &v, &hp, &copy).unwrap();
                        want_p
                            .adamw_step(&g.to_dtype(DType::F32).unwrap(), &want_m, &want_v, &hp)
                            .unwrap();
                        let sgd = SgdStep {
                            lr: 0.1,
                            momentum: 0.9,
                            weight_decay: 0.01,
                            is_first_step: step == 1,
                        };
                        p.sgd_step_with_copy(&g, Some(&buf), sgd, &copy).unwrap();
                        want_p
                            .sgd_step(&g.to_dtype(DType::F32).unwrap(), Some(&want_buf), sgd)
                            .unwrap();
                        let what = format!("{dtype:?}, n {n}, f32 grad {wide_grad}, step {step}");
                        for (got, want) in [(&p, &want_p), (&m, &want_m), (&v, &want_v), (&buf, &want_buf)] {
                            assert_eq!(
                                bits(&got.to_vec::<f32>().unwrap()),
                                bits(&want.to_vec::<f32>().unwrap()),
                                "{what}"
                            );
                        }
                        assert_eq!(half_bits(&copy), half_bits(&want_p.to_dtype(dtype).unwrap()), "{what}");
                    }
                }
            }
        }
        // an f32 copy, or a gradient of the other 16-bit dtype, is refused
        let (_, p) = randn(4, &mut rng, d);
        let (m, v) = (p.zeros_like().unwrap(), p.zeros_like().unwrap());
        let hp = AdamWStep {
            lr: 1e-2,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
        };
        assert!(p
            .adamw_step_with_copy(&p.copy().unwrap(), &m, &v, &hp, &p.copy().unwrap())
            .is_err());
        let f16_grad = p.to_dtype(DType::F16).unwrap();
        let bf16_copy = p.to_dtype(DType::BF16).unwrap();
        assert!(p.adamw_step_with_copy(&f16_grad, &m, &v, &hp, &bf16_copy).is_err());
    }
    test_device!(master_weight_steps_give_the_bits_of_three_passes);
}
