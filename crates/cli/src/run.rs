//! A training run from the command line's flags: the one place where the flags become plain
//! configurations ([`LaunchConfig`], [`TrainConfig`]), the model and the dataset; then the
//! library's [`fit()`] trains and returns rank 0's [`RunReport`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use brigade::config::{CheckpointConfig, Instrumentation};
use brigade::fit::fit;
pub use brigade::fit::RunReport;
use brigade::launch::{net_model, CommBackend, LaunchConfig};
use brigade::observe::TrainObserver;
use brigade::{OptimizerConfig, TrainConfig};
use brigade_comm::Recorder;
use brigade_ddp::DdpConfig;
use brigade_models::{Dataset, ModelKind};

use crate::args::{OptimizerName, RunArgs};
use crate::error::{in_flag_terms, Error, Result};

/// What a run does besides training.
#[derive(Clone, Default)]
pub struct RunOptions {
    /// Reduce no gradient: the same ranks train independently (the sweep's compute-only
    /// baseline; they still agree on the loss and on stopping once per step).
    pub compute_only: bool,
    /// Record compute and comm events for a timeline.
    pub record: bool,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Write a checkpoint (parameters + optimizer state) here, from rank 0.
    pub checkpoint: Option<PathBuf>,
    /// Also checkpoint every this many steps.
    pub checkpoint_every: Option<usize>,
    /// Record a step profile of the last synchronized step on every rank.
    pub profile: bool,
    /// Also keep the profile of every step in this range (`--profile-steps`).
    pub profile_steps: Option<std::ops::Range<usize>>,
    /// Who watches the run: the progress bar, the summary, the signals (see
    /// [`crate::report`], [`crate::signal`]).
    pub observer: Option<Arc<dyn TrainObserver>>,
}

/// Loads the dataset the flags name and checks it can feed one global step of `world` ranks.
pub fn load_data(args: &RunArgs, kind: &ModelKind, world: usize) -> Result<Dataset> {
    let data = match (&args.data, kind) {
        (Some(path), _) => Dataset::from_safetensors(path, kind)?,
        (None, ModelKind::Mlp(c)) => Dataset::teacher(8192, c.in_dim(), c.n_classes(), args.seed)?,
        (None, ModelKind::Gpt(c)) => Dataset::builtin_text(c.context, args.seed)?,
    };
    let global = world.saturating_mul(args.rows_per_rank()); // bounded by RunArgs::validate
    if data.len() < global {
        return Err(Error::Usage(format!(
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
    if args.backend == CommBackend::Mpi {
        if args.world_size != 1 && args.world_size != world {
            return Err(Error::Usage(format!(
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
                std::fs::metadata(path).map_err(|e| Error::Io {
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
        // under MPI the job ends inside the launch: every process that reports says why
        on_fatal: Some(Arc::new(|e| eprintln!("error: {}", in_flag_terms(e)))),
    }
}

/// What every rank trains, as the flags say (a policy sweep changes the policy of it).
pub fn train_config(args: &RunArgs, opts: &RunOptions) -> Result<TrainConfig> {
    let optimizer = match args.optimizer {
        OptimizerName::Sgd => OptimizerConfig::Sgd {
            lr: args.lr,
            momentum: args.momentum(),
            weight_decay: args.weight_decay(),
        },
        OptimizerName::Adamw => OptimizerConfig::adamw(args.lr, args.weight_decay),
    };
    let cap = args.bucket_cap()?;
    let ddp = DdpConfig {
        bucket_cap_mb: cap,
        first_bucket_cap_mb: args.first_bucket_cap(cap),
        find_unused_parameters: args.find_unused_parameters,
        ..DdpConfig::default()
    };
    Ok(TrainConfig {
        model_name: args.model.kind().name().into(),
        seed: args.seed,
        init: args.init.clone(),
        accum: args.accum,
        ddp: (!opts.compute_only).then_some(ddp),
        comm_hook: Arc::new(args.hook_spec()),
        autotune: args.autotune_config(),
        allow_nonfinite: args.allow_nonfinite,
        compute_threads: args.threads_per_rank,
        device: args.device,
        checkpoint: CheckpointConfig {
            resume: opts.resume.clone(),
            path: opts.checkpoint.clone(),
            every: opts.checkpoint_every,
        },
        instrument: Instrumentation {
            profile: opts.profile,
            profile_steps: opts.profile_steps.clone(),
            observer: opts.observer.clone(),
        },
        ..TrainConfig::new(args.steps, args.batch_size, optimizer)
    })
}

/// Runs the training the flags describe: the model `--model` names, on the dataset the flags
/// name, through the library's [`fit()`]. Under MPI, ranks other than 0 exit here once training
/// succeeded (rank 0 alone reports and writes files).
pub fn run(args: &RunArgs, opts: &RunOptions) -> Result<RunReport> {
    args.validate()?;
    run_config(args, opts, &train_config(args, opts)?)
}

/// Runs `train_cfg` (from [`train_config`], possibly changed: a policy sweep's row) on the
/// ranks, model and data `args` name; `args` were checked for `train_cfg`'s policy
/// ([`RunArgs::validate_for`]).
pub fn run_config(args: &RunArgs, opts: &RunOptions, train_cfg: &TrainConfig) -> Result<RunReport> {
    let launch_cfg = launch_config(args, opts);
    // Asking for a device this machine cannot serve is one error before any rank starts.
    args.device.for_rank(0)?;
    if args.backend == CommBackend::Nccl {
        brigade::launch::nccl::require(args.world_size)?;
    }
    let kind = args.model.kind();
    let report = fit(
        &launch_cfg,
        train_cfg,
        |world| setup(args, opts, &kind, world).map_err(into_library),
        |_| Ok(kind.build(args.seed)?),
    )?;
    if report.rank != 0 {
        std::process::exit(0);
    }
    Ok(report)
}

/// A setup error of this program's (worded for its user) as the library carries it: under MPI
/// every rank reports the first failing rank's message.
fn into_library(e: Error) -> brigade::Error {
    match e {
        Error::Run(e) => e,
        e => brigade::Error::Config(e.to_string()),
    }
}
