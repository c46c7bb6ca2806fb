//! The training loop as one call, over a user's model and data: [`fit()`] starts the ranks
//! ([`launch`]), has every rank build its own model and run a [`Trainer`] on its shard of the
//! data, and returns rank 0's view of the run as a [`RunReport`]: what `brigade train` runs,
//! with the same sharding, `no_sync` accumulation, checkpoint/resume, timeline, step profile and
//! progress bar.

use std::sync::Arc;
use std::time::Instant;

use brigade_comm::{all_gather_bytes, CommBytes, Event};
use brigade_ddp::overlap::{AutotuneReport, StepProfile};
use brigade_ddp::{BucketInfo, DdpConfig, MemoryReport, RankMemory};
use brigade_models::Model;
use brigade_policies::PolicySpec;
use brigade_tensor::Tensor;
use indicatif::{ProgressBar, ProgressStyle};

use crate::data::DataSource;
use crate::device::DeviceArg;
use crate::error::{Error, Result};
use crate::launch::{launch, Backend, LaunchConfig, RankContext};
use crate::trace_gather::gather_step_events;
use crate::trainer::{OptimizerConfig, TrainConfig, TrainOutcome, Trainer};

// The starting point of a user's run, kept beside `fit` so that trainer.rs holds the loop.
impl TrainConfig {
    /// `steps` steps of `batch_size` rows per rank with `optimizer`, and the defaults for the
    /// rest: one microbatch a step, DDP with PyTorch's bucket caps and all-reduce, the CPU, no
    /// checkpoint, no resume, no progress bar.
    pub fn new(steps: usize, batch_size: usize, optimizer: OptimizerConfig) -> Self {
        TrainConfig {
            model_name: "model".into(),
            seed: 0,
            init: None,
            steps,
            batch_size,
            accum: 1,
            optimizer,
            ddp: Some(DdpConfig::default()),
            resume: None,
            checkpoint: None,
            checkpoint_every: None,
            allow_nonfinite: false,
            comm_hook: Arc::new(PolicySpec::AllReduce),
            compute_threads: None,
            device: DeviceArg::Cpu,
            stop: None,
            profile: false,
            profile_steps: None,
            autotune: None,
            progress: false,
        }
    }
}

/// One step of every rank, recorded.
pub struct StepTimeline {
    /// The step.
    pub step: usize,
    /// Every rank's events of the step.
    pub events: Vec<Event>,
    /// Time zero of the trace.
    pub origin: Instant,
}

/// What a run produced, as seen from rank `rank` (rank 0 with threads; this process's rank under
/// MPI). Losses are global means over the ranks.
pub struct RunReport {
    /// The rank whose view this is: only rank 0's holds the final parameters.
    pub rank: usize,
    /// World size.
    pub world_size: usize,
    /// First step run (non-zero after a resume).
    pub first_step: usize,
    /// Global mean loss of each step run, before its update.
    pub losses: Vec<f64>,
    /// This rank's wall time of each step run, in milliseconds.
    pub step_ms: Vec<f64>,
    /// What this rank's DDP handed to its collectives in each step run (see
    /// [`brigade_comm::Metered`]).
    pub sent: Vec<CommBytes>,
    /// DDP buckets after the last step (empty without DDP).
    pub buckets: Vec<BucketInfo>,
    /// This rank's gradient memory (absent without DDP).
    pub memory: Option<MemoryReport>,
    /// This rank's memory, measured: parameters, gradients, optimizer state, comm scratch
    /// (absent without DDP).
    pub rank_memory: Option<RankMemory>,
    /// The last step run, recorded on every rank (when the launch had a recorder and a step ran).
    pub timeline: Option<StepTimeline>,
    /// The final parameters (rank 0 only; empty elsewhere).
    pub params: Vec<(String, Tensor)>,
    /// Stopped before `steps` because a stop was requested (after a finished step).
    pub interrupted: bool,
    /// The error every rank agreed on that ended the run early (it diverged); the report
    /// holds the steps before it, and the caller writes them before reporting it.
    pub stopped: Option<Error>,
    /// Why rank 0 could not write the final checkpoint (the other outputs are still written).
    pub checkpoint_error: Option<String>,
    /// Every rank's profile of the last synchronized step (when profiling).
    pub profile: Option<StepProfile>,
    /// Every rank's profile of each step in `TrainConfig::profile_steps`, in order.
    pub profiles: Vec<StepProfile>,
    /// Rank 0's account of the bucket-cap autotuner (`--bucket-mb auto`).
    pub autotune: Option<AutotuneReport>,
}

/// What one rank returns: its training outcome, and under MPI the recorded last step of
/// every rank (each process records only its own).
struct RankOut {
    train: TrainOutcome,
    gathered: Option<Vec<Event>>,
}

/// Trains on every rank `launch_cfg` starts. `data(world_size)` prepares the data once per
/// process (under MPI every process's must succeed, or all fail with the first failing rank's
/// error); `model(ctx)` builds rank `ctx.rank`'s own model (DDP then starts every rank from rank
/// 0's values). Returns this process's lowest rank's view of the run, or the root-cause error
/// naming its rank.
///
/// ```
/// use brigade::launch::LaunchConfig;
/// use brigade::models::{Dataset, Mlp, MlpConfig};
/// use brigade::trainer::{OptimizerConfig, TrainConfig};
///
/// let cfg = TrainConfig::new(5, 32, OptimizerConfig::adamw(1e-3, None));
/// let report = brigade::fit(
///     &LaunchConfig::threads(2),
///     &cfg,
///     |_world| Dataset::teacher(4096, 16, 4, 0).map_err(Into::into),
///     |_ctx| Ok(Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 4]), 0)?)),
/// )?;
/// assert_eq!(report.losses.len(), 5); // the mean loss over the ranks of each step
/// assert_eq!(report.params.len(), 4); // rank 0's trained `layers.{0,1}.{weight,bias}`
/// # Ok::<(), brigade::Error>(())
/// ```
pub fn fit<D: DataSource>(
    launch_cfg: &LaunchConfig,
    cfg: &TrainConfig,
    data: impl FnOnce(usize) -> Result<D>,
    model: impl Fn(&RankContext) -> Result<Box<dyn Model>> + Sync,
) -> Result<RunReport> {
    let launched = launch(launch_cfg, data, |ctx, data| rank_main(ctx, cfg, model(ctx)?, data))?;
    let world_size = launched.world_size;
    let (rank, RankOut { train, gathered }) = launched
        .results
        .into_iter()
        .next()
        .ok_or_else(|| Error::Usage("the launch ran no rank in this process".into()))?;
    let timeline = match (&launch_cfg.recorder, train.last_step()) {
        (Some(rec), Some(step)) => Some(StepTimeline {
            step,
            events: gathered.unwrap_or_else(|| rec.step_events(step)),
            origin: rec.origin(),
        }),
        _ => None,
    };
    Ok(RunReport {
        rank,
        world_size,
        first_step: train.first_step,
        losses: train.losses,
        step_ms: train.step_ms,
        sent: train.sent,
        buckets: train.buckets,
        memory: train.memory,
        rank_memory: train.rank_memory,
        timeline,
        params: train.params,
        interrupted: train.interrupted,
        stopped: train.stopped,
        checkpoint_error: train.checkpoint_error,
        profile: train.profile,
        profiles: train.profiles,
        autotune: train.autotune,
    })
}

/// One rank: train, with a progress bar on rank 0; gather every rank's profile entry, and under
/// MPI the recorded last step.
fn rank_main(ctx: &RankContext, cfg: &TrainConfig, model: Box<dyn Model>, data: &dyn DataSource) -> Result<RankOut> {
    let trainer = Trainer::new(cfg, model, data, ctx)?;
    let bar = (cfg.progress && ctx.rank == 0).then(|| {
        let bar = ProgressBar::new(cfg.steps.saturating_sub(trainer.first_step()) as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    let train = trainer.run(|s| {
        if let Some(bar) = &bar {
            bar.set_message(format!("step {} loss {:.4} | {:.1} ms/step", s.step, s.loss, s.ms));
            bar.inc(1);
        }
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let mut train = train?;
    // every rank's entries, on every rank (rank 0 writes the file); every rank kept as many
    for profile in train.profile.iter_mut().chain(train.profiles.iter_mut()) {
        let mine = serde_json::to_vec(&profile.ranks[0]).map_err(|e| Error::Usage(format!("step profile: {e}")))?;
        let all = all_gather_bytes(ctx.control.as_ref(), mine, "profile")?;
        profile.ranks = all
            .iter()
            .map(|b| serde_json::from_slice(b))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::Usage(format!("step profile from a peer: {e}")))?;
    }
    let gathered = match (&ctx.recorder, ctx.backend, train.last_step()) {
        (Some(rec), Backend::Mpi, Some(last)) => Some(gather_step_events(ctx.control.as_ref(), rec, last)?),
        _ => None,
    };
    Ok(RankOut { train, gathered })
}
