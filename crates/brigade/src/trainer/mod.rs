//! One rank's training loop over any [`Model`] and [`DataSource`]: [`Trainer::step`] runs one
//! optimizer step (microbatches, DDP, the ranks' agreement on the loss and on stopping, the
//! update); [`Trainer::run`] steps until `steps`, checkpointing on the way and telling the
//! run's observer ([`crate::observe`]). A [`TrainConfig`] is plain data; [`crate::fit()`] runs
//! a trainer on every rank.
//!
//! Every step ends with one small all-reduce of `[loss, non-finite, stop]` over the ranks, so
//! that all ranks see the global mean loss of every step and stop together: at a non-finite
//! loss (before that step's update, like PyTorch's anomaly detection), or after the step in
//! which any rank was asked to stop ([`TrainObserver::stop_requested`], e.g. on a signal).
//!
//! Under a join mode ([`TrainConfig::join`], uneven inputs) every step starts with the ranks'
//! agreement on which of them still have data ([`crate::join`]); a rank without data runs DDP's
//! join pass in place of forward and backward and the rest of the step like every rank, so
//! that every collective of the step has a partner on every rank.

use std::sync::Arc;

use brigade_autograd::{LrSchedule, Optimizer, Var};
use brigade_comm::{CommMeter, Communicator, EventKind, Metered, SpanId};
use brigade_ddp::overlap::{Autotuner, StepProfile};
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_models::{load_params, Batch, Model, RngState, SamplerCursor, SamplerPosition};
use brigade_policies::ZeroStage;
use brigade_tensor::{set_compute_threads, Device};

use crate::checkpoint::{load_checkpoint, CheckpointIdentity, Resumed};
use crate::config::{OptimizerConfig, TrainConfig};
use crate::data::{DataLength, DataOrder, DataSource};
use crate::error::{CheckpointMismatch, Error, Result};
use crate::join::{self, JoinRun};
use crate::launch::nccl;
use crate::launch::RankContext;
use crate::observe::TrainObserver;
use crate::recipe::HyperparameterChange;
use crate::resume::{check_resume, check_rows_per_step, defaulted_t_note, ResumeError};

/// Tag of the evaluation's all-reduce (each rank's validation loss).
pub const EVAL_TAG: &str = "eval loss";

/// Name of the compute span of a joined rank's join pass on the timeline (its shadow
/// collectives run inside it).
pub const JOIN_SPAN: &str = "join (no data)";

/// Tag of the per-step agreement all-reduce (`[loss, non-finite, stop]`).
pub const STEP_STATUS_TAG: &str = "step status";

mod run;
mod save;
mod step;

/// One rank's model, optimizer and DDP wrapper, and where the run stands.
pub struct Trainer<'a> {
    cfg: &'a TrainConfig,
    data: &'a dyn DataSource,
    ctx: &'a RankContext,
    model: Box<dyn Model>,
    device: Device,
    opt: Box<dyn Optimizer>,
    ddp: Option<DistributedDataParallel>,
    /// Counts what DDP issues (its communicator is metered; the trainer's own is not).
    meter: CommMeter,
    first_step: usize,
    next_step: usize,
    checkpointed: Option<usize>,
    /// The profile of the last synchronized step (this rank's entry only), when profiling.
    profile: Option<StepProfile>,
    /// This rank asks every rank to stop after the next step (rank 0 could not write a
    /// periodic checkpoint).
    stop_requested: bool,
    /// A periodic checkpoint of the state the next step starts from is due: it is written in
    /// that step once its loss is known to be finite, so that a state that diverges is never
    /// written over the last good checkpoint.
    checkpoint_due: bool,
    /// Every rank's policy state as it stood when the step with a due checkpoint began (on rank
    /// 0): that step's backward changes a stateful policy's state before the checkpoint is
    /// written.
    policy_state_at_start: Option<Vec<(String, brigade_tensor::Tensor)>>,
    /// Rank 0 could not write the periodic checkpoint of the last step (not an agreed error).
    checkpoint_failed: Option<Error>,
    /// Tunes the bucket cap after the steps ([`TrainConfig::autotune`]).
    autotune: Option<Autotuner>,
    /// The profiles of the steps in `profile_steps` so far.
    profiles: Vec<StepProfile>,
    /// Rows each rank reads per epoch, known before step 0.
    lengths: DataLength,
    /// This rank's rows under [`DataOrder::Sampled`] (in order: `None`).
    cursor: Option<SamplerCursor>,
    /// Where the cursor stood when step `next_step` began: what a checkpoint of the state
    /// before that step records.
    next_position: Option<SamplerPosition>,
    /// The model's dropout generator when step `next_step` began (a periodic checkpoint is
    /// written inside that step, after its forward passes drew their masks).
    next_rng: Option<RngState>,
    /// The learning rate of every step.
    schedule: LrSchedule,
    /// The hyperparameters this run changed from the checkpoint it resumed.
    resume_changes: Vec<HyperparameterChange>,
    /// What to say of the resumed schedule (a defaulted `T` this run goes past).
    resume_note: Option<String>,
    /// Uneven inputs: each rank's steps, who has joined, the step's agreement (under a join
    /// mode only).
    join: Option<JoinRun>,
}

impl<'a> Trainer<'a> {
    /// Takes this rank's `model` (loading `init` into it if given), builds the optimizer,
    /// resumes from the checkpoint if asked, and wraps the model in DDP over the rank's
    /// communicator.
    pub fn new(
        cfg: &'a TrainConfig,
        mut model: Box<dyn Model>,
        data: &'a dyn DataSource,
        ctx: &'a RankContext,
    ) -> Result<Self> {
        set_compute_threads(compute_threads(cfg, ctx));
        cfg.checkpoint.validate()?;
        if let Some(init) = &cfg.init {
            load_params(model.params(), init)?;
        }
        // every rank's length is known before step 0: without a join mode, ranks that would
        // run out at different steps are refused here (with one, a rank with fewer rows than
        // a step joins at step 0)
        let lengths = data.rank_lengths(ctx.world_size, &cfg.data_order)?;
        if let (DataLength::PerEpoch(rows), None) = (&lengths, cfg.join) {
            if !lengths.is_even() {
                return Err(join::uneven_refusal(rows));
            }
            if rows[ctx.rank] < cfg.batch_size {
                return Err(Error::Config(format!(
                    "rank {} reads {} rows per epoch, fewer than one microbatch of {}",
                    ctx.rank, rows[ctx.rank], cfg.batch_size
                )));
            }
        }
        // under a join mode a rank with fewer rows than a step joins at step 0; when every
        // rank has, no step could run
        let rows_per_step = cfg.batch_size * cfg.accum;
        if let (DataLength::PerEpoch(rows), Some(_)) = (&lengths, cfg.join) {
            if rows.iter().all(|&n| n < rows_per_step) {
                return Err(Error::NoStep {
                    rows: rows.clone(),
                    rows_per_step,
                });
            }
        }
        let mut opt = cfg.optimizer.build(model.params().params().to_vec());
        // This rank's policy, made first: a checkpoint names the policy it was written under.
        let policy = cfg.ddp.as_ref().map(|_| cfg.comm_hook.make(ctx.rank)).transpose()?;
        let policy_name = policy.as_ref().map(|p| p.name());
        // before any step: a checkpoint of a policy that may keep unsaved state would resume inexactly
        if let (Some(p), Some(_)) = (&policy, &cfg.checkpoint.path) {
            brigade_ddp::policy::check_checkpointable(p.as_ref())?;
        }
        let mut resumed = match &cfg.checkpoint.resume {
            Some(path) => {
                let id = CheckpointIdentity {
                    model: &cfg.model_name,
                    optimizer: cfg.optimizer.name(),
                    seed: cfg.seed,
                    data: data.fingerprint(),
                    zero: zero_stage(cfg),
                    world_size: ctx.world_size,
                    data_order: cfg.data_order.describe(),
                    sampler: None,
                    model_config: None,
                    recipe: vec![],
                    policy: policy_name.as_deref(),
                    dropout_rng: vec![],
                    allow_nonfinite: cfg.allow_nonfinite,
                };
                let resumed = load_checkpoint(path, &id, model.as_ref(), opt.as_mut())?;
                // this rank's dropout generator continues where the checkpoint's stood
                if let Some(state) = resumed.dropout_rng_of(ctx.rank) {
                    model
                        .set_rng_state(state)
                        .map_err(|e| Error::checkpoint(path, CheckpointMismatch::DropoutRng(e.to_string())))?;
                }
                Some(resumed)
            }
            None => None,
        };
        // the schedule (T from the checkpoint unless given), refused if not the checkpoint's
        let (schedule, resume_changes) =
            check_resume(cfg, resumed.as_ref().map(|r| &r.metadata)).map_err(|e| {
                match (e, &cfg.checkpoint.resume) {
                    (ResumeError::Refused(mismatch), Some(path)) => Error::checkpoint(path, mismatch),
                    (ResumeError::Refused(mismatch), None) => Error::Config(mismatch.to_string()),
                    (ResumeError::Config(e), _) => e,
                }
            })?;
        if let Some(max) = cfg.clip_grad_norm.filter(|m| !(m.is_finite() && *m > 0.0)) {
            return Err(Error::Config(format!(
                "the gradient clipping norm must be finite and > 0, got {max}"
            )));
        }
        let first_step = resumed.as_ref().map_or(0, |r: &Resumed| r.step);
        let join = cfg
            .join
            .map(|mode| JoinRun::new(mode, &lengths, rows_per_step, ctx.world_size, first_step));
        if let (Some(r), Some(path)) = (&resumed, &cfg.checkpoint.resume) {
            let position_from_step = join.is_some() || matches!(cfg.data_order, DataOrder::InOrder);
            check_rows_per_step(cfg, &r.metadata, position_from_step)
                .map_err(|mismatch| Error::checkpoint(path, mismatch))?;
            join::check_resume(&r.metadata, join.as_ref()).map_err(|mismatch| Error::checkpoint(path, mismatch))?;
        }
        let resume_note = resumed.as_ref().and_then(|r| defaulted_t_note(cfg, &r.metadata));
        let cursor = match cfg.data_order {
            DataOrder::InOrder => None,
            // a rank of a join run whose data holds no step never reads
            DataOrder::Sampled(_) if join.as_ref().and_then(|j| j.steps_of(ctx.rank)) == Some(0) => None,
            DataOrder::Sampled(options) => {
                let sampler = data.sampler(ctx.rank, ctx.world_size, options)?;
                // a join run is one pass: each rank stands where its own steps left it (the
                // checkpoint records rank 0's position)
                let joined_position = join
                    .as_ref()
                    .and_then(|j| j.steps_of(ctx.rank))
                    .map(|n| SamplerPosition {
                        epoch: 0,
                        index: first_step.min(n) * rows_per_step,
                    });
                let at = joined_position
                    .or(resumed.as_ref().and_then(|r| r.sampler))
                    .unwrap_or(SamplerPosition { epoch: 0, index: 0 });
                Some(SamplerCursor::new(sampler, at)?)
            }
        };
        if let (Some(path), true) = (&cfg.checkpoint.resume, first_step > cfg.steps) {
            return Err(Error::checkpoint(
                path,
                CheckpointMismatch::PastTheEnd {
                    step: first_step,
                    steps: cfg.steps,
                },
            ));
        }
        let device = cfg.device.for_rank(nccl::gpu_rank(ctx))?;
        if device != Device::Cpu {
            opt = move_to_device(model.as_ref(), opt.as_ref(), &cfg.optimizer, device)?;
        }
        let meter = CommMeter::new();
        let ddp = match (&cfg.ddp, policy) {
            (Some(d), Some(policy)) => {
                let comm: Arc<dyn Communicator> = Arc::new(Metered::new(ctx.comm.clone(), meter.clone()));
                let d = DdpConfig {
                    recorder: ctx.recorder.clone(),
                    ..d.clone()
                };
                // NCCL reduces on the GPU's comm stream (not metered); otherwise the host stream
                // over the metered communicator.
                Some(match nccl::bucket_stream(ctx, device, ctx.net)? {
                    Some(stream) => DistributedDataParallel::with_stream(model.params(), comm, stream, d, policy)?,
                    None => DistributedDataParallel::new(model.params(), comm, d, policy)?,
                })
            }
            _ => None,
        };
        // Every rank takes its own part of the policy state (before the optimizer is built:
        // a policy may build it from its state).
        let policy_state = resumed
            .as_mut()
            .map(|r| std::mem::take(&mut r.policy_state))
            .unwrap_or_default();
        if let (Some(ddp), false) = (&ddp, policy_state.is_empty()) {
            ddp.load_gathered_policy_state(&policy_state)
                .map_err(|e| match &cfg.checkpoint.resume {
                    Some(path) => Error::checkpoint(path, CheckpointMismatch::PolicyState(e.to_string())),
                    None => e.into(),
                })?;
        }
        // The policy builds what is stepped (ZeRO: this rank's shard of every bucket only).
        if let Some(ddp) = &ddp {
            let build = |params: Vec<Var>| cfg.optimizer.build(params);
            opt = Box::new(ddp.optimizer(opt, &build)?);
        }
        let next_rng = model.rng_state();
        Ok(Trainer {
            cfg,
            data,
            ctx,
            model,
            device,
            opt,
            ddp,
            meter,
            first_step,
            next_step: first_step,
            checkpointed: None,
            checkpoint_due: false,
            policy_state_at_start: None,
            checkpoint_failed: None,
            stop_requested: false,
            profile: None,
            profiles: vec![],
            lengths,
            next_position: cursor.as_ref().map(SamplerCursor::position),
            next_rng,
            cursor,
            schedule,
            resume_changes,
            resume_note,
            join,
            autotune: cfg
                .autotune
                .clone()
                .filter(|_| cfg.ddp.is_some())
                .map(Autotuner::new)
                .transpose()?,
        })
    }

    /// The first step this trainer runs (non-zero after a resume).
    pub fn first_step(&self) -> usize {
        self.first_step
    }

    /// How many rows each rank reads per epoch (rows in order never end), known before step 0.
    pub fn rank_lengths(&self) -> &DataLength {
        &self.lengths
    }

    /// Where this rank's sampler stands: the epoch and row the next step reads first (`None`
    /// for rows in order).
    pub fn sampler_position(&self) -> Option<SamplerPosition> {
        self.next_position
    }

    fn begin(&self, kind: EventKind) -> Option<SpanId> {
        self.ctx.recorder.as_ref().map(|r| r.begin(self.ctx.rank, kind))
    }

    fn end(&self, span: Option<SpanId>) {
        if let (Some(r), Some(id)) = (&self.ctx.recorder, span) {
            r.end(id);
        }
    }

    /// The hyperparameters this run changed from the checkpoint it resumed (it uses its own).
    pub fn resume_changes(&self) -> &[HyperparameterChange] {
        &self.resume_changes
    }

    /// The run's observer, if any.
    fn observer(&self) -> Option<&dyn TrainObserver> {
        self.cfg.instrument.observer.as_deref()
    }
}

/// The compute threads of each rank: the configured number, or the host's cores shared out among
/// its ranks.
fn compute_threads(cfg: &TrainConfig, ctx: &RankContext) -> usize {
    cfg.compute_threads.unwrap_or_else(|| ctx.default_compute_threads())
}

/// The ZeRO stage of a run (plain DDP, or no DDP at all: `Off`).
fn zero_stage(cfg: &TrainConfig) -> ZeroStage {
    match &cfg.ddp {
        Some(_) => cfg.comm_hook.zero_stage(),
        None => ZeroStage::Off,
    }
}

/// `batch` on `device` (the same tensors on the CPU).
fn batch_on(batch: Batch, device: Device) -> Result<Batch> {
    if device == Device::Cpu {
        return Ok(batch);
    }
    batch.try_map(|_, t| Ok(t.to_device(device)?))
}

/// Moves the parameters (built, initialised and resumed on the CPU) to `device`, and rebuilds
/// the optimizer with its state moved there too, its learning rate kept. DDP, built after
/// this, then allocates its gradient buckets beside the parameters.
fn move_to_device(
    model: &dyn Model,
    opt: &dyn Optimizer,
    cfg: &OptimizerConfig,
    device: Device,
) -> Result<Box<dyn Optimizer>> {
    let state = opt
        .state()?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(device)?)))
        .collect::<Result<Vec<_>>>()?;
    let params = model.params().params().to_vec();
    for p in &params {
        p.set_value(p.value().to_device(device)?)?;
    }
    let mut moved = cfg.build(params);
    moved.load_state(&state)?;
    moved.set_lr(opt.lr());
    Ok(moved)
}
