//! What training produces: one step's [`StepRecord`] (and [`StepOutcome`], what a step returns),
//! and a rank's whole run as a [`TrainOutcome`] (the steps' records, buckets, memory, profiles,
//! final parameters, and how it ended: [`TrainOutcome::stopped`], [`TrainOutcome::interrupted`], a
//! [`CheckpointFailure`]).

use brigade_comm::CommBytes;
use brigade_ddp::overlap::{AutotuneReport, StepProfile};
use brigade_ddp::{BucketInfo, MemoryReport};
use brigade_models::SamplerPosition;
use brigade_tensor::Tensor;

use crate::error::Error;
use crate::source::DataLength;

/// One finished step: what every rank agreed on, and this rank's own measurements (on rank 0,
/// what the run's observer is told). Fields that the run does not compute are `None`; later
/// fields may be added.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct StepRecord {
    /// The step's index.
    pub step: usize,
    /// The mean training loss over the ranks, before the step's update.
    pub loss: f64,
    /// This rank's wall time of the step, in milliseconds.
    pub ms: f64,
    /// The learning rate the step's update used.
    pub lr: f64,
    /// The global gradient norm before clipping (computed when clipping).
    pub grad_norm: Option<f64>,
    /// The validation loss after the step, when the run evaluates after it.
    pub val_loss: Option<f64>,
    /// fp16's loss scale the step's backward used (`None` without loss scaling).
    pub scale: Option<f64>,
    /// The optimizer skipped the step: its scaled gradients held an inf or a NaN (fp16).
    pub skipped: bool,
    /// What this rank's DDP handed to its collectives during the step (gradient reduction,
    /// bucket rebuilding; not the step's own loss agreement, nor a checkpoint's gathers).
    pub sent: CommBytes,
    /// What this rank's compute waited for its parameter gathers in the step's last pass, in
    /// milliseconds (ZeRO-3: the gather time prefetch did not hide; 0 otherwise).
    pub gather_wait_ms: f64,
}

/// What [`Trainer::step`](crate::trainer::Trainer::step) did: the step's record (its
/// validation loss not yet known), and where the run stands after it.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    /// The step's record.
    pub record: StepRecord,
    /// A rank was asked to stop: this was the last step.
    pub stop: bool,
    /// Where this rank's sampler stands after the step (the epoch and row the next step reads
    /// first); `None` for rows in order.
    pub sampler: Option<SamplerPosition>,
}

/// What a rank's run produced.
#[derive(Debug)]
pub struct TrainOutcome {
    /// First step run (non-zero after a resume).
    pub first_step: usize,
    /// The record of each step run, in order.
    pub steps: Vec<StepRecord>,
    /// The hyperparameters this run changed from the checkpoint it resumed.
    pub resume_changes: Vec<crate::recipe::HyperparameterChange>,
    /// Stopped before `steps` because a stop was requested.
    pub interrupted: bool,
    /// The error every rank agreed on that ended the run early (a non-finite loss or
    /// parameters): the steps before it are kept, the last good checkpoint is not overwritten.
    /// Also a rank's failure after a step finished (not agreed: a collective timeout), in the
    /// report [`crate::fit()`] makes of the finished steps ([`crate::trainer::Trainer::run_keeping`]).
    pub stopped: Option<Error>,
    /// Why rank 0 could not write a checkpoint, so that the run's other outputs are still
    /// written and the failure is named beside theirs.
    pub checkpoint_error: Option<CheckpointFailure>,
    /// The last synchronized step's profile, this rank's entry only (when profiling).
    pub profile: Option<StepProfile>,
    /// The profiles of the steps in `profile_steps`, in order, this rank's entries only.
    pub profiles: Vec<StepProfile>,
    /// What the bucket-cap autotuner chose and predicted (with `autotune`).
    pub autotune: Option<AutotuneReport>,
    /// DDP buckets after the last step (empty without DDP).
    pub buckets: Vec<BucketInfo>,
    /// This rank's memory after the last step, measured (absent without DDP).
    pub memory: Option<MemoryReport>,
    /// The final weights, full and f32 under mixed precision (its master weights; rank 0 only;
    /// empty elsewhere).
    pub params: Vec<(String, Tensor)>,
    /// Rows each rank read per epoch (rows in order: endless), as known before step 0.
    pub rank_lengths: DataLength,
    /// Where this rank's sampler stood at the end (the epoch and row a resume reads first);
    /// `None` for rows in order.
    pub sampler: Option<SamplerPosition>,
    /// What this rank's reducer policy says about the run (e.g. that PowerSGD never compressed:
    /// every byte went uncompressed); empty without DDP.
    pub policy_diagnostics: Vec<brigade_ddp::policy::PolicyDiagnostic>,
    /// The run's join mode (uneven inputs; `None`: none).
    pub join: Option<crate::join::JoinMode>,
    /// Under a join mode, for each rank the step at which it joined (its data had ended; from
    /// then on it shadowed the others' collectives), `None` if it never did; empty without a
    /// join mode.
    pub joined_at: Vec<Option<usize>>,
    /// Under a join mode, the step at which no rank had data left: the run ended there, before
    /// `steps` (`None`: it ran to `steps`, or was stopped).
    pub data_ended: Option<usize>,
}

/// A checkpoint rank 0 could not write (not an error the ranks agree on: the run's other
/// outputs are still written, and the failure is reported beside theirs).
#[derive(Debug)]
pub struct CheckpointFailure {
    /// A periodic checkpoint failed: every rank stopped after the next step. Otherwise the
    /// final one failed.
    pub periodic: bool,
    /// Why.
    pub error: Error,
}

impl std::fmt::Display for CheckpointFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.periodic {
            write!(f, "checkpoint (training stopped after the next step): {}", self.error)
        } else {
            write!(f, "checkpoint: {}", self.error)
        }
    }
}

impl TrainOutcome {
    /// The last step run, if any.
    pub fn last_step(&self) -> Option<usize> {
        self.steps.last().map(|r| r.step)
    }

    /// The mean loss over the ranks of each step run.
    pub fn losses(&self) -> Vec<f64> {
        self.steps.iter().map(|r| r.loss).collect()
    }

    /// The learning rate of each step run.
    pub fn lrs(&self) -> Vec<f64> {
        self.steps.iter().map(|r| r.lr).collect()
    }

    /// The global gradient norm before clipping of each step run (when clipping).
    pub fn grad_norms(&self) -> Vec<Option<f64>> {
        self.steps.iter().map(|r| r.grad_norm).collect()
    }

    /// fp16's loss scale of each step run (`None` without loss scaling).
    pub fn scales(&self) -> Vec<Option<f64>> {
        self.steps.iter().map(|r| r.scale).collect()
    }

    /// Steps the optimizer skipped for inf/NaN gradients under fp16 loss scaling.
    pub fn skipped_steps(&self) -> usize {
        self.steps.iter().filter(|r| r.skipped).count()
    }

    /// The validation loss after each step run (on the steps that evaluate).
    pub fn val_losses(&self) -> Vec<Option<f64>> {
        self.steps.iter().map(|r| r.val_loss).collect()
    }

    /// This rank's wall time of each step run, in milliseconds.
    pub fn ms(&self) -> Vec<f64> {
        self.steps.iter().map(|r| r.ms).collect()
    }

    /// What this rank's compute waited for its parameter gathers in each step run (ZeRO-3),
    /// in milliseconds.
    pub fn gather_wait_ms(&self) -> Vec<f64> {
        self.steps.iter().map(|r| r.gather_wait_ms).collect()
    }

    /// What DDP handed to its collectives in each step run, on this rank.
    pub fn sent(&self) -> Vec<CommBytes> {
        self.steps.iter().map(|r| r.sent).collect()
    }
}
