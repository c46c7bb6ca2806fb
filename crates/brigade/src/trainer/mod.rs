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
//! Under a join mode ([`DataConfig::join`](crate::config::DataConfig::join), uneven inputs) every step starts with the ranks'
//! agreement on which of them still have data ([`crate::join`]); a rank without data runs DDP's
//! join pass in place of forward and backward and the rest of the step like every rank, so
//! that every collective of the step has a partner on every rank.

use brigade_autograd::{LrSchedule, Optimizer};
use brigade_comm::{CommMeter, SpanGuard};
use brigade_ddp::overlap::{AutotuneProgress, Autotuner, ControlProfile, StepProfile};
use brigade_ddp::{DistributedDataParallel, MemoryReport, PeakParts, Phase};
use brigade_models::{Batch, Model, RngState, SamplerCursor, SamplerPosition};
use brigade_policies::StateLayout;
use std::sync::Arc;

use brigade_tensor::{Device, MemoryMeter};

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::join::JoinRun;
use crate::launch::RankContext;
use crate::observe::TrainObserver;
use crate::recipe::HyperparameterChange;
use crate::source::{DataLength, DataSource};

/// Tag of the evaluation's all-reduce (each rank's validation loss).
pub const EVAL_TAG: &str = "eval loss";

/// Name of the compute span of a joined rank's join pass on the timeline (its shadow
/// collectives run inside it).
pub const JOIN_SPAN: &str = "join (no data)";

/// Tag of the per-step agreement all-reduce (`[loss, non-finite, stop]`).
pub const STEP_STATUS_TAG: &str = "step status";

mod build;
mod run;
mod save;
mod step;

/// One rank's training loop: the run's inputs, the replica it trains, where its data and its
/// steps stand, and what it keeps of the run on the way.
pub struct Trainer<'a> {
    cfg: &'a TrainConfig,
    data: &'a dyn DataSource,
    ctx: &'a RankContext,
    replica: Replica,
    feed: Feed,
    at: Progress,
    /// The learning rate of every step.
    schedule: LrSchedule,
    resume: ResumeNotes,
    saves: Saves,
    records: Records,
}

/// What one rank trains: the model, where it lives, its optimizer and its DDP wrapper.
struct Replica {
    model: Box<dyn Model>,
    device: Device,
    opt: Box<dyn Optimizer>,
    ddp: Option<DistributedDataParallel>,
    /// Counts what DDP sends (`DdpConfig::meter`; the trainer's own collectives are not counted).
    meter: CommMeter,
}

/// Where the ranks' data comes from, step by step.
struct Feed {
    /// Rows each rank reads per epoch, known before step 0.
    lengths: DataLength,
    /// This rank's rows under [`DataOrder::Sampled`] (in order: `None`).
    cursor: Option<SamplerCursor>,
    /// Uneven inputs: each rank's steps, who has joined, the step's agreement (under a join
    /// mode only).
    join: Option<JoinRun>,
}

/// Where the run stands: what a checkpoint of the state before step `next_step` records.
struct Progress {
    first_step: usize,
    next_step: usize,
    /// Where the cursor stood when step `next_step` began.
    next_position: Option<SamplerPosition>,
    /// The model's dropout generator when step `next_step` began (a periodic checkpoint is
    /// written inside that step, after its forward passes drew their masks).
    next_rng: Option<RngState>,
    /// The loss of step `next_step - 1`, as a checkpoint records it (`None` before any step of
    /// the run or of the checkpoint it resumed).
    last_loss: Option<String>,
}

impl Progress {
    /// Where a run starts: at `first_step` (non-zero after a resume), with the feed's cursor
    /// and the replica's dropout generator as they stand before it, and the loss of the step
    /// before it that the resumed checkpoint records.
    fn at_start(first_step: usize, feed: &Feed, replica: &Replica, last_loss: Option<String>) -> Progress {
        Progress {
            first_step,
            next_step: first_step,
            next_position: feed.cursor.as_ref().map(SamplerCursor::position),
            next_rng: replica.model.rng_state(),
            last_loss,
        }
    }
}

/// What the resume told this run, to tell the observer.
struct ResumeNotes {
    /// The hyperparameters this run changed from the checkpoint it resumed.
    changes: Vec<HyperparameterChange>,
    /// What to say of the resume: a defaulted `T` this run goes past, fp16's loss scale under
    /// another precision, a sampled run at another batch, a dropout run on other ranks.
    notes: Vec<String>,
}

/// The checkpoints of the run so far.
struct Saves {
    /// The lineage this run's checkpoints continue (its generation taken at the first write).
    lineage: crate::checkpoint_files::Lineage,
    /// The step of the state last written.
    written: Option<usize>,
    /// A periodic checkpoint of the state the next step starts from is due: it is written in
    /// that step once its loss is known to be finite, so that a state that diverges is never
    /// written over the last good checkpoint.
    due: bool,
    /// Every rank's policy state and the buckets' grouping as they stood when the step with a
    /// due checkpoint began (on rank 0): that step's backward changes a stateful policy's state
    /// (and the first one regroups the buckets) before the checkpoint is written.
    at_start: Option<crate::checkpoint::DistributedState>,
    /// Rank 0 could not write the periodic checkpoint of the last step (not an agreed error).
    failed: Option<Error>,
    /// This rank asks every rank to stop after the next step (rank 0 could not write a
    /// periodic checkpoint).
    stop_requested: bool,
}

impl Saves {
    /// No checkpoint written yet, in `lineage`.
    fn new(lineage: crate::checkpoint_files::Lineage) -> Saves {
        Saves {
            lineage,
            written: None,
            due: false,
            at_start: None,
            failed: None,
            stop_requested: false,
        }
    }
}

/// What the run records of its steps beside their outcomes.
#[derive(Default)]
struct Records {
    /// The profile of the last synchronized step (this rank's entry only), when profiling.
    profile: Option<StepProfile>,
    /// The profiles of the steps in `profile_steps` so far.
    profiles: Vec<StepProfile>,
    /// The collectives the last step issued itself (the agreement on the loss), for its profile.
    step_control: Vec<ControlProfile>,
    /// Tunes the bucket cap after the steps ([`DistributedConfig::autotune`](crate::config::DistributedConfig::autotune)).
    autotune: Option<Autotuner>,
    /// Counts the tensor storages of this rank's thread: the activations and the peak of
    /// each step.
    memory: Arc<MemoryMeter>,
    /// The last step's activations and peak, in bytes ([`MemoryReport`](brigade_ddp::MemoryReport)'s).
    step_memory: StepMemory,
    /// The run's peak so far, from the model's construction on.
    run_peak: RunPeak,
    /// The meter this trainer installed on its thread (none was), taken off when it drops.
    _installed_meter: Option<InstalledMeter>,
}

impl Records {
    /// The records of a run before its first step: none yet, the autotuner the configuration
    /// asks for ([`DistributedConfig::autotune`](crate::config::DistributedConfig::autotune)),
    /// continuing from a resumed checkpoint's `autotuned` progress, and the thread's `memory`
    /// meter with the guard of the one this trainer installed.
    fn new(
        cfg: &TrainConfig,
        autotuned: Option<AutotuneProgress>,
        memory: Arc<MemoryMeter>,
        installed_meter: Option<InstalledMeter>,
    ) -> Result<Records> {
        let autotune = cfg.distributed.as_ref().and_then(|d| d.autotune.clone());
        let run_peak = RunPeak {
            // what building the model, its optimizer and DDP held at once
            construction: memory.peak(),
            ..RunPeak::default()
        };
        Ok(Records {
            run_peak,
            autotune: autotune
                .map(|c| Autotuner::resume(c, autotuned.unwrap_or_default()))
                .transpose()?,
            memory,
            _installed_meter: installed_meter,
            ..Records::default()
        })
    }
}

/// A meter a trainer installed on its thread: uninstalled when dropped (also when the trainer
/// fails to build), if it is still the thread's meter.
struct InstalledMeter(Arc<MemoryMeter>);

impl InstalledMeter {
    /// This thread's meter, and the guard of it when there was none and one was installed here.
    fn on_this_thread() -> (Arc<MemoryMeter>, Option<InstalledMeter>) {
        match MemoryMeter::current() {
            Some(m) => (m, None),
            None => {
                let m = MemoryMeter::new();
                MemoryMeter::install(Some(m.clone()));
                (m.clone(), Some(InstalledMeter(m)))
            }
        }
    }
}

impl Drop for InstalledMeter {
    fn drop(&mut self) {
        if MemoryMeter::current().is_some_and(|m| Arc::ptr_eq(&m, &self.0)) {
            MemoryMeter::install(None);
        }
    }
}

/// The most bytes alive at once over the run's steps, what held them, and when; and what
/// building the model, its optimizer and DDP held at once before them.
#[derive(Debug, Clone, Copy, Default)]
struct RunPeak {
    bytes: usize,
    parts: PeakParts,
    step: Option<usize>,
    construction: usize,
}

impl RunPeak {
    /// Takes `meter`'s peak since its last reset (of `step`) if it is the run's.
    fn observe(&mut self, meter: &MemoryMeter, step: usize) {
        if meter.peak() > self.bytes || self.step.is_none() {
            *self = RunPeak {
                bytes: meter.peak(),
                parts: PeakParts::of(meter),
                step: Some(step),
                construction: self.construction,
            };
        }
    }

    /// `measured` (DDP's report of the rank) with the last step's activations and peak and the
    /// run's peak.
    fn report(&self, last: StepMemory, measured: MemoryReport) -> MemoryReport {
        MemoryReport {
            activations: last.activations,
            peak: self.bytes.max(last.peak),
            peak_parts: self.parts,
            peak_step: self.step,
            last_step_peak: last.peak,
            construction_peak: self.construction,
            ..measured
        }
    }
}

/// What the [`MemoryMeter`] measured of one step.
#[derive(Debug, Clone, Copy, Default)]
struct StepMemory {
    /// The most bytes a microbatch's forward left alive (held by its graph).
    activations: usize,
    /// The most bytes alive at once.
    peak: usize,
}

impl Trainer<'_> {
    /// The first step this trainer runs (non-zero after a resume).
    pub fn first_step(&self) -> usize {
        self.at.first_step
    }

    /// How many rows each rank reads per epoch (rows in order never end), known before step 0.
    pub fn rank_lengths(&self) -> &DataLength {
        &self.feed.lengths
    }

    /// Where this rank's sampler stands: the epoch and row the next step reads first (`None`
    /// for rows in order).
    pub fn sampler_position(&self) -> Option<SamplerPosition> {
        self.at.next_position
    }

    /// The hyperparameters this run changed from the checkpoint it resumed (it uses its own).
    pub fn resume_changes(&self) -> &[HyperparameterChange] {
        &self.resume.changes
    }

    /// A compute span of `phase` on the run's timeline, ended when the guard drops (`None`
    /// without a recorder).
    fn span(&self, phase: Phase) -> Option<SpanGuard> {
        self.ctx.recorder.as_ref().map(|r| r.span(self.ctx.rank, phase.kind()))
    }

    /// The run's observer, if any.
    fn observer(&self) -> Option<&dyn TrainObserver> {
        self.cfg.runtime.instrument.observer.as_deref()
    }
}

/// The compute threads of each rank: the configured number, or the host's cores shared out among
/// its ranks.
fn compute_threads(cfg: &TrainConfig, ctx: &RankContext) -> usize {
    cfg.runtime
        .compute_threads
        .unwrap_or_else(|| ctx.default_compute_threads())
}

/// How a run's policy lays the training state out over the ranks (plain DDP, or no DDP at all:
/// the whole state on every rank).
fn state_layout(cfg: &TrainConfig) -> StateLayout {
    cfg.distributed
        .as_ref()
        .map_or(StateLayout::WHOLE, |d| d.policy.state_layout())
}

/// `batch` on `device` (the same tensors on the CPU).
fn batch_on(batch: Batch, device: Device) -> Result<Batch> {
    if device == Device::Cpu {
        return Ok(batch);
    }
    batch.try_map(|_, t| Ok(t.to_device(device)?))
}
