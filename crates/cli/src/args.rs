//! Flags shared by `brigade train` and `brigade sweep`: the model, the data, the
//! optimizer, the ranks.

use std::path::PathBuf;

use brigade_autograd::AdamW;
use brigade_models::{GptConfig, MlpConfig, ModelKind};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};

use crate::error::{CliError, Result};
pub use crate::launch::Backend;

/// Which model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModelName {
    /// The MLP classifier (reference widths 512,2048,2048,2048,10).
    Mlp,
    /// The byte-level GPT (reference d_model 256, 4 layers, 4 heads, context 128).
    Gpt,
}

/// Which optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerName {
    /// SGD with momentum (`--momentum`) and weight decay.
    Sgd,
    /// AdamW with PyTorch's defaults (betas, eps; decoupled weight decay).
    Adamw,
}

/// Parses `--backend` into the launcher's [`Backend`] (the one backend enum).
pub fn backend_parser() -> impl TypedValueParser<Value = Backend> {
    PossibleValuesParser::new(Backend::ALL.map(|(_, name, help)| PossibleValue::new(name).help(help)))
        .map(|s| s.parse::<Backend>().expect("one of the possible values"))
}

/// The model and its shape.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model to train.
    #[arg(long, value_enum, default_value_t = ModelName::Mlp)]
    pub model: ModelName,
    /// mlp: layer widths, input first, classes last.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,2048,2048,10")]
    pub widths: Vec<usize>,
    /// gpt: model width.
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    /// gpt: number of transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// gpt: attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// gpt: MLP hidden width.
    #[arg(long, default_value_t = 1024)]
    pub d_ff: usize,
    /// gpt: context length.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
}

impl ModelArgs {
    /// The model configuration these flags describe.
    pub fn kind(&self) -> ModelKind {
        match self.model {
            ModelName::Mlp => ModelKind::Mlp(MlpConfig::new(self.widths.clone())),
            ModelName::Gpt => ModelKind::Gpt(GptConfig {
                d_model: self.d_model,
                n_layers: self.layers,
                n_heads: self.heads,
                d_ff: self.d_ff,
                context: self.context,
                ..GptConfig::default()
            }),
        }
    }
}

/// Everything about one training run except what to do with its results.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Optimizer steps (a resumed run continues until this step).
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Rows per rank per microbatch.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerName::Adamw)]
    pub optimizer: OptimizerName,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay (AdamW: decoupled; SGD: L2 added to the gradient). Default: PyTorch's
    /// (AdamW 0.01, SGD 0).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Seed of the initial parameters and of the built-in data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Initial parameters (safetensors; PyTorch state-dict names).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Training data (safetensors): mlp `inputs` F32 [N,in] + `targets` I64 [N]; gpt
    /// `tokens` I64/U8 [N, context+1]. Default: built-in data.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Number of ranks (thread backend).
    #[arg(long, default_value_t = 1)]
    pub world_size: usize,
    /// Communication backend.
    #[arg(long, value_parser = backend_parser(), default_value_t = Backend::Thread)]
    pub backend: Backend,
    /// Compute threads per rank (default: the cores divided among the ranks).
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// DDP bucket cap in MiB (`brigade sweep` takes a comma-separated list).
    #[arg(long, value_delimiter = ',', default_value = "25")]
    pub bucket_mb: Vec<f64>,
    /// DDP first-bucket cap in MiB.
    #[arg(long, default_value_t = 1.0)]
    pub first_bucket_mb: f64,
    /// Microbatches per step: the first K-1 accumulate under no_sync, the K-th reduces.
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    /// Simulated network bandwidth in gigabits per second (e.g. 10 for 10GbE).
    #[arg(long)]
    pub net_gbps: Option<f64>,
    /// Simulated network latency per message in microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub net_latency_us: f64,
    /// Mark parameters that get no gradient as ready instead of failing.
    #[arg(long)]
    pub find_unused_parameters: bool,
    /// Steps excluded from the timing summary.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Seconds any rank waits for the others before failing.
    #[arg(long, default_value_t = 120.0)]
    pub timeout_s: f64,
    /// Train on through non-finite losses and parameters (default: stop with an error naming
    /// the step, keeping the last good checkpoint).
    #[arg(long)]
    pub allow_nonfinite: bool,
}

impl RunArgs {
    /// Checks values that clap cannot.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(CliError::Usage(m));
        if self.world_size == 0 {
            return bad("--world-size must be at least 1".into());
        }
        if self.batch_size == 0 || self.accum == 0 {
            return bad("--batch-size and --accum must be at least 1".into());
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("--lr must be a positive number, got {}", self.lr));
        }
        if self.bucket_mb.is_empty() || !(self.bucket_mb.iter().all(|&b| b > 0.0) && self.first_bucket_mb > 0.0) {
            return bad("--bucket-mb and --first-bucket-mb must be positive".into());
        }
        if let Some(g) = self.net_gbps {
            if !(g > 0.0 && g.is_finite()) {
                return bad(format!("--net-gbps must be positive, got {g}"));
            }
        }
        if self.net_latency_us < 0.0 || !self.net_latency_us.is_finite() {
            return bad("--net-latency-us must be >= 0".into());
        }
        if self.threads_per_rank == Some(0) {
            return bad("--threads-per-rank must be at least 1".into());
        }
        if !(self.timeout_s > 0.0) {
            return bad("--timeout-s must be positive".into());
        }
        if self.warmup >= self.steps && self.steps > 0 {
            return bad(format!(
                "--warmup {} leaves no step of --steps {} to time",
                self.warmup, self.steps
            ));
        }
        Ok(())
    }

    /// The single bucket cap of a training run.
    pub fn bucket_cap(&self) -> Result<f64> {
        match self.bucket_mb.as_slice() {
            [b] => Ok(*b),
            _ => Err(CliError::Usage(format!(
                "--bucket-mb takes one value for a training run, got {:?} (a list is for `brigade sweep`)",
                self.bucket_mb
            ))),
        }
    }

    /// Rows per rank per step.
    pub fn rows_per_rank(&self) -> usize {
        self.batch_size * self.accum
    }

    /// The weight decay in effect.
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay.unwrap_or(match self.optimizer {
            OptimizerName::Adamw => AdamW::DEFAULT_WEIGHT_DECAY,
            OptimizerName::Sgd => 0.0,
        })
    }
}
