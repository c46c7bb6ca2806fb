//! A training run from the command line's flags: the one place where the flags become plain
//! configurations ([`LaunchConfig`], [`TrainConfig`]); then [`launch`] starts the ranks, each
//! runs a [`Trainer`], and rank 0's outcome becomes the [`RunReport`].

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use brigade_comm::{all_gather_bytes, Event, Recorder};
use brigade_ddp::overlap::StepProfile;
use brigade_ddp::{BucketInfo, DdpConfig, MemoryReport};
use brigade_models::{Dataset, ModelKind};
use brigade_tensor::Tensor;
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{OptimizerName, RunArgs};
use crate::error::{CliError, Result};
pub use crate::launch::default_threads;
use crate::launch::{launch, net_model, Backend, LaunchConfig, RankContext};
use crate::trace_gather::gather_step_events;
use crate::trainer::{OptimizerConfig, TrainConfig, TrainOutcome, Trainer};

/// What a run does besides training.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Reduce no gradient: the same ranks train independently (the sweep's compute-only
    /// baseline; they still agree on the loss and on stopping once per step).
    pub compute_only: bool,
    /// Record compute and comm events for a timeline.
    pub record: bool,
    /// Draw a progress bar on rank 0.
    pub progress: bool,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Write a checkpoint (parameters + optimizer state) here, from rank 0.
    pub checkpoint: Option<PathBuf>,
    /// Also checkpoint every this many steps.
    pub checkpoint_every: Option<usize>,
    /// Stop after the current step once this is set (see [`crate::signal`]).
    pub stop: Option<&'static AtomicBool>,
    /// Record a step profile of the last synchronized step on every rank.
    pub profile: bool,
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

/// What a run produced, as seen from rank 0 (losses are global means over ranks).
pub struct RunReport {
    /// World size.
    pub world_size: usize,
    /// First step run (non-zero after a resume).
    pub first_step: usize,
    /// Global mean loss of each step run, before its update.
    pub losses: Vec<f64>,
    /// Rank 0's wall time of each step run, in milliseconds.
    pub step_ms: Vec<f64>,
    /// DDP buckets after the last step (empty when compute-only).
    pub buckets: Vec<BucketInfo>,
    /// Rank 0's gradient memory (absent when compute-only).
    pub memory: Option<MemoryReport>,
    /// The last step run, recorded on every rank (when recording and a step ran).
    pub timeline: Option<StepTimeline>,
    /// Rank 0's final parameters.
    pub params: Vec<(String, Tensor)>,
    /// Stopped before `--steps` by SIGINT/SIGTERM (after a finished step).
    pub interrupted: bool,
    /// The error every rank agreed on that ended the run early (it diverged); the report
    /// holds the steps before it, and the caller writes them before reporting it.
    pub stopped: Option<CliError>,
    /// Why rank 0 could not write the final checkpoint (the other outputs are still written).
    pub checkpoint_error: Option<String>,
    /// Every rank's profile of the last synchronized step (when profiling).
    pub profile: Option<StepProfile>,
}

/// What one rank returns: its training outcome, and under MPI the recorded last step of
/// every rank (each process records only its own).
struct RankOut {
    train: TrainOutcome,
    gathered: Option<Vec<Event>>,
}

/// Loads the dataset the flags name and checks it can feed one global step of `world` ranks.
pub fn load_data(args: &RunArgs, kind: &ModelKind, world: usize) -> Result<Dataset> {
    let data = match (&args.data, kind) {
        (Some(path), _) => Dataset::from_safetensors(path, kind)?,
        (None, ModelKind::Mlp(c)) => Dataset::teacher(8192, c.in_dim(), c.n_classes(), args.seed)?,
        (None, ModelKind::Gpt(c)) => Dataset::builtin_text(c.context, args.seed)?,
    };
    let global = world * args.rows_per_rank();
    if data.len() < global {
        return Err(CliError::Usage(format!(
            "one step needs {global} rows (world size {world} x accum {} x batch size {}) but {} has {} rows",
            args.accum,
            args.batch_size,
            data.name(),
            data.len()
        )));
    }
    Ok(data)
}

/// What every process needs before its ranks start: under MPI the world size comes from
/// `mpirun`, and every file the run reads must exist on every rank.
fn setup(args: &RunArgs, opts: &RunOptions, kind: &ModelKind, world: usize) -> Result<Dataset> {
    if args.backend == Backend::Mpi {
        if args.world_size != 1 && args.world_size != world {
            return Err(CliError::Usage(format!(
                "--world-size {} but mpirun started {world} processes: drop --world-size (MPI's size is used) or pass -np {}",
                args.world_size, args.world_size
            )));
        }
        for (flag, path) in [
            ("--init", &args.init),
            ("--resume", &opts.resume),
            ("--data", &args.data),
        ] {
            if let Some(path) = path {
                std::fs::metadata(path).map_err(|e| CliError::Io {
                    path: format!("{flag} {}", path.display()),
                    source: e,
                })?;
            }
        }
    }
    load_data(args, kind, world)
}

/// How to start the ranks.
fn launch_config(args: &RunArgs, opts: &RunOptions) -> LaunchConfig {
    LaunchConfig {
        backend: args.backend,
        world_size: args.world_size,
        timeout: Duration::from_secs_f64(args.timeout_s),
        net: args.net_gbps.map(|g| net_model(g, args.net_latency_us)),
        recorder: opts.record.then(Recorder::new),
    }
}

/// What every rank trains.
fn train_config(args: &RunArgs, opts: &RunOptions) -> Result<TrainConfig> {
    let optimizer = match args.optimizer {
        OptimizerName::Sgd => OptimizerConfig::Sgd {
            lr: args.lr,
            momentum: args.momentum(),
            weight_decay: args.weight_decay(),
        },
        OptimizerName::Adamw => OptimizerConfig::adamw(args.lr, args.weight_decay),
    };
    let ddp = DdpConfig {
        bucket_cap_mb: args.bucket_cap()?,
        first_bucket_cap_mb: args.first_bucket_mb,
        find_unused_parameters: args.find_unused_parameters,
        ..DdpConfig::default()
    };
    Ok(TrainConfig {
        model: args.model.kind(),
        seed: args.seed,
        init: args.init.clone(),
        steps: args.steps,
        batch_size: args.batch_size,
        accum: args.accum,
        optimizer,
        ddp: (!opts.compute_only).then_some(ddp),
        resume: opts.resume.clone(),
        checkpoint: opts.checkpoint.clone(),
        checkpoint_every: opts.checkpoint_every,
        allow_nonfinite: args.allow_nonfinite,
        comm_hook: args.hook_spec(),
        profile: opts.profile,
        compute_threads: args.threads_per_rank,
        device: args.device,
        stop: opts.stop,
    })
}

/// One rank: train, with a progress bar on rank 0; under MPI, gather the recorded last step.
fn rank_main(ctx: &RankContext, cfg: &TrainConfig, data: &Dataset, progress: bool) -> Result<RankOut> {
    let trainer = Trainer::new(cfg, data, ctx)?;
    let bar = (progress && ctx.rank == 0).then(|| {
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
    let train = train?;
    let mut train = train;
    if let Some(profile) = train.profile.as_mut() {
        // every rank's entry, on every rank (rank 0 writes the file)
        let mine = serde_json::to_vec(&profile.ranks[0]).map_err(|e| CliError::Usage(format!("step profile: {e}")))?;
        let all = all_gather_bytes(ctx.control.as_ref(), mine, "profile")?;
        profile.ranks = all
            .iter()
            .map(|b| serde_json::from_slice(b))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| CliError::Usage(format!("step profile from a peer: {e}")))?;
    }
    let gathered = match (&ctx.recorder, ctx.backend, train.last_step()) {
        (Some(rec), Backend::Mpi, Some(last)) => Some(gather_step_events(ctx.control.as_ref(), rec, last)?),
        _ => None,
    };
    Ok(RankOut { train, gathered })
}

/// Runs the training the flags describe. Under MPI, ranks other than 0 exit here once
/// training succeeded (rank 0 alone reports and writes files).
pub fn run(args: &RunArgs, opts: &RunOptions) -> Result<RunReport> {
    args.validate()?;
    let launch_cfg = launch_config(args, opts);
    let train_cfg = train_config(args, opts)?;
    brigade::nccl::check_flags(args.backend, args.device, &args.hook_spec())?;
    // Asking for a device this machine cannot serve is one error before any rank starts.
    args.device.for_rank(0)?;
    if args.backend == Backend::Nccl {
        brigade::nccl::require(args.world_size)?;
    }
    let launched = launch(
        &launch_cfg,
        |world| setup(args, opts, &train_cfg.model, world),
        |ctx, data| rank_main(ctx, &train_cfg, data, opts.progress),
    )?;
    let world_size = launched.world_size;
    let Some(RankOut { train, gathered }) = launched.into_rank0() else {
        std::process::exit(0);
    };
    let timeline = match (&launch_cfg.recorder, train.last_step()) {
        (Some(rec), Some(step)) => Some(StepTimeline {
            step,
            events: gathered.unwrap_or_else(|| rec.step_events(step)),
            origin: rec.origin(),
        }),
        _ => None,
    };
    Ok(RunReport {
        world_size,
        first_step: train.first_step,
        losses: train.losses,
        step_ms: train.step_ms,
        buckets: train.buckets,
        memory: train.memory,
        timeline,
        params: train.params,
        interrupted: train.interrupted,
        stopped: train.stopped,
        checkpoint_error: train.checkpoint_error,
        profile: train.profile,
    })
}
