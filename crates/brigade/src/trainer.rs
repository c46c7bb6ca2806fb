//! One rank's training loop over any [`Model`] and [`DataSource`]: [`Trainer::step`] runs one
//! optimizer step (microbatches, DDP, the ranks' agreement on the loss and on stopping, the
//! update); [`Trainer::run`] steps until `steps`, checkpointing on the way. Nothing here knows
//! the command line: a [`TrainConfig`] is plain data. [`crate::fit()`] runs it on every rank.
//!
//! Every step ends with one small all-reduce of `[loss, non-finite, stop]` over the ranks, so
//! that all ranks see the global mean loss of every step and stop together: at a non-finite
//! loss (before that step's update, like PyTorch's anomaly detection), or after the step in
//! which any rank was asked to stop (SIGINT/SIGTERM).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use brigade_autograd::{AdamW, Optimizer, Sgd, Var};
use brigade_comm::{Buffer, CommBytes, CommMeter, Communicator, EventKind, Metered, ReduceOp, SpanId};
use brigade_ddp::overlap::{
    AutotuneConfig, AutotuneReport, Autotuner, ParamProfile, RankProfile, StepProfile, PROFILE_VERSION,
};
use brigade_ddp::{BucketInfo, DdpConfig, DistributedDataParallel, MemoryReport, RankMemory};
use brigade_models::{load_params, Batch, Model};
use brigade_policies::ZeroStage;
use brigade_tensor::{set_compute_threads, DType, Device, Tensor};

use crate::checkpoint::{load_checkpoint, save_checkpoint, CheckpointIdentity};
use crate::comm_hook::MakeCommHook;
use crate::data::{DataSource, Microbatch};
use crate::device::DeviceArg;
use crate::error::{Error, Result};
use crate::launch::RankContext;

/// Tag of the per-step agreement all-reduce (`[loss, non-finite, stop]`).
pub const STEP_STATUS_TAG: &str = "step status";

/// Which optimizer, with every hyper-parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD`: momentum, and weight decay added to the gradient.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum (0: none).
        momentum: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
    /// `torch.optim.AdamW`.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// Decay rates of the first and second moment estimates.
        betas: (f64, f64),
        /// Added to the denominator for numerical stability.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
}

impl OptimizerConfig {
    /// AdamW with PyTorch's defaults, except the learning rate and (when given) weight decay.
    pub fn adamw(lr: f64, weight_decay: Option<f64>) -> Self {
        OptimizerConfig::AdamW {
            lr,
            betas: AdamW::DEFAULT_BETAS,
            eps: AdamW::DEFAULT_EPS,
            weight_decay: weight_decay.unwrap_or(AdamW::DEFAULT_WEIGHT_DECAY),
        }
    }

    /// The optimizer's name (`sgd`, `adamw`), as checkpoints record it.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd { .. } => "sgd",
            OptimizerConfig::AdamW { .. } => "adamw",
        }
    }

    /// The optimizer over `params`.
    pub fn build(&self, params: Vec<Var>) -> Box<dyn Optimizer> {
        match *self {
            OptimizerConfig::Sgd {
                lr,
                momentum,
                weight_decay,
            } => Box::new(Sgd::new(params, lr, momentum, weight_decay)),
            OptimizerConfig::AdamW {
                lr,
                betas,
                eps,
                weight_decay,
            } => Box::new(AdamW::with_options(params, lr, betas, eps, weight_decay)),
        }
    }
}

/// Everything one training run needs, the same on every rank.
#[derive(Clone)]
pub struct TrainConfig {
    /// The model's name, recorded in checkpoints (resuming another model is an error).
    pub model_name: String,
    /// Seed of the initial parameters, recorded in checkpoints (resuming with another is an error).
    pub seed: u64,
    /// Initial parameters (safetensors, PyTorch state-dict names).
    pub init: Option<PathBuf>,
    /// Train until this step (a resumed run continues until it).
    pub steps: usize,
    /// Rows per rank per microbatch.
    pub batch_size: usize,
    /// Microbatches per step: the first `accum - 1` accumulate under `no_sync`.
    pub accum: usize,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// DDP's configuration; `None`: the ranks train independently, reducing no gradient (a
    /// compute-only baseline). Its recorder is the rank's.
    pub ddp: Option<DdpConfig>,
    /// Continue from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Write a checkpoint here (rank 0) at the end, and every `checkpoint_every` steps.
    pub checkpoint: Option<PathBuf>,
    /// Checkpoint period in steps.
    pub checkpoint_every: Option<usize>,
    /// Train on through non-finite losses and parameters instead of stopping.
    pub allow_nonfinite: bool,
    /// How DDP reduces each bucket and what its optimizer steps: a
    /// [`brigade_policies::PolicySpec`], or a closure making a user's own
    /// [`brigade_ddp::ReducerPolicy`]; every rank makes its own.
    pub comm_hook: Arc<dyn MakeCommHook>,
    /// Compute threads of each rank (default: the cores shared among the local ranks).
    pub compute_threads: Option<usize>,
    /// Where the model, batches, gradients and optimizer state live (rank r's GPU, see
    /// [`DeviceArg::for_rank`]).
    pub device: DeviceArg,
    /// When set (e.g. by SIGINT), every rank stops after the current step.
    pub stop: Option<&'static AtomicBool>,
    /// Record a step profile of each synchronized step (the last one is kept).
    pub profile: bool,
    /// Keep the profile of every step in this range, not only the last (`--profile-steps`).
    pub profile_steps: Option<std::ops::Range<usize>>,
    /// Tune DDP's bucket cap as the run goes (`--bucket-mb auto`); needs `ddp`.
    pub autotune: Option<AutotuneConfig>,
    /// Draw a progress bar on rank 0 (stderr) while [`crate::fit()`] runs.
    pub progress: bool,
}

/// What one step did.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    /// The step's index.
    pub step: usize,
    /// Mean loss over the ranks, before the step's update.
    pub loss: f64,
    /// Wall time of the step on this rank, in milliseconds.
    pub ms: f64,
    /// A rank was asked to stop: this was the last step.
    pub stop: bool,
    /// What DDP handed to its collectives during the step on this rank (gradient reduction,
    /// bucket rebuilding; not the step's own loss agreement).
    pub sent: CommBytes,
}

/// What a rank's run produced.
pub struct TrainOutcome {
    /// First step run (non-zero after a resume).
    pub first_step: usize,
    /// Mean loss over the ranks of each step run.
    pub losses: Vec<f64>,
    /// This rank's wall time of each step run, in milliseconds.
    pub step_ms: Vec<f64>,
    /// What DDP handed to its collectives in each step run, on this rank.
    pub sent: Vec<CommBytes>,
    /// Stopped before `steps` because a stop was requested.
    pub interrupted: bool,
    /// The error every rank agreed on that ended the run early (a non-finite loss or
    /// parameters): the steps before it are kept, the last good checkpoint is not overwritten.
    pub stopped: Option<Error>,
    /// Why the final checkpoint could not be written (rank 0), so that the run's other
    /// outputs are still written and the failure is named beside theirs.
    pub checkpoint_error: Option<String>,
    /// The last synchronized step's profile, this rank's entry only (when profiling).
    pub profile: Option<StepProfile>,
    /// The profiles of the steps in `profile_steps`, in order, this rank's entries only.
    pub profiles: Vec<StepProfile>,
    /// What the bucket-cap autotuner chose and predicted (with `autotune`).
    pub autotune: Option<AutotuneReport>,
    /// DDP buckets after the last step (empty without DDP).
    pub buckets: Vec<BucketInfo>,
    /// This rank's gradient memory (absent without DDP).
    pub memory: Option<MemoryReport>,
    /// This rank's memory after the last step, measured (absent without DDP).
    pub rank_memory: Option<RankMemory>,
    /// The final parameters (rank 0 only; empty elsewhere).
    pub params: Vec<(String, Tensor)>,
}

impl TrainOutcome {
    /// The last step run, if any.
    pub fn last_step(&self) -> Option<usize> {
        (self.first_step + self.losses.len())
            .checked_sub(1)
            .filter(|_| !self.losses.is_empty())
    }
}

/// What the ranks agreed on at the end of a step.
struct StepStatus {
    loss: f64,
    nonfinite: bool,
    stop: bool,
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
    /// Tunes the bucket cap after the steps (`--bucket-mb auto`).
    autotune: Option<Autotuner>,
    /// The profiles of the steps in `profile_steps` so far.
    profiles: Vec<StepProfile>,
}

impl<'a> Trainer<'a> {
    /// Takes this rank's `model` (loading `init` into it if given), builds the optimizer,
    /// resumes from the checkpoint if asked, and wraps the model in DDP over the rank's
    /// communicator.
    pub fn new(
        cfg: &'a TrainConfig,
        model: Box<dyn Model>,
        data: &'a dyn DataSource,
        ctx: &'a RankContext,
    ) -> Result<Self> {
        set_compute_threads(cfg.compute_threads.unwrap_or_else(|| ctx.default_compute_threads()));
        if let Some(init) = &cfg.init {
            load_params(model.params(), init)?;
        }
        let mut opt = cfg.optimizer.build(model.params().params().to_vec());
        let first_step = match &cfg.resume {
            Some(path) => {
                let id = CheckpointIdentity {
                    model: &cfg.model_name,
                    optimizer: cfg.optimizer.name(),
                    seed: cfg.seed,
                    data: data.fingerprint(),
                    zero: zero_stage(cfg),
                    world_size: ctx.world_size,
                };
                load_checkpoint(path, &id, model.as_ref(), opt.as_mut())?
            }
            None => 0,
        };
        if first_step > cfg.steps {
            return Err(Error::Usage(format!(
                "the checkpoint is at step {first_step}, past --steps {}",
                cfg.steps
            )));
        }
        let device = cfg.device.for_rank(crate::launch::nccl::gpu_rank(ctx))?;
        if device != Device::Cpu {
            opt = move_to_device(model.as_ref(), opt.as_ref(), &cfg.optimizer, device)?;
        }
        let meter = CommMeter::new();
        let ddp = match &cfg.ddp {
            Some(d) => {
                let comm: Arc<dyn Communicator> = Arc::new(Metered::new(ctx.comm.clone(), meter.clone()));
                let d = DdpConfig {
                    recorder: ctx.recorder.clone(),
                    ..d.clone()
                };
                let policy = cfg.comm_hook.make(ctx.rank)?;
                // NCCL reduces on the GPU's comm stream (not metered); otherwise the host stream
                // over the metered communicator.
                Some(match crate::launch::nccl::bucket_stream(ctx, device)? {
                    Some(stream) => DistributedDataParallel::with_stream(model.params(), comm, stream, d, policy)?,
                    None => DistributedDataParallel::new(model.params(), comm, d, policy)?,
                })
            }
            None => None,
        };
        // The policy builds what is stepped (ZeRO: this rank's shard of every bucket only).
        if let Some(ddp) = &ddp {
            let build = |params: Vec<Var>| cfg.optimizer.build(params);
            opt = Box::new(ddp.optimizer(opt, &build)?);
        }
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
    pub fn step(&mut self) -> Result<StepOutcome> {
        let s = self.next_step;
        let (rank, world) = (self.ctx.rank, self.ctx.world_size);
        let (b, k) = (self.cfg.batch_size, self.cfg.accum);
        let t0 = Instant::now();
        let sent_before = self.meter.totals();
        let step_span = self.begin(EventKind::Step(s));
        self.model.params().zero_grad()?;
        // The microbatches' losses add up where they are computed; read back once per step.
        let mut step_loss: Option<Tensor> = None;
        for j in 0..k {
            let mb = Microbatch {
                step: s,
                index: j,
                accum: k,
                rank,
                world_size: world,
                rows: b,
            };
            let batch = batch_on(self.data.batch(&mb)?, self.device)?;
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
        let status = self.agree(local_loss)?;
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
        if std::mem::take(&mut self.checkpoint_due) {
            // the state this step started from gave a finite loss: it is a good checkpoint
            match self.checkpoint() {
                Ok(()) => {}
                Err(e) if e.is_agreed() => {
                    self.end(step_span);
                    return Err(e);
                }
                Err(e) => self.checkpoint_failed = Some(e),
            }
        }
        let os = self.begin(EventKind::Optimizer);
        let opt_start = Instant::now();
        self.opt.step()?;
        let opt_end = Instant::now();
        self.end(os);
        self.end(step_span);
        self.next_step += 1;
        if let (true, Some(ddp)) = (self.cfg.profile, &self.ddp) {
            let pass = ddp.last_pass();
            self.profile = RankProfile::from_pass(rank, t0, &pass, (opt_start, opt_end), Instant::now()).map(|r| {
                let params = self
                    .model
                    .params()
                    .params()
                    .iter()
                    .map(|p| {
                        let v = p.value();
                        let bytes = if p.requires_grad() {
                            v.numel() * v.dtype().size_in_bytes()
                        } else {
                            0
                        };
                        ParamProfile {
                            name: p.name().unwrap_or("<unnamed>").to_string(),
                            bytes,
                            shape: p.shape(),
                        }
                    })
                    .collect();
                // the caps this step ran with (the autotuner may change them below)
                let (bucket_cap_mb, first_bucket_cap_mb) = ddp.bucket_caps();
                StepProfile {
                    version: PROFILE_VERSION,
                    world_size: world,
                    bucket_cap_mb,
                    first_bucket_cap_mb,
                    policy: Some(ddp.profile_policy()),
                    params,
                    ranks: vec![r],
                }
            });
        }
        if let (Some(p), Some(range)) = (&self.profile, &self.cfg.profile_steps) {
            if range.contains(&s) {
                self.profiles.push(p.clone());
            }
        }
        if let (Some(tuner), Some(ddp)) = (self.autotune.as_mut(), &self.ddp) {
            let mine = RankProfile::from_pass(rank, t0, &ddp.last_pass(), (opt_start, opt_end), Instant::now());
            tuner.observe(ddp, s, mine)?;
        }
        Ok(StepOutcome {
            step: s,
            loss: status.loss,
            ms: t0.elapsed().as_secs_f64() * 1e3,
            stop: status.stop,
            sent: self.meter.totals() - sent_before,
        })
    }

    /// The ranks' one all-reduce per step: mean loss, whether any rank's loss is not finite,
    /// whether any rank was asked to stop.
    fn agree(&self, local_loss: f64) -> Result<StepStatus> {
        let stop = self.stop_requested || self.cfg.stop.is_some_and(|f| f.load(Ordering::SeqCst));
        let nonfinite = !local_loss.is_finite();
        if self.ctx.world_size == 1 {
            return Ok(StepStatus {
                loss: local_loss,
                nonfinite,
                stop,
            });
        }
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let mine = vec![local_loss as f32, flag(nonfinite), flag(stop)];
        let all = self
            .ctx
            .comm
            .all_reduce(Buffer::F32(mine), ReduceOp::Avg, STEP_STATUS_TAG)
            .wait()?;
        let Some(&[loss, nonfinite, stop]) = all.as_f32() else {
            return Err(Error::Usage(format!(
                "the step status all-reduce returned {all:?}, expected 3 f32"
            )));
        };
        let loss = f64::from(loss);
        Ok(StepStatus {
            loss,
            nonfinite: nonfinite > 0.0 || !loss.is_finite(),
            stop: stop > 0.0,
        })
    }

    /// Writes the checkpoint (rank 0) of the state after the last step run. Unless
    /// `allow_nonfinite`, first checks that every parameter is finite, so that a diverged run
    /// never overwrites the last good checkpoint.
    pub fn checkpoint(&mut self) -> Result<()> {
        let Some(path) = &self.cfg.checkpoint else {
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
        if self.ctx.rank == 0 {
            let id = CheckpointIdentity {
                model: &self.cfg.model_name,
                optimizer: self.cfg.optimizer.name(),
                seed: self.cfg.seed,
                data: self.data.fingerprint(),
                zero: zero_stage(self.cfg),
                world_size: self.ctx.world_size,
            };
            save_checkpoint(path, &id, self.model.as_ref(), self.opt.as_ref(), self.next_step)?;
        }
        self.checkpointed = Some(self.next_step);
        Ok(())
    }

    /// Steps until `steps` (or a stop request), checkpointing every `checkpoint_every` steps and
    /// at the end; `on_step` sees every step (e.g. to draw progress).
    pub fn run(mut self, mut on_step: impl FnMut(&StepOutcome)) -> Result<TrainOutcome> {
        let (mut losses, mut step_ms, mut sent, mut interrupted) = (vec![], vec![], vec![], false);
        let (mut stopped, mut checkpoint_error) = (None, None);
        while self.next_step < self.cfg.steps {
            let s = match self.step() {
                Ok(s) => s,
                Err(e) if e.is_agreed() => {
                    stopped = Some(e);
                    break;
                }
                Err(e) => return Err(e),
            };
            losses.push(s.loss);
            step_ms.push(s.ms);
            sent.push(s.sent);
            on_step(&s);
            // Rank 0 could not write the step's periodic checkpoint: every rank stops after the
            // next step (they agree on it then), and the outputs are written before the error.
            if let Some(e) = self.checkpoint_failed.take() {
                checkpoint_error.get_or_insert(format!("--checkpoint (training stopped after the next step): {e}"));
                self.stop_requested = true;
            }
            if s.stop {
                interrupted = self.next_step < self.cfg.steps;
                break;
            }
            // Due now, written by the next step once its loss is finite (or at the end).
            self.checkpoint_due = self
                .cfg
                .checkpoint_every
                .is_some_and(|e| e > 0 && self.next_step % e == 0);
        }
        // The end (also of a run of zero steps, or an interrupted one) is always checkpointed,
        // unless the run diverged (the last good checkpoint stays). A failed write there is
        // reported with the other outputs, which are still written.
        if stopped.is_none() && checkpoint_error.is_none() && self.checkpointed != Some(self.next_step) {
            match self.checkpoint() {
                Ok(()) => {}
                Err(e) if e.is_agreed() => stopped = Some(e),
                Err(e) => checkpoint_error = Some(format!("--checkpoint: {e}")),
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
    Ok(match batch {
        Batch::Classify { inputs, targets } => Batch::Classify {
            inputs: inputs.to_device(device)?,
            targets: targets.to_device(device)?,
        },
        Batch::Tokens { tokens } => Batch::Tokens {
            tokens: tokens.to_device(device)?,
        },
    })
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
