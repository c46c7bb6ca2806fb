//! What a run is asked to do, as plain data, the same on every rank: [`TrainConfig`], in five
//! parts: [`ModelConfig`] (what is trained), [`DataConfig`] (on what data), [`RecipeConfig`]
//! (steps, optimizer, schedule, clipping, evaluation), an optional [`DistributedConfig`] (DDP,
//! its reducer policy, the bucket-cap autotuner) and [`RuntimeConfig`] (device, threads, a
//! [`CheckpointConfig`], an [`Instrumentation`]). Nothing here knows the command line.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use brigade_autograd::{AdamW, MixedPrecision, Optimizer, Sgd, Var};
use brigade_ddp::overlap::AutotuneConfig;
use brigade_ddp::DdpConfig;
use brigade_models::{GptConfig, MlpConfig, ModelKind};

use crate::error::{Error, Result};
use crate::join::JoinMode;
use crate::observe::TrainObserver;
use crate::placement::DevicePlacement;
use crate::policy::MakePolicy;
use crate::recipe::{EvalConfig, ScheduleConfig};
use crate::source::DataOrder;
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

    /// Optimizer values kept per parameter: AdamW 2 (its moments), SGD with momentum 1, plain
    /// SGD 0.
    pub fn state_per_param(&self) -> u64 {
        match *self {
            OptimizerConfig::Sgd { momentum, .. } => u64::from(momentum != 0.0),
            OptimizerConfig::AdamW { .. } => 2,
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

/// Everything one training run needs, the same on every rank, in five parts: what is trained
/// ([`ModelConfig`]), on what data ([`DataConfig`]), the recipe ([`RecipeConfig`]: steps,
/// optimizer, schedule, clipping, evaluation), the distributed part ([`DistributedConfig`]: DDP
/// and its reducer policy; `None`: the ranks train apart) and how it runs ([`RuntimeConfig`]:
/// the device, threads, checkpoints, instrumentation).
#[derive(Clone)]
pub struct TrainConfig {
    /// What is trained.
    pub model: ModelConfig,
    /// On what data, in which batches.
    pub data: DataConfig,
    /// How long and how it is trained.
    pub recipe: RecipeConfig,
    /// DDP, its reducer policy and the bucket-cap autotuner; `None`: the ranks train
    /// independently, reducing no gradient (a compute-only baseline).
    pub distributed: Option<DistributedConfig>,
    /// Where and how the run executes, what it writes and who watches.
    pub runtime: RuntimeConfig,
}

impl TrainConfig {
    /// `steps` steps of `batch_size` rows per rank with `optimizer`, and the defaults for the
    /// rest: one microbatch a step, rows in order, DDP with PyTorch's bucket caps and all-reduce, the CPU, no
    /// checkpoint, no resume, no profile, no observer.
    pub fn new(steps: usize, batch_size: usize, optimizer: OptimizerConfig) -> Self {
        TrainConfig {
            model: ModelConfig::default(),
            data: DataConfig::new(batch_size),
            recipe: RecipeConfig::new(steps, optimizer),
            distributed: Some(DistributedConfig::default()),
            runtime: RuntimeConfig::default(),
        }
    }

    /// The distributed part's DDP configuration (`None` when the ranks train apart).
    pub fn ddp(&self) -> Option<&DdpConfig> {
        self.distributed.as_ref().map(|d| &d.ddp)
    }

    /// Whether the bucket-cap autotuner runs ([`DistributedConfig::autotune`]).
    pub fn autotunes(&self) -> bool {
        self.distributed.as_ref().is_some_and(|d| d.autotune.is_some())
    }

    /// Rows per rank per step: `batch_size` rows in each of `accum` microbatches.
    pub fn rows_per_step(&self) -> usize {
        self.data.batch_size * self.data.accum
    }

    /// Whether the run starts sharded: its policy shards the parameters (ZeRO-3) over f32
    /// parameters on the CPU, so each rank's model is built inside
    /// [`brigade_autograd::defer_param_init`] and every rank draws only its shard of each unit
    /// (a model too large for one rank starts); initialised from a file (`model.init`) or
    /// resumed from a checkpoint, every rank reads only its shard's bytes of each parameter
    /// there (and of the optimizer state).
    pub fn starts_sharded(&self) -> bool {
        self.ddp().is_some()
            && self.distributed.as_ref().is_some_and(|d| d.policy.shards_params())
            && !self.recipe.precision.is_mixed()
            && self.runtime.device == crate::placement::DevicePlacement::Cpu
    }
}

/// What is trained: the model's identity, as checkpoints record it, and where its parameters
/// start.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// The model's name, recorded in checkpoints (resuming another model is an error).
    pub name: String,
    /// The model's shape as text (the CLI writes a JSON object), recorded in checkpoints as
    /// `model_config` so that a checkpoint can be loaded without the flags that trained it
    /// ([`crate::checkpoint::load_model_tensors`]); `None`: not recorded.
    pub config: Option<String>,
    /// Seed of the initial parameters, recorded in checkpoints (resuming with another is an error).
    pub seed: u64,
    /// Initial parameters (safetensors, PyTorch state-dict names).
    pub init: Option<PathBuf>,
    /// Activation checkpointing of every N-th block (1: every block; 0: none, the default):
    /// [`brigade_models::Model::set_activation_checkpointing`]. It changes the memory a step
    /// holds, not its results; a checkpoint records it, and a resume may change it (the change
    /// is reported).
    pub activation_checkpointing: usize,
}

impl Default for ModelConfig {
    /// A model named `model`, seed 0, its parameters as the model initialises them, no
    /// activation checkpointing.
    fn default() -> Self {
        ModelConfig {
            name: "model".into(),
            config: None,
            seed: 0,
            init: None,
            activation_checkpointing: 0,
        }
    }
}

/// The model `name` (`mlp` or `gpt`) of the shape `config` describes, in the text
/// [`ModelConfig::config`] holds as the `brigade` binary writes it (a checkpoint's
/// `model_config`, a step profile's): a JSON object of the GPT's `vocab`, `d_model`,
/// `n_layers`, `n_heads`, `d_ff`, `context` and `dropout`, or of the MLP's `widths` and
/// `dropout`. One line naming what is missing otherwise.
pub fn model_kind(name: &str, config: &str) -> Result<ModelKind> {
    let bad = |why: String| Error::Config(format!("the recorded model configuration {why}"));
    let v: serde_json::Value = serde_json::from_str(config).map_err(|e| bad(format!("is not JSON ({e})")))?;
    let size = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| bad(format!("has no size `{k}`: {config}")))
    };
    let dropout = v.get("dropout").and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    match name {
        "gpt" => Ok(ModelKind::Gpt(GptConfig {
            vocab: size("vocab")?,
            d_model: size("d_model")?,
            n_layers: size("n_layers")?,
            n_heads: size("n_heads")?,
            d_ff: size("d_ff")?,
            context: size("context")?,
            dropout,
            ..GptConfig::default()
        })),
        "mlp" => {
            let widths: Vec<usize> = v
                .get("widths")
                .and_then(serde_json::Value::as_array)
                .and_then(|w| w.iter().map(|x| x.as_u64().map(|n| n as usize)).collect())
                .filter(|w: &Vec<usize>| w.len() >= 2)
                .ok_or_else(|| bad(format!("has no `widths` (at least two): {config}")))?;
            Ok(ModelKind::Mlp(MlpConfig {
                dropout,
                ..MlpConfig::new(widths)
            }))
        }
        _ => Err(bad(format!(
            "is of model '{name}': a recorded shape is read for the mlp and the gpt"
        ))),
    }
}

/// On what data: the batches each rank reads, in which order, and what happens when the
/// ranks' data ends at different steps.
#[derive(Clone, Debug)]
pub struct DataConfig {
    /// Rows per rank per microbatch.
    pub batch_size: usize,
    /// Microbatches per step: the first `accum - 1` accumulate under `no_sync`.
    pub accum: usize,
    /// Under a policy that shards the gradients (ZeRO-2, ZeRO-3) and `accum` of 2 or more:
    /// every microbatch's backward reduce-scatters its buckets as they fill and adds them into
    /// the rank's gradient shard ([`brigade_ddp::DistributedDataParallel::accumulate_into_shard`]), so a bucket's
    /// full gradients live only while it is reduced, as in a step of one microbatch, instead
    /// of the whole model's across the microbatches. The shards sum the microbatches in
    /// another order than the full buffers do (within rounding, not bit for bit), and each
    /// microbatch's gradients cross the wire. `false` (the default): `no_sync` accumulation.
    pub accum_into_shard: bool,
    /// In which order the ranks read the data: in order (the default) or through a
    /// distributed sampler (`DataOrder::shuffle` for `--shuffle`).
    pub order: DataOrder,
    /// Ranks whose data ends at different steps (uneven inputs, PyTorch's `Join`): how the
    /// ranks whose data ended take part ([`crate::join`]). `None`: every rank must read as
    /// many rows, and uneven data is refused before step 0 naming the shortest and longest
    /// rank. Under a mode each rank's data is one pass over its rows. Without DDP (ranks
    /// training apart) a rank without data only takes part in the ranks' agreements.
    pub join: Option<JoinMode>,
}

impl DataConfig {
    /// Microbatches of `batch_size` rows, one a step, in order, even data.
    pub fn new(batch_size: usize) -> Self {
        DataConfig {
            batch_size,
            accum: 1,
            accum_into_shard: false,
            order: DataOrder::InOrder,
            join: None,
        }
    }
}

/// The recipe: how long, with which optimizer and learning rates, clipped and evaluated how.
#[derive(Clone)]
pub struct RecipeConfig {
    /// Train until this step (a resumed run continues until it).
    pub steps: usize,
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
    /// Train on through non-finite losses and parameters instead of stopping.
    pub allow_nonfinite: bool,
    /// The run's precision (default f32 throughout). With 16-bit parameters the model computes
    /// in them, the optimizer steps f32 master weights ([`brigade_autograd::MasterWeights`];
    /// under ZeRO-1/2 each rank's shard of them), the gradient buckets hold `reduce_dtype` (by
    /// default the parameters' dtype; f32 keeps the sum exact), and checkpoints save the whole
    /// f32 masters. Every rank's masters are rank 0's (broadcast before they are made).
    pub precision: MixedPrecision,
    /// fp16's dynamic loss scaling: clean steps in a row after which the scale doubles
    /// (PyTorch's `growth_interval`, default 2000).
    pub loss_scale_growth_interval: u64,
}

impl RecipeConfig {
    /// `steps` steps of `optimizer` at a constant learning rate, unclipped, never evaluated.
    pub fn new(steps: usize, optimizer: OptimizerConfig) -> Self {
        RecipeConfig {
            steps,
            optimizer,
            schedule: ScheduleConfig::default(),
            clip_grad_norm: None,
            eval: None,
            allow_nonfinite: false,
            precision: MixedPrecision::default(),
            loss_scale_growth_interval: brigade_autograd::scaler::GROWTH_INTERVAL,
        }
    }
}

/// The distributed part: DDP, how it reduces each bucket, and the tuning of its bucket cap.
#[derive(Clone)]
pub struct DistributedConfig {
    /// DDP's configuration. Its recorder is the rank's.
    pub ddp: DdpConfig,
    /// How DDP reduces each bucket and what its optimizer steps: a
    /// [`brigade_policies::PolicySpec`], or a closure `Fn(rank) -> P` making a user's own
    /// [`brigade_ddp::ReducerPolicy`] `P`; every rank makes its own ([`crate::policy`]).
    pub policy: Arc<dyn MakePolicy>,
    /// Tune DDP's bucket cap as the run goes, from the recorded steps.
    pub autotune: Option<AutotuneConfig>,
}

impl DistributedConfig {
    /// DDP with PyTorch's bucket caps under `policy`, not autotuned.
    pub fn with_policy(policy: impl MakePolicy + 'static) -> Self {
        DistributedConfig {
            policy: Arc::new(policy),
            ..DistributedConfig::default()
        }
    }
}

impl Default for DistributedConfig {
    /// DDP with PyTorch's bucket caps and all-reduce, not autotuned.
    fn default() -> Self {
        DistributedConfig {
            ddp: DdpConfig::default(),
            policy: Arc::new(PolicySpec::AllReduce),
            autotune: None,
        }
    }
}

/// How the run executes: where the tensors live, the threads it computes with, its
/// checkpoints and what it records.
#[derive(Clone, Default)]
pub struct RuntimeConfig {
    /// Where the model, batches, gradients and optimizer state live (rank r's GPU, see
    /// [`DevicePlacement::for_rank`]).
    pub device: DevicePlacement,
    /// Compute threads of each rank (default: the cores shared among the local ranks).
    pub compute_threads: Option<usize>,
    /// Checkpoints: where to write them, how often, what to resume from.
    pub checkpoint: CheckpointConfig,
    /// What to record beside training, and who watches the run.
    pub instrument: Instrumentation,
}

/// Where a run writes its checkpoints and what it resumes from (rank 0 writes; every rank reads).
#[derive(Clone, Debug, Default)]
pub struct CheckpointConfig {
    /// Continue from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Write a checkpoint here at the end, and every `every` steps. `{step}` in the file name
    /// is replaced by the step the checkpoint resumes at (`run-{step}.ckpt` gives
    /// `run-25.ckpt` for the state after 25 steps), so that a run keeps each one; without it
    /// each checkpoint replaces the last. `{step}` is the one placeholder: another `{...}`
    /// (`{STEP}`, `{rank}`) is refused ([`Error::NotAPlaceholder`]).
    /// Every write is atomic (a temporary file renamed).
    /// [`CheckpointConfig::check_files`] refuses a path that may land on another file of the
    /// run, before step 0.
    pub path: Option<PathBuf>,
    /// Checkpoint period in steps (a periodic checkpoint is written during the step it
    /// resumes, once that step's loss is known to be finite).
    pub every: Option<usize>,
    /// Keep only the newest this many checkpoints of this run's lineage under a `{step}`
    /// path: after each write, the checkpoints of the lineage among the files of its directory
    /// that the path names (digits in place of `{step}`) are removed, oldest first (by
    /// generation, then step: the order they were written in), until this many remain. A file
    /// that is not a checkpoint of the lineage is never removed ([`crate::checkpoint_files`]).
    /// Needs `{step}` in `path`.
    pub keep_last: Option<usize>,
    /// The caller's own entries, written into every checkpoint's metadata beside Brigade's,
    /// each key under [`crate::checkpoint::USER_PREFIX`] (`plan` is written `user.plan`, so
    /// that no entry can replace one of Brigade's); read back with
    /// [`crate::checkpoint::load_model_tensors`]. The CLI records its plan here.
    pub metadata: Vec<(String, String)>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_model_configuration_reads_back_or_names_what_is_missing() {
        let gpt = r#"{"vocab":256,"d_model":32,"n_layers":2,"n_heads":2,"d_ff":64,"context":16,"dropout":0.0,"tokenizer":"bytes"}"#;
        let ModelKind::Gpt(c) = model_kind("gpt", gpt).unwrap() else {
            panic!("a gpt")
        };
        assert_eq!((c.vocab, c.d_model, c.n_layers, c.context), (256, 32, 2, 16));
        let ModelKind::Mlp(c) = model_kind("mlp", r#"{"widths":[8,16,4],"dropout":0.1}"#).unwrap() else {
            panic!("an mlp")
        };
        assert_eq!((c.widths, c.dropout), (vec![8, 16, 4], 0.1));
        let e = model_kind("gpt", r#"{"vocab":256}"#).unwrap_err().to_string();
        assert!(e.contains("d_model"), "{e}");
        let e = model_kind("resnet", "{}").unwrap_err().to_string();
        assert!(e.contains("resnet"), "{e}");
    }
}
