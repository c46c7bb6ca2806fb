//! A training run from the command line's flags: the one place where the flags become plain
//! configurations ([`LaunchConfig`], [`TrainConfig`]), the model and the dataset; then the
//! library's [`fit()`] trains and returns rank 0's [`RunReport`].

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use brigade::config::{
    CheckpointConfig, DataConfig, DistributedConfig, Instrumentation, ModelConfig, RecipeConfig, RuntimeConfig,
};
use brigade::fit::fit;
pub use brigade::fit::RunReport;
use brigade::launch::{net_model, CommBackend, LaunchConfig};
use brigade::observe::TrainObserver;
use brigade::recipe::{EvalConfig, EvalSource, HeldOut};
use brigade::source::{DataOrder, DataSource, RankShards};
use brigade::{OptimizerConfig, TrainConfig};
use brigade_comm::Recorder;
use brigade_ddp::DdpConfig;
use brigade_models::{Batch, Dataset, ModelKind, TextData, TokenFormat, ValSplit};

use crate::args::{OptimizerName, RunArgs};
use crate::error::{in_flag_terms, Error, Result};
use crate::outputs::OutputLocks;

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
    /// Keep only the newest this many checkpoints of a `{step}` path (`--keep-last`).
    pub checkpoint_keep_last: Option<usize>,
    /// This program's entries in every checkpoint's metadata (the plan of `--plan auto`).
    pub checkpoint_metadata: Vec<(String, String)>,
    /// Record a step profile of the last synchronized step on every rank.
    pub profile: bool,
    /// Also keep the profile of every step in this range (`--profile-steps`).
    pub profile_steps: Option<std::ops::Range<usize>>,
    /// Who watches the run: the progress bar, the summary, the signals (see
    /// [`crate::report`], [`crate::signal`]).
    pub observer: Option<Arc<dyn TrainObserver>>,
    /// Outputs that rank 0's process locks before it trains (see [`OutputLocks`]); the caller
    /// keeps them until it has written them.
    pub locks: Option<Arc<OutputLocks>>,
}

/// The share of a `--text` file kept apart for validation (its last bytes).
pub const TEXT_VAL_FRACTION: f64 = 0.1;

/// `--text`'s file cut into training rows and validation rows of the GPT's context (`None`
/// without `--text` or for another model). The validation rows (the last
/// [`TEXT_VAL_FRACTION`] of the file, `TextData::val`) are what an evaluation reads; training
/// reads the rest (`TextData::train`).
pub fn load_text(args: &RunArgs, kind: &ModelKind) -> Result<Option<TextData>> {
    match (&args.data.text, kind) {
        (Some(path), ModelKind::Gpt(c)) => Ok(Some(Dataset::from_text_file(
            path,
            c.context,
            &ValSplit::Fraction(TEXT_VAL_FRACTION),
            args.model.tokenizer,
        )?)),
        _ => Ok(None),
    }
}

/// Reads a data file (`--data`, `--eval-data`, a rank's file) by its first bytes: NumPy's
/// `.npy` magic, a zip archive (`.npz`, what `numpy.savez` writes), llm.c's shard magic, else
/// by its extension (`.npy`, `.npz`, `.bin` a token file unless its JSON header says
/// safetensors), else as safetensors (which has no magic: its first bytes are a length). A `--data-format`, or a `*` or `?` in the file name
/// (several shards), names token files.
fn read_dataset(path: &std::path::Path, kind: &ModelKind, format: Option<TokenFormat>) -> Result<Dataset> {
    use std::io::Read;
    let mut head = vec![];
    if let Ok(f) = std::fs::File::open(path) {
        // unreadable here: the reader below names the failure
        let _ = f.take(9).read_to_end(&mut head);
    }
    let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    let pattern = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains(['*', '?']));
    let tokens = |format| -> Result<Dataset> {
        let paths = brigade_models::tokens::expand_glob(path)?;
        Ok(Dataset::from_token_files(&paths, format, kind)?)
    };
    if pattern || format.is_some() {
        return tokens(format);
    }
    Ok(match (&head[..], ext.as_deref()) {
        (b"\x93NUMPY", _) => Dataset::from_npy(path, kind)?,
        ([b'P', b'K', 3, 4, ..], _) => Dataset::from_npz(path, kind)?,
        (h, _) if TokenFormat::is_llmc(h) => tokens(None)?,
        (_, Some("npy")) => Dataset::from_npy(path, kind)?,
        (_, Some("npz")) => Dataset::from_npz(path, kind)?,
        // safetensors: an 8-byte length, then its JSON header
        (h, Some("bin")) if h.get(8) != Some(&b'{') => tokens(None)?,
        _ => Dataset::from_safetensors(path, kind)?,
    })
}

/// Loads the dataset the flags name and checks it can feed one global step of `world` ranks;
/// with `--text`, also its validation rows (the held-out data of `--eval-every`).
pub fn load_data(args: &RunArgs, kind: &ModelKind, world: usize) -> Result<(Dataset, Option<Dataset>)> {
    let (data, text_val) = match (load_text(args, kind)?, &args.data.data, kind) {
        (Some(text), _, _) => (text.train, text.val),
        (None, Some(path), _) => (read_dataset(path, kind, args.token_format())?, None),
        (None, None, ModelKind::Mlp(c)) => (
            Dataset::teacher(8192, c.in_dim(), c.n_classes(), args.model.seed)?,
            None,
        ),
        (None, None, ModelKind::Gpt(c)) => (Dataset::builtin_text(c.context, args.model.seed)?, None),
    };
    let global = world.saturating_mul(args.rows_per_rank()); // bounded by RunArgs::validate
    if data.len() < global {
        return Err(Error::Usage(format!(
            "one step needs {global} rows (world size {world} x accum {} x batch size {}) but {} has {} rows",
            args.data.accum,
            args.data.batch_size,
            data.name(),
            data.len()
        )));
    }
    Ok((data, text_val))
}

/// The held-out data of `--eval-every` (`--val-fraction`'s rows, `--eval-data`'s, or
/// `--text`'s last tenth), set once the launch has loaded the data (under MPI,
/// in every process).
#[derive(Default)]
pub struct LateHeldOut(OnceLock<HeldOut>);

impl EvalSource for LateHeldOut {
    fn batches(&self, rank: usize, world_size: usize) -> brigade::Result<Vec<Batch>> {
        match self.0.get() {
            Some(h) => h.batches(rank, world_size),
            None => Err(brigade::Error::Config("the held-out data was not loaded".into())),
        }
    }
}

/// The training rows and the held-out rows the flags name: `--val-fraction` holds out the
/// data's last rows, `--eval-data` is a file of its own.
fn split_held_out(args: &RunArgs, kind: &ModelKind, data: Dataset) -> Result<(Dataset, Option<Dataset>)> {
    match (args.data.val_fraction, &args.data.eval_data) {
        (Some(f), _) => {
            let n = data.len();
            let held = ((n as f64 * f).ceil() as usize).min(n.saturating_sub(1));
            if held == 0 {
                return Err(Error::Usage(format!(
                    "--val-fraction {f} of {} ({n} rows) leaves no row to train on or none to hold out",
                    data.name()
                )));
            }
            // rows of token files are views of them; rows in memory copies
            Ok((data.rows(0..n - held)?, Some(data.rows(n - held..n)?)))
        }
        (None, Some(path)) => Ok((data, Some(read_dataset(path, kind, args.token_format())?))),
        (None, None) => Ok((data, None)),
    }
}

/// `--data 'shard-{rank}.safetensors'`: one file per rank, of any length (each process of an
/// MPI job loads every rank's: the ranks' lengths are checked before step 0).
fn load_rank_shards(args: &RunArgs, kind: &ModelKind, world: usize) -> Result<RankShards> {
    let shards = (0..world)
        .map(|r| {
            let path = args.rank_data_path(r).expect("--data names a file per rank");
            std::fs::metadata(&path).map_err(|e| Error::Io {
                path: format!("--data {} (rank {r}'s file)", path.display()),
                source: e,
            })?;
            read_dataset(&path, kind, args.token_format())
        })
        .collect::<Result<Vec<_>>>()?;
    // in order and without --join each file is read once: a run past its end would read every
    // rank's rows again from the first without a word (files of different lengths are the
    // library's refusal, naming the shortest and the longest)
    let rows: Vec<usize> = shards.iter().map(Dataset::len).collect();
    let per_step = args.rows_per_rank().max(1);
    if let (None, false, Some(&first)) = (args.data.join, args.data.shuffle, rows.first()) {
        let holds = first / per_step;
        if rows.iter().all(|&n| n == first) && args.recipe.steps > holds {
            return Err(Error::Usage(format!(
                "--data {}: every rank's file holds {first} rows, {holds} steps of {per_step} (--batch-size x --accum), and --steps {} would read them again from the first row: pass --join to end where the data does, --shuffle for epochs, or --steps {holds}",
                args.rank_data().unwrap_or_default(),
                args.recipe.steps
            )));
        }
    }
    Ok(RankShards::new(shards))
}

/// What every process needs before its ranks start: under MPI the world size comes from
/// `mpirun`, and every file the run reads must exist on every rank.
pub(crate) fn setup(
    args: &RunArgs,
    opts: &RunOptions,
    kind: &ModelKind,
    world: usize,
    late: &LateHeldOut,
) -> Result<Box<dyn DataSource>> {
    if args.distributed.backend == CommBackend::Mpi {
        if args.distributed.world_size != 1 && args.distributed.world_size != world {
            return Err(Error::Usage(format!(
                "--world-size {} but mpirun started {world} processes: drop --world-size (MPI's size is used) or pass -np {}",
                args.distributed.world_size, args.distributed.world_size
            )));
        }
        for (flag, path) in [
            ("--init", &args.model.init),
            ("--resume", &opts.resume),
            (
                "--data",
                // a glob's files are found when the data is read
                &args
                    .data
                    .data
                    .as_ref()
                    .filter(|p| args.rank_data().is_none() && !p.to_string_lossy().contains(['*', '?']))
                    .cloned(),
            ),
            ("--text", &args.data.text),
            ("--eval-data", &args.data.eval_data),
        ] {
            if let Some(path) = path {
                std::fs::metadata(path).map_err(|e| Error::Io {
                    path: format!("{flag} {}", path.display()),
                    source: e,
                })?;
            }
        }
    }
    if args.rank_data().is_some() {
        let shards = load_rank_shards(args, kind, world)?;
        if let Some(path) = &args.data.eval_data {
            let _ = late.0.set(HeldOut::new(
                read_dataset(path, kind, args.token_format())?,
                args.data.batch_size,
            ));
        }
        return Ok(Box::new(shards));
    }
    let (data, held) = match load_data(args, kind, world)? {
        (data, Some(text_val)) => (data, Some(text_val)),
        (data, None) => split_held_out(args, kind, data)?,
    };
    let global = world.saturating_mul(args.rows_per_rank());
    if data.len() < global {
        return Err(Error::Usage(format!(
            "one step needs {global} rows but {} keeps {} rows to train on after --val-fraction",
            data.name(),
            data.len()
        )));
    }
    if let Some(held) = held {
        let _ = late.0.set(HeldOut::new(held, args.data.batch_size));
    }
    Ok(Box::new(data))
}

/// How to start the ranks.
pub(crate) fn launch_config(args: &RunArgs, opts: &RunOptions) -> LaunchConfig {
    LaunchConfig {
        backend: args.distributed.backend,
        world_size: args.distributed.world_size,
        timeout: Duration::from_secs_f64(args.distributed.timeout_s),
        net: args
            .distributed
            .net_gbps
            .map(|g| net_model(g, args.distributed.net_latency_us)),
        recorder: opts.record.then(Recorder::new),
        // under MPI the job ends inside the launch: every process that reports says why
        on_fatal: Some(Arc::new(|e| eprintln!("error: {}", in_flag_terms(e)))),
    }
}

/// What every rank trains, as the flags say (a policy sweep changes the policy of it);
/// `late` receives the held-out rows of `--eval-every` once the launch has loaded the data.
pub fn train_config(args: &RunArgs, opts: &RunOptions, late: &Arc<LateHeldOut>) -> Result<TrainConfig> {
    let optimizer = match args.recipe.optimizer {
        OptimizerName::Sgd => OptimizerConfig::Sgd {
            lr: args.recipe.lr,
            momentum: args.momentum(),
            weight_decay: args.weight_decay(),
        },
        OptimizerName::Adamw => OptimizerConfig::adamw(args.recipe.lr, args.recipe.weight_decay),
    };
    let cap = args.bucket_cap()?;
    let ddp = DdpConfig {
        bucket_cap_mb: cap,
        first_bucket_cap_mb: args.first_bucket_cap(cap),
        find_unused_parameters: args.distributed.find_unused_parameters,
        ..DdpConfig::default()
    };
    Ok(TrainConfig {
        model: ModelConfig {
            name: args.model.kind().name().into(),
            config: Some(crate::commands::sample::model_config_json(
                &args.model.kind(),
                args.model.tokenizer,
            )),
            seed: args.model.seed,
            init: args.model.init.clone(),
            activation_checkpointing: args.model.activation_checkpointing.unwrap_or(0),
        },
        data: DataConfig {
            batch_size: args.data.batch_size,
            accum: args.data.accum,
            accum_into_shard: args.data.accum_into_shard,
            order: if args.data.shuffle {
                DataOrder::shuffle(args.model.seed, args.data.drop_last)
            } else {
                DataOrder::InOrder
            },
            join: args.data.join,
        },
        recipe: RecipeConfig {
            steps: args.recipe.steps,
            optimizer,
            schedule: args.schedule(),
            clip_grad_norm: args.recipe.clip_grad_norm,
            eval: args.recipe.eval_every.map(|every| EvalConfig {
                every,
                data: late.clone(),
            }),
            allow_nonfinite: args.recipe.allow_nonfinite,
            precision: args.recipe.mixed_precision(),
            loss_scale_growth_interval: brigade::autograd::scaler::GROWTH_INTERVAL,
        },
        distributed: (!opts.compute_only).then(|| DistributedConfig {
            ddp,
            policy: crate::policy::maker(args.hook_spec()),
            autotune: args.autotune_config(),
        }),
        runtime: RuntimeConfig {
            device: args.runtime.device,
            compute_threads: args.runtime.threads_per_rank,
            checkpoint: CheckpointConfig {
                resume: opts.resume.clone(),
                path: opts.checkpoint.clone(),
                every: opts.checkpoint_every,
                keep_last: opts.checkpoint_keep_last,
                metadata: opts.checkpoint_metadata.clone(),
            },
            instrument: Instrumentation {
                profile: opts.profile,
                profile_steps: opts.profile_steps.clone(),
                observer: opts.observer.clone(),
            },
        },
    })
}

/// Runs the training the flags describe: the model `--model` names, on the dataset the flags
/// name, through the library's [`fit()`]. Under MPI, ranks other than 0 exit here once training
/// succeeded (rank 0 alone reports and writes files).
pub fn run(args: &RunArgs, opts: &RunOptions) -> Result<RunReport> {
    args.validate()?;
    let late = Arc::new(LateHeldOut::default());
    run_config(args, opts, &train_config(args, opts, &late)?, &late)
}

/// Runs `train_cfg` (from [`train_config`], possibly changed: a policy sweep's row) on the
/// ranks, model and data `args` name; `args` were checked for `train_cfg`'s policy
/// ([`RunArgs::validate_for`]).
pub fn run_config(
    args: &RunArgs,
    opts: &RunOptions,
    train_cfg: &TrainConfig,
    late: &Arc<LateHeldOut>,
) -> Result<RunReport> {
    let launch_cfg = launch_config(args, opts);
    // Asking for a device this machine cannot serve is one error before any rank starts.
    args.runtime.device.for_rank(0)?;
    if args.distributed.backend == CommBackend::Nccl {
        brigade::launch::nccl::require(args.distributed.world_size)?;
    }
    let kind = args.model.kind();
    let report = fit(
        &launch_cfg,
        train_cfg,
        |world| setup(args, opts, &kind, world, late).map_err(into_library),
        |ctx| {
            // the process that writes the outputs holds them for the run's lifetime
            if let (0, Some(locks)) = (ctx.rank, &opts.locks) {
                locks.take().map_err(into_library)?;
            }
            Ok(kind.build(args.model.seed)?)
        },
    )?;
    if report.rank != 0 {
        std::process::exit(0);
    }
    Ok(report)
}

/// A setup error of this program's (worded for its user) as the library carries it: under MPI
/// every rank reports the first failing rank's message.
pub(crate) fn into_library(e: Error) -> brigade::Error {
    match e {
        Error::Run(e) => e,
        e => brigade::Error::Config(e.to_string()),
    }
}
