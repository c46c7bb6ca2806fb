//! Learning-rate schedules: pure functions of the 0-based global step, like PyTorch's
//! `LambdaLR`, so a resumed run lands on the same curve by knowing only its step.
//!
//! Every schedule starts with an optional linear warmup over `W` steps (`lr·(s+1)/W` for
//! `s < W`; `W = 0` means none), then:
//! - constant ([`ScheduleKind::Constant`]), `lr`;
//! - cosine ([`ScheduleKind::Cosine`]), `min_lr + ½·(lr − min_lr)·(1 + cos(π·(s − W)/(T − W)))`
//!   for `W ≤ s < T`, `min_lr` from `T` on;
//! - linear ([`ScheduleKind::Linear`]), `lr + (min_lr − lr)·(s − W)/(T − W)` for `W ≤ s < T`,
//!   `min_lr` from `T` on;
//! - step ([`ScheduleKind::Step`]), `lr·γ^⌊(s − W)/step_size⌋` (PyTorch's `StepLR` when `W = 0`).
//!
//! ```
//! use brigade_autograd::{LrSchedule, ScheduleKind};
//!
//! let s = LrSchedule::new(1e-3, 10, ScheduleKind::Cosine { decay_steps: 110, min_lr: 1e-4 }).unwrap();
//! assert_eq!(s.lr_at(0), 1e-4); // warmup: lr * 1/10
//! assert_eq!(s.lr_at(10), 1e-3); // the peak
//! assert_eq!(s.lr_at(500), 1e-4); // past T: min_lr
//! ```

use std::f64::consts::PI;
use std::fmt;

use crate::optim::Optimizer;
use crate::{AutogradError, Result};

/// What a schedule does after its warmup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScheduleKind {
    /// The base learning rate throughout.
    Constant,
    /// Half a cosine from `lr` down to `min_lr` at step `decay_steps` (`T`), then `min_lr`.
    Cosine {
        /// `T`: the step at which the curve reaches `min_lr` (must exceed the warmup).
        decay_steps: u64,
        /// The floor, held from `T` on.
        min_lr: f64,
    },
    /// A straight line from `lr` down to `min_lr` at step `decay_steps` (`T`), then `min_lr`.
    Linear {
        /// `T`: the step at which the line reaches `min_lr` (must exceed the warmup).
        decay_steps: u64,
        /// The floor, held from `T` on.
        min_lr: f64,
    },
    /// `lr` multiplied by `gamma` every `step_size` steps after the warmup.
    Step {
        /// Steps between two multiplications (positive).
        step_size: u64,
        /// The factor (positive and finite; below 1 decays).
        gamma: f64,
    },
}

impl ScheduleKind {
    /// `"constant"`, `"cosine"`, `"linear"` or `"step"`: the names of `--lr-schedule`.
    pub fn name(&self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Cosine { .. } => "cosine",
            ScheduleKind::Linear { .. } => "linear",
            ScheduleKind::Step { .. } => "step",
        }
    }
}

/// A learning rate for every global step: a base `lr`, a warmup of `warmup_steps` and a
/// [`ScheduleKind`]. Built only through [`LrSchedule::new`], which refuses what cannot be a
/// schedule (so [`LrSchedule::lr_at`] cannot fail).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    lr: f64,
    warmup_steps: u64,
    kind: ScheduleKind,
}

fn invalid(message: String) -> AutogradError {
    AutogradError::Schedule(message)
}

impl LrSchedule {
    /// A schedule peaking at `lr` after `warmup_steps` warmup steps. Errors (one line each) on a
    /// learning rate that is negative or not finite, a `min_lr` above `lr`, a decaying schedule
    /// whose `T` does not exceed the warmup (`T <= W`), or a step schedule with `step_size` 0 or
    /// a `gamma` that is not positive and finite.
    pub fn new(lr: f64, warmup_steps: u64, kind: ScheduleKind) -> Result<LrSchedule> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(invalid(format!("the learning rate must be finite and >= 0, got {lr}")));
        }
        match kind {
            ScheduleKind::Constant => {}
            ScheduleKind::Cosine { decay_steps, min_lr } | ScheduleKind::Linear { decay_steps, min_lr } => {
                let name = kind.name();
                if !(min_lr.is_finite() && min_lr >= 0.0) {
                    return Err(invalid(format!("{name}: min_lr must be finite and >= 0, got {min_lr}")));
                }
                if min_lr > lr {
                    return Err(invalid(format!(
                        "{name}: min_lr {min_lr} exceeds the learning rate {lr}; a decaying schedule needs min_lr <= lr"
                    )));
                }
                if decay_steps <= warmup_steps {
                    return Err(invalid(format!(
                        "{name}: the decay ends at step T = {decay_steps}, which must exceed the warmup W = {warmup_steps} (T <= W leaves nothing to decay; raise T or lower W)"
                    )));
                }
            }
            ScheduleKind::Step { step_size, gamma } => {
                if step_size == 0 {
                    return Err(invalid("step: step_size must be positive".into()));
                }
                if !(gamma.is_finite() && gamma > 0.0) {
                    return Err(invalid(format!("step: gamma must be finite and > 0, got {gamma}")));
                }
            }
        }
        Ok(LrSchedule { lr, warmup_steps, kind })
    }

    /// `lr` at every step: no warmup, no decay.
    pub fn constant(lr: f64) -> Result<LrSchedule> {
        Self::new(lr, 0, ScheduleKind::Constant)
    }

    /// The peak (base) learning rate.
    pub fn base_lr(&self) -> f64 {
        self.lr
    }

    /// `W`: steps of linear warmup.
    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// What follows the warmup.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// The learning rate of the 0-based global step `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        let (lr, w) = (self.lr, self.warmup_steps);
        if step < w {
            return lr * (step + 1) as f64 / w as f64;
        }
        match self.kind {
            ScheduleKind::Constant => lr,
            ScheduleKind::Cosine { decay_steps, min_lr } => {
                if step >= decay_steps {
                    return min_lr;
                }
                let progress = (step - w) as f64 / (decay_steps - w) as f64;
                min_lr + 0.5 * (lr - min_lr) * (1.0 + (PI * progress).cos())
            }
            ScheduleKind::Linear { decay_steps, min_lr } => {
                if step >= decay_steps {
                    return min_lr;
                }
                let progress = (step - w) as f64 / (decay_steps - w) as f64;
                lr + (min_lr - lr) * progress
            }
            ScheduleKind::Step { step_size, gamma } => {
                let k = (step - w) / step_size;
                lr * gamma.powi(i32::try_from(k).unwrap_or(i32::MAX))
            }
        }
    }

    /// Sets `opt`'s learning rate to that of `step` and returns it: call it before each
    /// optimizer step.
    pub fn apply(&self, opt: &mut dyn Optimizer, step: u64) -> f64 {
        let lr = self.lr_at(step);
        opt.set_lr(lr);
        lr
    }
}

impl fmt::Display for LrSchedule {
    /// One line that names every parameter, e.g. `cosine lr=0.001 warmup=10 T=1000
    /// min_lr=0.0001`: what a checkpoint records and a refused resume prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} lr={} warmup={}", self.kind.name(), self.lr, self.warmup_steps)?;
        match self.kind {
            ScheduleKind::Constant => Ok(()),
            ScheduleKind::Cosine { decay_steps, min_lr } | ScheduleKind::Linear { decay_steps, min_lr } => {
                write!(f, " T={decay_steps} min_lr={min_lr}")
            }
            ScheduleKind::Step { step_size, gamma } => write!(f, " step_size={step_size} gamma={gamma}"),
        }
    }
}
