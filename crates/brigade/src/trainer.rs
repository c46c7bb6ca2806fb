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
use std::time::Instant;

use brigade_autograd::{no_grad, LrSchedule, Optimizer, Var};
use brigade_comm::{
    all_gather_bytes, Buffer, CommBytes, CommMeter, Communicator, EventKind, Metered, ReduceOp, SpanId,
};
use brigade_ddp::overlap::{Autotuner, RankProfile, StepInstants, StepProfile};
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_models::{load_params, Batch, Model, RngState, SamplerCursor, SamplerPosition};
use brigade_policies::ZeroStage;
use brigade_tensor::{set_compute_threads, DType, Device, Tensor};

use crate::checkpoint::{load_checkpoint, save_checkpoint, CheckpointIdentity, Resumed};
use crate::config::{OptimizerConfig, TrainConfig};
use crate::data::{DataLength, DataOrder, DataSource, Microbatch};
use crate::error::{CheckpointMismatch, Error, Result};
use crate::join::{self, Agreement, JoinMode, JoinRun};
use crate::launch::nccl;
use crate::launch::RankContext;
use crate::observe::{RunStart, StepRecord, TrainObserver};
use crate::outcome::{CheckpointFailure, StepOutcome, TrainOutcome};
use crate::recipe::{clip_factor, EvalSource, HyperparameterChange};
use crate::resume::{check_resume, recipe_metadata, ResumeError};

/// Tag of the evaluation's all-reduce (each rank's validation loss).
pub const EVAL_TAG: &str = "eval loss";

/// Name of the compute span of a joined rank's join pass on the timeline (its shadow
/// collectives run inside it).
pub const JOIN_SPAN: &str = "join (no data)";

/// Tag of the per-step agreement all-reduce (`[loss, non-finite, stop]`).
pub const STEP_STATUS_TAG: &str = "step status";

/// What the ranks agreed on at the end of a step.
struct StepStatus {
    loss: f64,
    nonfinite: bool,
    stop: bool,
    /// Under a join mode, the averaged slots of which ranks have data for the next step.
    next_active: Option<Vec<f32>>,
}

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
        set_compute_threads(cfg.compute_threads.unwrap_or_else(|| ctx.default_compute_threads()));
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
        let mut opt = cfg.optimizer.build(model.params().params().to_vec());
        // This rank's policy, made first: a checkpoint names the policy it was written under.
        let policy = cfg.ddp.as_ref().map(|_| cfg.comm_hook.make(ctx.rank)).transpose()?;
        let policy_name = policy.as_ref().map(|p| p.name());
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
        let rows_per_step = cfg.batch_size * cfg.accum;
        let join = cfg
            .join
            .map(|mode| JoinRun::new(mode, &lengths, rows_per_step, ctx.world_size, first_step));
        if let (Some(r), Some(path)) = (&resumed, &cfg.checkpoint.resume) {
            join::check_resume(&r.metadata, join.as_ref()).map_err(|mismatch| Error::checkpoint(path, mismatch))?;
        }
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

    /// Runs one optimizer step on this rank's shard of the global batch. Fails with
    /// [`Error::NonFinite`] on every rank, before the update, when the mean loss is not
    /// finite (unless `allow_nonfinite`).
    ///
    /// Under a join mode the step starts with the ranks' agreement on which of them have data
    /// ([`Trainer::agree_on_data`]); a rank without data joins (DDP's join pass, then the rest
    /// of the step as every rank runs it). Under [`JoinMode::Throw`] a step at which some rank
    /// has no data fails with [`Error::OutOfData`] on every rank; a step at which no rank has
    /// data is a configuration error (the run ends before it).
    pub fn step(&mut self) -> Result<StepOutcome> {
        let s = self.next_step;
        let (rank, world) = (self.ctx.rank, self.ctx.world_size);
        let (b, k) = (self.cfg.batch_size, self.cfg.accum);
        let t0 = Instant::now();
        let agreement = self.agree_on_data()?;
        if let Some(a) = &agreement {
            if let Some(e) = self.join.as_ref().and_then(|j| j.throw(a)) {
                return Err(e);
            }
            if a.none_active() {
                return Err(Error::Config(format!(
                    "step {s}: every rank's data has ended, there is nothing to train on"
                )));
            }
        }
        let has_data = agreement.as_ref().is_none_or(|a| a.active[rank]);
        let sent_before = self.meter.totals();
        let step_span = self.begin(EventKind::Step(s));
        let lr = self.schedule.apply(self.opt.as_mut(), s as u64);
        self.model.params().zero_grad()?;
        // The microbatches' losses add up where they are computed; read back once per step.
        let mut step_loss: Option<Tensor> = None;
        if !has_data {
            // joined: every bucket reduced from zeros, the collectives of the others' backward
            if let Some(ddp) = &self.ddp {
                let span = self.begin(EventKind::Other(JOIN_SPAN.into()));
                let joined = ddp.join();
                self.end(span);
                if let Err(e) = joined {
                    self.end(step_span);
                    return Err(e.into());
                }
            }
        }
        for j in (0..k).filter(|_| has_data) {
            let mb = Microbatch {
                step: s,
                index: j,
                accum: k,
                rank,
                world_size: world,
                rows: b,
            };
            let batch = match self.cursor.as_mut() {
                None => self.data.batch(&mb)?,
                Some(cursor) => self.data.gather(rank, &cursor.next_rows(b))?,
            };
            let batch = batch_on(batch, self.device)?;
            let fwd = self.begin(EventKind::Forward);
            let loss = self.model.loss(&batch)?.mul_scalar(1.0 / k as f64)?;
            self.end(fwd);
            // f64, so the sum is the one the host loop computed before (f32 -> f64 is exact).
            let value = loss.value().to_dtype(DType::F64)?;
            step_loss = Some(match step_loss {
                Some(sum) => sum.add(&value)?,
                None => value,
            });
            match (&self.ddp, j + 1 < k) {
                (Some(ddp), true) => ddp.no_sync(|| loss.backward())?,
                _ => loss.backward()?,
            }
        }
        let local_loss = match step_loss {
            Some(sum) => sum.item()?,
            None => 0.0,
        };
        let mut status = self.agree(local_loss, agreement.as_ref())?;
        if let (Some(j), Some(slots)) = (self.join.as_mut(), status.next_active.take()) {
            j.agreed_next(s, &slots);
        }
        if status.nonfinite && !self.cfg.allow_nonfinite {
            self.end(step_span);
            let what = if world == 1 {
                "the loss".to_string()
            } else {
                format!("the loss (mean over {world} ranks)")
            };
            return Err(Error::NonFinite {
                step: s,
                what,
                value: status.loss,
            });
        }
        // divide-active: the policy divided the sum over the ranks with data by the world size
        if let (Some(a), Some(JoinMode::DivideActive), Some(ddp)) = (&agreement, self.cfg.join, &self.ddp) {
            let active = a.active_count();
            if active < world {
                ddp.scale_grads(world as f64 / active as f64)?;
            }
        }
        // what a periodic checkpoint sends (optimizer and policy state to rank 0) is not the step's
        let mut checkpoint_sent = CommBytes::default();
        if std::mem::take(&mut self.checkpoint_due) {
            // the state this step started from gave a finite loss: it is a good checkpoint
            let before = self.meter.totals();
            let written = self.checkpoint();
            checkpoint_sent = self.meter.totals() - before;
            match written {
                Ok(()) => {}
                Err(e) if e.is_agreed() => {
                    self.end(step_span);
                    return Err(e);
                }
                Err(e) => self.checkpoint_failed = Some(e),
            }
        }
        let grad_norm = match self.cfg.clip_grad_norm {
            Some(max) => Some(self.clip_grads(max)?),
            None => None,
        };
        let os = self.begin(EventKind::Optimizer);
        let optimizer_start = Instant::now();
        // without DDP (ranks training apart) a rank without data has no gradient to step on
        if has_data || self.ddp.is_some() {
            self.opt.step()?;
        }
        let optimizer_end = Instant::now();
        self.end(os);
        self.end(step_span);
        self.next_step += 1;
        self.next_position = self.cursor.as_ref().map(SamplerCursor::position);
        self.next_rng = self.model.rng_state();
        if let Some(ddp) = &self.ddp {
            let at = StepInstants {
                start: t0,
                optimizer_start,
                optimizer_end,
                end: Instant::now(),
            };
            // the profile holds the caps this step ran with: recorded before the autotuner
            // may change them
            let instrument = &self.cfg.instrument;
            if instrument.profile {
                self.profile = StepProfile::record(ddp, &at);
                if let (Some(p), Some(range)) = (&self.profile, &instrument.profile_steps) {
                    if range.contains(&s) {
                        self.profiles.push(p.clone());
                    }
                }
            }
            if let Some(tuner) = self.autotune.as_mut() {
                tuner.observe(ddp, s, RankProfile::record(ddp, &at))?;
            }
        }
        Ok(StepOutcome {
            step: s,
            loss: status.loss,
            ms: t0.elapsed().as_secs_f64() * 1e3,
            lr,
            grad_norm,
            stop: status.stop,
            sent: (self.meter.totals() - sent_before) - checkpoint_sent,
            sampler: self.next_position,
        })
    }

    /// Global-norm clipping of the averaged gradients (`torch.nn.utils.clip_grad_norm_`):
    /// returns the total norm before clipping. Under DDP the norm is the policy's (over every
    /// rank's shard when it shards them: a collective, run by every rank after the same
    /// backward) and what the policy holds is scaled; without DDP, this rank's gradients.
    fn clip_grads(&self, max: f64) -> Result<f64> {
        let norm = match &self.ddp {
            Some(ddp) => ddp.grad_norm_sq()?.sqrt(),
            None => {
                let mut sq = 0.0;
                for p in self.model.params().params() {
                    if let Some(g) = p.grad() {
                        sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.item()?;
                    }
                }
                sq.sqrt()
            }
        };
        if let Some(factor) = clip_factor(norm, max) {
            match &self.ddp {
                Some(ddp) => ddp.scale_grads(factor)?,
                None => {
                    for p in self.model.params().params() {
                        if let Some(g) = p.grad() {
                            g.copy_from(&g.mul_scalar(factor)?)?;
                        }
                    }
                }
            }
        }
        Ok(norm)
    }

    /// The loss on held-out data: in eval mode, under `no_grad`, this rank's mean per row
    /// averaged over the ranks (a collective: every rank evaluates after the same step).
    pub fn evaluate(&mut self, data: &dyn EvalSource) -> Result<f64> {
        let batches = data.batches(self.ctx.rank, self.ctx.world_size)?;
        self.model.eval();
        let summed = no_grad(|| -> Result<(f64, usize)> {
            let (mut sum, mut rows) = (0.0, 0);
            for batch in batches {
                let n = batch.rows();
                let loss = self.model.loss(&batch_on(batch, self.device)?)?;
                sum += loss.value().to_dtype(DType::F64)?.item()? * n as f64;
                rows += n;
            }
            Ok((sum, rows))
        });
        self.model.train();
        let (sum, rows) = summed?;
        let mine = if rows == 0 { f64::NAN } else { sum / rows as f64 };
        if self.ctx.world_size == 1 {
            return Ok(mine);
        }
        let all = self
            .ctx
            .comm
            .all_reduce_blocking(Buffer::F32(vec![mine as f32]), ReduceOp::Avg, EVAL_TAG)?;
        match all.as_f32() {
            Some(&[v]) => Ok(f64::from(v)),
            _ => Err(Error::Protocol(format!(
                "the evaluation all-reduce returned {all:?}, expected 1 f32"
            ))),
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

    /// Under a join mode, the ranks' agreement on which of them have data for the next step (a
    /// collective, made once a step; [`crate::join`]); `None` without a join mode.
    pub fn agree_on_data(&mut self) -> Result<Option<Agreement>> {
        let s = self.next_step;
        match self.join.as_mut() {
            Some(j) => Ok(Some(j.agree(self.ctx.comm.as_ref(), s)?)),
            None => Ok(None),
        }
    }

    /// The ranks' one all-reduce per step: mean loss, whether any rank's loss is not finite,
    /// whether any rank was asked to stop. Under a join mode the mean is over the ranks with
    /// data (`agreement`; a joined rank sends no loss), and a slot per rank carries which ranks
    /// have data for the next step (the next step's agreement, without a collective of its own).
    fn agree(&self, local_loss: f64, agreement: Option<&Agreement>) -> Result<StepStatus> {
        let stop = self.stop_requested || self.observer().is_some_and(|o| o.stop_requested());
        let nonfinite = !local_loss.is_finite();
        if self.ctx.world_size == 1 {
            return Ok(StepStatus {
                loss: local_loss,
                nonfinite,
                stop,
                next_active: None,
            });
        }
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let (rank, world) = (self.ctx.rank, self.ctx.world_size);
        let mut mine = vec![local_loss as f32, flag(nonfinite), flag(stop)];
        let next = self.join.as_ref().map(|j| j.next_slots(rank, world, self.next_step));
        mine.extend(next.iter().flatten());
        let expected = mine.len();
        let all = self
            .ctx
            .comm
            .all_reduce_blocking(Buffer::F32(mine), ReduceOp::Avg, STEP_STATUS_TAG)?;
        let Some((&[loss, nonfinite, stop], slots)) = all
            .as_f32()
            .filter(|v| v.len() == expected)
            .map(|v| v.split_at(3))
            .and_then(|(head, slots)| Some((<&[f32; 3]>::try_from(head).ok()?, slots)))
        else {
            return Err(Error::Protocol(format!(
                "the step status all-reduce returned {all:?}, expected {expected} f32"
            )));
        };
        let mut loss = f64::from(loss);
        if let Some(active) = agreement
            .map(Agreement::active_count)
            .filter(|&n| n > 0 && n < self.ctx.world_size)
        {
            loss *= self.ctx.world_size as f64 / active as f64;
        }
        Ok(StepStatus {
            loss,
            nonfinite: nonfinite > 0.0 || !loss.is_finite(),
            stop: stop > 0.0,
            next_active: next.map(|_| slots.to_vec()),
        })
    }

    /// Writes the checkpoint (rank 0) of the state after the last step run. Unless
    /// `allow_nonfinite`, first checks that every parameter is finite, so that a diverged run
    /// never overwrites the last good checkpoint.
    pub fn checkpoint(&mut self) -> Result<()> {
        let Some(path) = &self.cfg.checkpoint.path else {
            return Ok(());
        };
        if !self.cfg.allow_nonfinite {
            // Every rank holds the same parameters under DDP, so every rank reaches the same verdict.
            for (name, t) in self.model.params().named_values() {
                if let Some(&v) = t.to_f64_vec()?.iter().find(|v| !v.is_finite()) {
                    let what = format!("parameter '{name}' after the update");
                    return Err(Error::NonFinite {
                        step: self.next_step.saturating_sub(1),
                        what,
                        value: v,
                    });
                }
            }
        }
        // ZeRO: every rank sends its shard of the optimizer state to rank 0 (a collective).
        self.opt.consolidate_state()?;
        // Every rank's policy state, on rank 0 (a collective).
        let (policy_state, policy_name) = match &self.ddp {
            Some(ddp) => (ddp.gather_policy_state()?, Some(ddp.policy_name())),
            None => (vec![], None),
        };
        // Every rank's dropout generator, on rank 0 (a collective).
        let dropout_rng = self.gather_rngs()?;
        if self.ctx.rank == 0 {
            let id = CheckpointIdentity {
                model: &self.cfg.model_name,
                optimizer: self.cfg.optimizer.name(),
                seed: self.cfg.seed,
                data: self.data.fingerprint(),
                zero: zero_stage(self.cfg),
                world_size: self.ctx.world_size,
                data_order: self.cfg.data_order.describe(),
                sampler: self.next_position,
                model_config: self.cfg.model_config.clone(),
                recipe: {
                    let mut m = recipe_metadata(self.cfg, &self.schedule);
                    m.extend(self.join.iter().flat_map(|j| j.metadata(self.next_step)));
                    m
                },
                policy: policy_name.as_deref(),
                dropout_rng,
            };
            save_checkpoint(
                path,
                &id,
                self.model.as_ref(),
                self.opt.as_ref(),
                &policy_state,
                self.next_step,
            )?;
        }
        self.checkpointed = Some(self.next_step);
        Ok(())
    }

    /// Every rank's dropout generator as it stood when step `next_step` began, by rank (on
    /// every rank; a collective over the bare communicator when there are several ranks).
    /// Empty when the model draws nothing on some rank.
    fn gather_rngs(&self) -> Result<Vec<RngState>> {
        let encode = |s: Option<RngState>| -> Vec<u8> {
            s.map(|s| [s.seed.to_le_bytes(), s.offset.to_le_bytes()].concat())
                .unwrap_or_default()
        };
        let all = if self.ctx.world_size == 1 {
            vec![encode(self.next_rng)]
        } else {
            all_gather_bytes(self.ctx.control.as_ref(), encode(self.next_rng), "dropout rng")?
        };
        let decode = |b: &Vec<u8>| -> Option<RngState> {
            let (seed, offset) = b.split_at_checked(8)?;
            Some(RngState {
                seed: u64::from_le_bytes(seed.try_into().ok()?),
                offset: u64::from_le_bytes(offset.try_into().ok()?),
            })
        };
        Ok(all.iter().map(decode).collect::<Option<Vec<_>>>().unwrap_or_default())
    }

    /// Steps until `steps` (or a stop request), checkpointing every `checkpoint.every` steps and
    /// at the end. On rank 0 the run's observer is told when the run starts, after every step and
    /// when it ends (also when it fails).
    pub fn run(self) -> Result<TrainOutcome> {
        let observer = self.cfg.instrument.observer.clone().filter(|_| self.ctx.rank == 0);
        if let Some(o) = &observer {
            if !self.resume_changes.is_empty() {
                o.resumed(&self.resume_changes);
            }
            o.run_started(&RunStart {
                world_size: self.ctx.world_size,
                first_step: self.first_step,
                steps: self.cfg.steps,
            });
        }
        let outcome = self.run_steps(observer.as_deref());
        if let Some(o) = &observer {
            o.run_finished(outcome.as_ref());
        }
        outcome
    }

    fn run_steps(mut self, observer: Option<&dyn TrainObserver>) -> Result<TrainOutcome> {
        let (mut losses, mut step_ms, mut sent, mut interrupted) = (vec![], vec![], vec![], false);
        let (mut lrs, mut grad_norms, mut val_losses) = (vec![], vec![], vec![]);
        let (mut stopped, mut checkpoint_error) = (None, None);
        while self.next_step < self.cfg.steps {
            // a join run ends when no rank has data left; its last step is then evaluated as
            // the last step of `steps` is (every rank ends here together)
            if self.agree_on_data()?.is_some_and(|a| a.none_active()) {
                if let (Some(e), Some(last @ None)) = (&self.cfg.eval, val_losses.last_mut()) {
                    *last = Some(self.evaluate(e.data.as_ref())?);
                }
                break;
            }
            let s = match self.step() {
                Ok(s) => s,
                Err(e) if e.is_agreed() => {
                    stopped = Some(e);
                    break;
                }
                Err(e) => return Err(e),
            };
            let val_loss = match &self.cfg.eval {
                Some(e) if (s.step + 1) % e.every.max(1) == 0 || s.step + 1 == self.cfg.steps => {
                    Some(self.evaluate(e.data.as_ref())?)
                }
                _ => None,
            };
            val_losses.push(val_loss);
            losses.push(s.loss);
            lrs.push(s.lr);
            grad_norms.push(s.grad_norm);
            step_ms.push(s.ms);
            sent.push(s.sent);
            if let Some(o) = observer {
                o.step_finished(&StepRecord {
                    step: s.step,
                    loss: s.loss,
                    step_ms: s.ms,
                    lr: s.lr,
                    grad_norm: s.grad_norm,
                    val_loss,
                    sent: s.sent,
                });
            }
            // Rank 0 could not write the step's periodic checkpoint: every rank stops after the
            // next step (they agree on it then), and the outputs are written before the error.
            if let Some(error) = self.checkpoint_failed.take() {
                checkpoint_error.get_or_insert(CheckpointFailure { periodic: true, error });
                self.stop_requested = true;
            }
            if s.stop {
                interrupted = self.next_step < self.cfg.steps;
                break;
            }
            // Due now, written by the next step once its loss is finite (or at the end).
            self.checkpoint_due = self
                .cfg
                .checkpoint
                .every
                .is_some_and(|e| e > 0 && self.next_step.is_multiple_of(e));
        }
        // The end (also of a run of zero steps, or an interrupted one) is always checkpointed,
        // unless the run diverged (the last good checkpoint stays). A failed write there is
        // reported with the other outputs, which are still written.
        let diverged = matches!(stopped, Some(Error::NonFinite { .. }));
        if !diverged && checkpoint_error.is_none() && self.checkpointed != Some(self.next_step) {
            match self.checkpoint() {
                Ok(()) => {}
                Err(e) if e.is_agreed() => stopped = stopped.or(Some(e)),
                Err(error) => checkpoint_error = Some(CheckpointFailure { periodic: false, error }),
            }
        }
        // a join run: the ranks prove they hold the same parameters (a collective)
        if let (Some(_), Some(_), false) = (&self.join, &self.ddp, diverged) {
            match join::check_replicas(self.ctx.control.as_ref(), &self.model.params().named_values()) {
                Ok(()) => {}
                Err(e) if e.is_agreed() => stopped = stopped.or(Some(e)),
                Err(e) => return Err(e),
            }
        }
        let (buckets, memory, rank_memory) = match &self.ddp {
            Some(ddp) => (
                ddp.buckets(),
                Some(ddp.memory()),
                Some(ddp.rank_memory(self.opt.as_ref())?),
            ),
            None => (vec![], None, None),
        };
        let params = if self.ctx.rank == 0 {
            self.model.params().named_values()
        } else {
            vec![]
        };
        Ok(TrainOutcome {
            first_step: self.first_step,
            losses,
            lrs,
            grad_norms,
            val_losses,
            resume_changes: std::mem::take(&mut self.resume_changes),
            step_ms,
            sent,
            interrupted,
            stopped,
            checkpoint_error,
            profile: self.profile.take(),
            profiles: std::mem::take(&mut self.profiles),
            autotune: self.autotune.as_ref().zip(self.ddp.as_ref()).map(|(t, d)| t.report(d)),
            buckets,
            memory,
            rank_memory,
            params,
            rank_lengths: self.lengths.clone(),
            sampler: self.next_position,
            policy_diagnostics: self.ddp.as_ref().map(|d| d.policy_diagnostics()).unwrap_or_default(),
            join: self.join.as_ref().map(|j| j.mode),
            joined_at: self.join.as_ref().map(|j| j.joined_at.clone()).unwrap_or_default(),
            data_ended: self.join.as_ref().and_then(|j| j.ended_at),
        })
    }
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
