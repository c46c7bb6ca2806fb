//! The training recipe beside the model: the learning-rate schedule ([`ScheduleConfig`]),
//! global-norm gradient clipping (`torch.nn.utils.clip_grad_norm_`'s factor) and evaluation on held-out data
//! ([`EvalConfig`]). What a checkpoint records of them, and the rules of a resume, are in
//! [`crate::resume`].

use std::fmt;
use std::sync::Arc;

use brigade_autograd::{LrSchedule, ScheduleKind};
use brigade_models::{Batch, Dataset};

use crate::error::{Error, Result};

/// Which schedule follows the warmup (the names of `--lr-schedule`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScheduleName {
    /// The optimizer's learning rate throughout (after the warmup, if any).
    #[default]
    Constant,
    /// Half a cosine down to `min_lr` at `T`.
    Cosine,
    /// A straight line down to `min_lr` at `T`.
    Linear,
    /// Multiplied by `gamma` every `step_size` steps.
    Step,
}

/// The learning-rate schedule of a run, peaking at the optimizer's learning rate: a
/// `LambdaLR`-style function of the 0-based global step ([`brigade_autograd::LrSchedule`]).
/// The default is the constant schedule of the optimizer's learning rate (no warmup).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScheduleConfig {
    /// What follows the warmup.
    pub name: ScheduleName,
    /// `W`: steps of linear warmup (`lr·(s+1)/W` for `s < W`; 0: none).
    pub warmup_steps: u64,
    /// `T` of cosine and linear: the step at which the learning rate reaches `min_lr`.
    /// `None`: the checkpoint's `T` when resuming one that records it, else the run's steps.
    pub decay_steps: Option<u64>,
    /// The floor of cosine and linear.
    pub min_lr: f64,
    /// Steps between two multiplications (step).
    pub step_size: u64,
    /// The factor (step).
    pub gamma: f64,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            name: ScheduleName::Constant,
            warmup_steps: 0,
            decay_steps: None,
            min_lr: 0.0,
            step_size: 1,
            gamma: 0.1,
        }
    }
}

impl ScheduleConfig {
    /// The schedule peaking at `lr`, with `T = default_t` unless `decay_steps` is set. Errors
    /// in one line on what cannot be a schedule (e.g. `T <= W` for a decaying one).
    pub fn build(&self, lr: f64, default_t: u64) -> Result<LrSchedule> {
        let t = self.decay_steps.unwrap_or(default_t);
        let kind = match self.name {
            ScheduleName::Constant => ScheduleKind::Constant,
            ScheduleName::Cosine => ScheduleKind::Cosine {
                decay_steps: t,
                min_lr: self.min_lr,
            },
            ScheduleName::Linear => ScheduleKind::Linear {
                decay_steps: t,
                min_lr: self.min_lr,
            },
            ScheduleName::Step => ScheduleKind::Step {
                step_size: self.step_size,
                gamma: self.gamma,
            },
        };
        LrSchedule::new(lr, self.warmup_steps, kind).map_err(|e| Error::Config(e.to_string()))
    }
}

/// A schedule as a checkpoint records it: everything but the peak learning rate (which is a
/// hyperparameter a resume may change), e.g. `cosine warmup=10 T=1000 min_lr=0.0001`.
pub fn schedule_record(s: &LrSchedule) -> String {
    let mut out = format!("{} warmup={}", s.kind().name(), s.warmup_steps());
    match s.kind() {
        ScheduleKind::Constant => {}
        ScheduleKind::Cosine { decay_steps, min_lr } | ScheduleKind::Linear { decay_steps, min_lr } => {
            out.push_str(&format!(" T={decay_steps} min_lr={min_lr}"));
        }
        ScheduleKind::Step { step_size, gamma } => out.push_str(&format!(" step_size={step_size} gamma={gamma}")),
    }
    out
}

/// A hyperparameter a resumed run changed: the run uses `this_run`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HyperparameterChange {
    /// `lr`, `momentum`, `weight_decay`, `betas`, `eps` or `clip_grad_norm`.
    pub name: String,
    /// What the checkpoint records (`none`: no clipping).
    pub written: String,
    /// What this run uses.
    pub this_run: String,
}

impl fmt::Display for HyperparameterChange {
    /// `lr 0.001 -> 0.0005`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} -> {}", self.name, self.written, self.this_run)
    }
}

/// Held-out data a run evaluates on: each rank's share, in batches. `Sync`: one source
/// serves every rank thread.
pub trait EvalSource: Send + Sync {
    /// Rank `rank`'s batches (of `world_size` ranks). The run's validation loss is the mean
    /// over the ranks of each rank's mean loss per row, so the ranks' shares should hold as
    /// many rows each.
    fn batches(&self, rank: usize, world_size: usize) -> Result<Vec<Batch>>;
}

/// Every row of a dataset, split evenly over the ranks (rank `r` takes the `r`-th block of
/// `len / world_size` rows; the remainder is left out), in batches of at most `batch_size`
/// rows.
pub struct HeldOut {
    data: Dataset,
    batch_size: usize,
}

impl HeldOut {
    /// `data` in batches of `batch_size` rows (at least 1).
    pub fn new(data: Dataset, batch_size: usize) -> HeldOut {
        HeldOut {
            data,
            batch_size: batch_size.max(1),
        }
    }
}

impl EvalSource for HeldOut {
    fn batches(&self, rank: usize, world_size: usize) -> Result<Vec<Batch>> {
        let share = self.data.len() / world_size.max(1);
        if share == 0 {
            return Err(Error::Data(format!(
                "the evaluation data {} has {} rows, fewer than the {world_size} ranks",
                self.data.name(),
                self.data.len()
            )));
        }
        let first = rank * share;
        (first..first + share)
            .step_by(self.batch_size)
            .map(|start| Ok(self.data.batch(start, self.batch_size.min(first + share - start))?))
            .collect()
    }
}

/// Evaluation every `every` steps (and after the last) on held-out data: in eval mode, under
/// `no_grad`, averaged over the ranks, after the step's update.
#[derive(Clone)]
pub struct EvalConfig {
    /// Steps between two evaluations (at least 1): after step `s` when `(s + 1) % every == 0`.
    pub every: usize,
    /// The held-out data.
    pub data: Arc<dyn EvalSource>,
}

/// `torch.nn.utils.clip_grad_norm_`'s factor for a total gradient norm `norm` under `max_norm`:
/// `max_norm / (norm + 1e-6)` when that is below 1, else `None` (nothing to scale).
pub(crate) fn clip_factor(norm: f64, max_norm: f64) -> Option<f64> {
    let coef = max_norm / (norm + 1e-6);
    (coef < 1.0).then_some(coef)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_name_every_schedule_parameter_but_the_peak() {
        let cfg = ScheduleConfig {
            name: ScheduleName::Cosine,
            warmup_steps: 2,
            min_lr: 1e-4,
            ..ScheduleConfig::default()
        };
        let s = cfg.build(1e-3, 10).unwrap();
        assert_eq!(schedule_record(&s), "cosine warmup=2 T=10 min_lr=0.0001");
        assert!(cfg.build(1e-3, 2).is_err(), "T <= W is refused");
    }

    #[test]
    fn clip_factor_is_torchs() {
        assert_eq!(clip_factor(0.5, 1.0), None);
        let c = clip_factor(4.0, 1.0).unwrap();
        assert!((c - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
    }
}
