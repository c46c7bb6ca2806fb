//! What a run is asked to do, as plain data, the same on every rank: [`TrainConfig`] (what to
//! train and how) holds a [`CheckpointConfig`] (where to write and resume from) and an
//! [`Instrumentation`] (what to record and who watches). Nothing here knows the command line.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use brigade_autograd::{AdamW, Optimizer, Sgd, Var};
use brigade_ddp::overlap::AutotuneConfig;
use brigade_ddp::DdpConfig;

use crate::comm_hook::MakeCommHook;
use crate::data::DataOrder;
use crate::join::JoinMode;
use crate::observe::TrainObserver;
use crate::placement::DevicePlacement;
use crate::recipe::{EvalConfig, ScheduleConfig};
use brigade_policies::PolicySpec;

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

    /// The (peak) learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::AdamW { lr, .. } => lr,
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

/// Everything one training run needs, the same on every rank: the model's identity, the
/// steps, batches and optimizer, DDP and its reducer policy, where the tensors live; then
/// checkpoints and instrumentation, each in its own part.
#[derive(Clone)]
pub struct TrainConfig {
    /// The model's name, recorded in checkpoints (resuming another model is an error).
    pub model_name: String,
    /// The model's shape as text (the CLI writes a JSON object), recorded in checkpoints as
    /// `model_config` so that a checkpoint can be loaded without the flags that trained it
    /// ([`crate::checkpoint::load_model_tensors`]); `None`: not recorded.
    pub model_config: Option<String>,
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
    /// In which order the ranks read the data: in order (the default) or through a
    /// distributed sampler (`DataOrder::shuffle` for `--shuffle`).
    pub data_order: DataOrder,
    /// Ranks whose data ends at different steps (uneven inputs, PyTorch's `Join`): how the
    /// ranks whose data ended take part ([`crate::join`]). `None`: every rank must read as
    /// many rows, and uneven data is refused before step 0 naming the shortest and longest
    /// rank. Under a mode each rank's data is one pass over its rows. Without DDP (ranks
    /// training apart) a rank without data only takes part in the ranks' agreements.
    pub join: Option<JoinMode>,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// The learning-rate schedule, peaking at the optimizer's learning rate (default:
    /// constant); the trainer sets the learning rate of every step from it.
    pub schedule: ScheduleConfig,
    /// Global-norm gradient clipping (`torch.nn.utils.clip_grad_norm_`): after the gradients
    /// are averaged (and accumulated), their total 2-norm over every parameter (over every
    /// rank's shard under ZeRO) is scaled down to at most this. `None`: no clipping.
    pub clip_grad_norm: Option<f64>,
    /// Evaluate on held-out data every so many steps (`None`: never).
    pub eval: Option<EvalConfig>,
    /// DDP's configuration; `None`: the ranks train independently, reducing no gradient (a
    /// compute-only baseline). Its recorder is the rank's.
    pub ddp: Option<DdpConfig>,
    /// How DDP reduces each bucket and what its optimizer steps: a
    /// [`brigade_policies::PolicySpec`], or a closure making a user's own
    /// [`brigade_ddp::ReducerPolicy`]; every rank makes its own.
    pub comm_hook: Arc<dyn MakeCommHook>,
    /// Tune DDP's bucket cap as the run goes, from the recorded steps; needs `ddp`.
    pub autotune: Option<AutotuneConfig>,
    /// Train on through non-finite losses and parameters instead of stopping.
    pub allow_nonfinite: bool,
    /// Compute threads of each rank (default: the cores shared among the local ranks).
    pub compute_threads: Option<usize>,
    /// Where the model, batches, gradients and optimizer state live (rank r's GPU, see
    /// [`DevicePlacement::for_rank`]).
    pub device: DevicePlacement,
    /// Checkpoints: where to write them, how often, what to resume from.
    pub checkpoint: CheckpointConfig,
    /// What to record beside training, and who watches the run.
    pub instrument: Instrumentation,
}

impl TrainConfig {
    /// `steps` steps of `batch_size` rows per rank with `optimizer`, and the defaults for the
    /// rest: one microbatch a step, rows in order, DDP with PyTorch's bucket caps and all-reduce, the CPU, no
    /// checkpoint, no resume, no profile, no observer.
    pub fn new(steps: usize, batch_size: usize, optimizer: OptimizerConfig) -> Self {
        TrainConfig {
            model_name: "model".into(),
            model_config: None,
            seed: 0,
            init: None,
            steps,
            batch_size,
            accum: 1,
            data_order: DataOrder::InOrder,
            join: None,
            optimizer,
            schedule: ScheduleConfig::default(),
            clip_grad_norm: None,
            eval: None,
            ddp: Some(DdpConfig::default()),
            comm_hook: Arc::new(PolicySpec::AllReduce),
            autotune: None,
            allow_nonfinite: false,
            compute_threads: None,
            device: DevicePlacement::Cpu,
            checkpoint: CheckpointConfig::default(),
            instrument: Instrumentation::default(),
        }
    }
}

/// Where a run writes its checkpoints and what it resumes from (rank 0 writes; every rank reads).
#[derive(Clone, Debug, Default)]
pub struct CheckpointConfig {
    /// Continue from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Write a checkpoint here at the end, and every `every` steps. `{step}` in the file name
    /// is replaced by the step the checkpoint resumes at (`run-{step}.ckpt` gives
    /// `run-25.ckpt` for the state after 25 steps), so that a run keeps each one; without it
    /// each checkpoint replaces the last. Every write is atomic (a temporary file renamed).
    pub path: Option<PathBuf>,
    /// Checkpoint period in steps (a periodic checkpoint is written during the step it
    /// resumes, once that step's loss is known to be finite).
    pub every: Option<usize>,
    /// Keep only the newest this many checkpoints of a `{step}` path: after each write, the
    /// files of its directory that the path names with other steps (digits in place of
    /// `{step}`), oldest first, are removed until this many remain. Needs `{step}` in `path`.
    pub keep_last: Option<usize>,
}

/// What a run records beside training, and who watches it.
#[derive(Clone, Default)]
pub struct Instrumentation {
    /// Record a step profile of each synchronized step (the last one is kept).
    pub profile: bool,
    /// Keep the profile of every step in this range, not only the last.
    pub profile_steps: Option<Range<usize>>,
    /// Told when the run starts, after each step and when it ends (on rank 0), and asked once
    /// a step whether to stop (on every rank); see [`TrainObserver`].
    pub observer: Option<Arc<dyn TrainObserver>>,
}
