//! Flags shared by `brigade train` and `brigade sweep`: the model, the data, the
//! optimizer, the ranks.

use std::path::PathBuf;

use brigade_autograd::AdamW;
use brigade_models::{GptConfig, MlpConfig, ModelKind, TokenFormat, Tokenizer};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};

use brigade::join::JoinMode;
use brigade::launch::{net_model, CommBackend};
use brigade::placement::DevicePlacement;
use brigade::policies::{PolicySpec, ZeroStage};

use brigade_ddp::overlap::LinkCost;

pub use crate::bucket_cap::{parse_bucket_cap, AutotuneArgs, BucketCap};
use crate::error::{Error, Result};

mod validate;

/// `values` as the command line lists them: `16,32,4`.
pub fn join<T: std::fmt::Display>(values: &[T]) -> String {
    values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",")
}

/// What `--data` holds in place of the rank to name a file per rank.
pub const RANK_PLACEHOLDER: &str = "{rank}";

/// Parses `--join`.
fn parse_join(s: &str) -> std::result::Result<JoinMode, String> {
    s.parse()
}

/// The name a value enum has on the command line (`mlp`, `adamw`, `thread`), for summaries
/// and metadata.
pub fn flag_name(v: &impl ValueEnum) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// A number as a person writes it: `0.001`, `3.5`, `1e30`, `1e-7` (Rust's `{}` spells
/// `1e30` with thirty zeros).
pub fn compact(x: f64) -> String {
    let a = x.abs();
    if a != 0.0 && a.is_finite() && !(1e-4..1e6).contains(&a) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// Largest `--timeout-s`: far beyond any wait worth having, far below what `Duration`
/// and `Instant` hold.
pub const MAX_TIMEOUT_S: f64 = 1e6;
/// Range of `--net-gbps`: 1 Mb/s to 1 Pb/s keeps every simulated transfer time a
/// representable duration.
pub const NET_GBPS: (f64, f64) = (1e-3, 1e6);
/// Largest `--net-latency-us` (10 s per message).
pub const MAX_LATENCY_US: f64 = 1e7;
/// Largest `--bucket-mb` / `--first-bucket-mb` (1 TiB).
pub const MAX_BUCKET_MB: f64 = 1024.0 * 1024.0;
/// Smallest `--bucket-mb` / `--first-bucket-mb`: one byte.
pub const MIN_BUCKET_MB: f64 = 1.0 / (1024.0 * 1024.0);

/// Most ranks started as threads of one process (more run under `mpirun`).
pub const MAX_THREAD_RANKS: usize = 1024;

/// Most compute threads per rank (`--threads-per-rank`, and `bench`'s `--threads`): 256, or the
/// machine's cores when it has more.
pub fn max_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).max(256)
}

/// Checks a number of compute threads given by `flag`: at least 1, at most [`max_threads`].
pub fn check_threads(flag: &str, threads: usize) -> Result<()> {
    let max = max_threads();
    if !(1..=max).contains(&threads) {
        return Err(Error::Usage(format!(
            "{flag} must be between 1 and {max} (compute threads; this machine has {} cores), got {threads}",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        )));
    }
    Ok(())
}

/// Whether `mb` is a bucket cap Brigade takes: one byte to [`MAX_BUCKET_MB`] (NaN is not).
pub fn cap_in_range(mb: f64) -> bool {
    (MIN_BUCKET_MB..=MAX_BUCKET_MB).contains(&mb)
}

/// The first value `caps` lists a second time, if any (each cap is one row of a table).
pub fn listed_twice(caps: &[f64]) -> Option<f64> {
    caps.iter()
        .enumerate()
        .find(|(i, c)| caps[..*i].contains(c))
        .map(|(_, c)| *c)
}

/// Refuses a list flag that gives one entry twice, naming both places and `why` not.
pub fn listed_once<T: PartialEq + std::fmt::Display>(flag: &str, values: &[T], why: &str) -> Result<()> {
    match brigade::study::repeated(values) {
        Some((first, again)) => Err(Error::Usage(format!(
            "{flag} lists {} twice (entries {first} and {again}): {why}",
            values[again - 1]
        ))),
        None => Ok(()),
    }
}

/// Checks `--net-gbps` and `--net-latency-us` (shared by `train`, `sweep` and `predict`).
pub fn check_link(gbps: Option<f64>, latency_us: f64) -> Result<()> {
    check_link_of(("--net-gbps", gbps), ("--net-latency-us", latency_us))
}

/// Checks a link's bandwidth and latency, each given by the flag it is paired with (a study's
/// `--predict-gbps` and `--predict-latency-us`, the run's `--net-gbps` and `--net-latency-us`).
pub fn check_link_of((gbps_flag, gbps): (&str, Option<f64>), (latency_flag, latency_us): (&str, f64)) -> Result<()> {
    if let Some(g) = gbps {
        if !(NET_GBPS.0..=NET_GBPS.1).contains(&g) {
            return Err(Error::Usage(format!(
                "{gbps_flag} must be between {} and {} (so that simulated transfer times stay representable), got {}",
                compact(NET_GBPS.0),
                compact(NET_GBPS.1),
                compact(g)
            )));
        }
    }
    if !(0.0..=MAX_LATENCY_US).contains(&latency_us) {
        return Err(Error::Usage(format!(
            "{latency_flag} must be between 0 and {}, got {}",
            compact(MAX_LATENCY_US),
            compact(latency_us)
        )));
    }
    Ok(())
}

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
    /// SGD with optional momentum (`--momentum`, default 0 as in `torch.optim.SGD`) and weight decay.
    Sgd,
    /// AdamW with PyTorch's defaults (betas, eps; decoupled weight decay).
    Adamw,
}

/// What each `--backend` is, for `--help`.
fn backend_help(b: CommBackend) -> &'static str {
    match b {
        CommBackend::Thread => "Ranks as threads of this process (--world-size N)",
        CommBackend::Mpi => "One rank per process under mpirun (build with --features mpi)",
        CommBackend::Nccl => {
            "NCCL on GPUs (--device cuda): rank threads (--world-size N), or under mpirun one rank per process"
        }
    }
}

/// Parses `--tokenizer` (`bytes` or `gpt2`), listing both in `--help`.
pub fn tokenizer_parser() -> impl TypedValueParser<Value = Tokenizer> {
    PossibleValuesParser::new(Tokenizer::ALL.map(|t| {
        PossibleValue::new(t.name()).help(match t {
            Tokenizer::Bytes => "One token per UTF-8 byte (vocabulary 256)",
            Tokenizer::Gpt2 => "GPT-2's byte-pair encoding, tiktoken's r50k_base (vocabulary 50257)",
        })
    }))
    .map(|s| s.parse::<Tokenizer>().expect("one of the possible values"))
}

/// `--data-format`: how a token file lays out its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DataFormatFlag {
    /// llm.c's shard: a 256 x int32 header (magic 20240520, version 1, token count), uint16 tokens.
    Llmc,
    /// nanoGPT's train.bin / val.bin: raw uint16 tokens, no header.
    Nanogpt,
}

impl DataFormatFlag {
    /// The library's format.
    pub fn format(self) -> TokenFormat {
        match self {
            DataFormatFlag::Llmc => TokenFormat::Llmc,
            DataFormatFlag::Nanogpt => TokenFormat::NanoGpt,
        }
    }
}

/// Parses `--backend` into the library's [`CommBackend`] (the one backend enum).
pub fn backend_parser() -> impl TypedValueParser<Value = CommBackend> {
    PossibleValuesParser::new(CommBackend::ALL.map(|b| PossibleValue::new(b.name()).help(backend_help(b))))
        .map(|s| s.parse::<CommBackend>().expect("one of the possible values"))
}

/// Parses `--device`: `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> std::result::Result<DevicePlacement, String> {
    match s {
        "cpu" => Ok(DevicePlacement::Cpu),
        "cuda" => Ok(DevicePlacement::Cuda(None)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(|n| DevicePlacement::Cuda(Some(n)))
            .ok_or_else(|| format!("expected cpu, cuda or cuda:N (N a GPU ordinal), got '{s}'")),
    }
}

/// `--activation-checkpointing N`: a positive count of blocks.
fn parse_every(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "expected a positive number of blocks (1 = every block, N = every N-th), got '{s}'"
        )),
    }
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
    /// gpt: how --text becomes tokens, and what --data's token ids are; the GPT's vocabulary
    /// follows it (256 or 50257) and its checkpoint records it, for `brigade sample`.
    #[arg(long, value_parser = tokenizer_parser(), default_value_t = Tokenizer::Bytes)]
    pub tokenizer: Tokenizer,
    /// Dropout probability in [0, 1) (torch.nn.Dropout), in training mode only: mlp after each
    /// hidden activation, gpt after the embeddings and on each block's two residual branches.
    /// Each rank's mask generator is part of a checkpoint, so a continued run draws the masks
    /// an uninterrupted one would. 0 (the default) is bit for bit the run without dropout.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub dropout: f64,
    /// gpt: activation checkpointing (torch.utils.checkpoint): a checkpointed block keeps only
    /// its input through forward and recomputes its forward inside backward, the same gradients
    /// for less memory. The bare flag checkpoints every block, N every N-th (blocks 0, N, 2N,
    /// ..); off by default. Not --checkpoint FILE, which saves the run.
    #[arg(long, num_args = 0..=1, default_missing_value = "1", value_name = "N", value_parser = parse_every)]
    pub activation_checkpointing: Option<usize>,
    /// Seed of the initial parameters and of the built-in data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Initial parameters (safetensors; PyTorch state-dict names).
    #[arg(long)]
    pub init: Option<PathBuf>,
}

impl ModelArgs {
    /// Checks the shape flags of the chosen model, naming the flag at fault.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        if self.activation_checkpointing.is_some() && self.model != ModelName::Gpt {
            return bad("--activation-checkpointing checkpoints transformer blocks: it needs --model gpt".to_string());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!(
                "--dropout must be a probability in [0, 1) (1 would drop every activation), got {}",
                compact(self.dropout)
            ));
        }
        match self.model {
            ModelName::Mlp => {
                if self.widths.len() < 2 {
                    return bad(format!(
                        "--widths needs at least 2 widths (input and classes), got {:?}",
                        self.widths
                    ));
                }
                if let Some(i) = self.widths.iter().position(|&w| w == 0) {
                    return bad(format!(
                        "--widths: every width must be at least 1, width {i} is 0 in {:?}",
                        self.widths
                    ));
                }
                if *self.widths.last().expect("2 or more") < 2 {
                    return bad(format!(
                        "--widths: the last width is the number of classes and must be at least 2, got {:?}",
                        self.widths
                    ));
                }
            }
            ModelName::Gpt => {
                for (flag, v) in [
                    ("--d-model", self.d_model),
                    ("--layers", self.layers),
                    ("--heads", self.heads),
                    ("--d-ff", self.d_ff),
                ] {
                    if v == 0 {
                        return bad(format!("{flag} must be at least 1"));
                    }
                }
                if self.context == 0 {
                    return bad("--context must be at least 1 (tokens the model reads per row)".into());
                }
                if !self.d_model.is_multiple_of(self.heads) {
                    return bad(format!(
                        "--heads {} must divide --d-model {} (each head gets d_model / heads dimensions)",
                        self.heads, self.d_model
                    ));
                }
            }
        }
        Ok(())
    }

    /// The model configuration these flags describe.
    pub fn kind(&self) -> ModelKind {
        match self.model {
            ModelName::Mlp => ModelKind::Mlp(MlpConfig {
                dropout: self.dropout,
                ..MlpConfig::new(self.widths.clone())
            }),
            ModelName::Gpt => ModelKind::Gpt(GptConfig {
                d_model: self.d_model,
                n_layers: self.layers,
                n_heads: self.heads,
                d_ff: self.d_ff,
                context: self.context,
                dropout: self.dropout,
                vocab: self.tokenizer.vocab(),
                ..GptConfig::default()
            }),
        }
    }
}

/// Everything about one training run except what to do with its results, grouped as the
/// library's `TrainConfig` is: the model, the data, the recipe, the distributed part, how it runs.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub recipe: RecipeArgs,
    #[command(flatten)]
    pub distributed: DistributedArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// On what data: the batches, the files, their order, uneven data, the held-out rows.
#[derive(Args, Clone, Debug)]
pub struct DataArgs {
    /// Rows per rank per microbatch.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Microbatches per step: the first K-1 accumulate under no_sync, the K-th reduces.
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    /// Under a policy that shards the gradients (ZeRO stage 2 or 3) with --accum 2 or more:
    /// reduce-scatter every microbatch's gradients as they fill and add them into the rank's
    /// gradient shard, so the whole model's full gradients are not held across the
    /// microbatches (a lower peak; each microbatch's gradients cross the wire; the sum equals
    /// no_sync's within rounding, not bit for bit).
    #[arg(long)]
    pub accum_into_shard: bool,
    /// Training data (safetensors, or NumPy .npz with an array per tensor, or .npy for gpt's
    /// one tensor; told apart by the file's first bytes): mlp `inputs` F32 [N,in] + `targets`
    /// I64 [N]; gpt `tokens` I64/U8 [N, context+1]. Default: built-in data. A path with `{rank}` names one
    /// file per rank (`shard-{rank}.safetensors`: rank r reads `shard-r.safetensors`, its rows
    /// in order and once, --batch-size a microbatch; --shuffle for epochs); files of different
    /// lengths need --join. gpt: token files too, read by row, never whole: llm.c's shards
    /// (`.bin`, told by their magic) or nanoGPT's raw uint16 (--data-format nanogpt); a `*` or
    /// `?` in the file name takes every matching shard, sorted (`'fineweb_train_*.bin'`).
    #[arg(long, conflicts_with = "text")]
    pub data: Option<PathBuf>,
    /// gpt: the layout of --data's (and --eval-data's) token files: llmc (the default for a file
    /// with llm.c's magic) or nanogpt (raw uint16).
    #[arg(long, value_enum)]
    pub data_format: Option<DataFormatFlag>,
    /// gpt: train on a UTF-8 text file, byte-level (rows of --context + 1 bytes); the last
    /// tenth of the file is kept apart as the validation split, which --eval-every evaluates.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Read the rows through a distributed sampler: a new permutation each epoch, drawn from
    /// --seed and the epoch, each rank a disjoint shard (PyTorch's DistributedSampler); rows
    /// that do not divide among the ranks are repeated from the epoch's start unless
    /// --drop-last. Default: rows in order.
    #[arg(long)]
    pub shuffle: bool,
    /// With --shuffle: drop the rows that do not divide among the ranks (DistributedSampler's
    /// drop_last) instead of repeating rows.
    #[arg(long)]
    pub drop_last: bool,
    /// Uneven data (per-rank files of different lengths; PyTorch's Join): a rank whose data
    /// ends joins the others, contributing zeros to every collective of each step, until every
    /// rank's data has ended (each rank's file is read once; --steps counts the longest rank's
    /// steps). divide-initial: a step's gradient is the sum over the ranks with data divided by
    /// --world-size (PyTorch's default); divide-active: divided by the ranks with data; throw:
    /// every rank stops with one error at the first step some rank has no data. Default:
    /// uneven data is an error before step 0.
    #[arg(long, value_parser = parse_join)]
    pub join: Option<JoinMode>,
    /// Hold out this fraction of the training data's rows (its last rows; in (0, 1)) for
    /// --eval-every: the run trains on the others.
    #[arg(long, allow_negative_numbers = true)]
    pub val_fraction: Option<f64>,
    /// Held-out data for --eval-every (the same format as --data).
    #[arg(long)]
    pub eval_data: Option<PathBuf>,
}

/// The recipe: steps, optimizer, learning-rate schedule, clipping, evaluation.
#[derive(Args, Clone, Debug)]
pub struct RecipeArgs {
    /// Number of optimizer steps: the run ends at this step.
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Learning rate (finite, > 0).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1e-3)]
    pub lr: f64,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerName::Adamw)]
    pub optimizer: OptimizerName,
    /// SGD momentum, in [0, 1) (default 0, as `torch.optim.SGD`); an error with AdamW.
    #[arg(long, allow_negative_numbers = true)]
    pub momentum: Option<f64>,
    /// Weight decay, finite and >= 0 (AdamW: decoupled; SGD: L2 added to the gradient).
    /// Default: 0.01 for AdamW, 0 for SGD.
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// Learning-rate schedule, peaking at --lr after --warmup-steps: constant, cosine (to
    /// --min-lr at --lr-decay-steps), linear (likewise) or step (x --lr-gamma every
    /// --lr-step-size steps). Checkpoints record it.
    #[arg(long, value_enum, default_value_t = ScheduleFlag::Constant)]
    pub lr_schedule: ScheduleFlag,
    /// Steps of linear warmup (lr * (s+1) / W for step s < W).
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// The floor of cosine and linear (finite, 0 <= min-lr <= lr).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub min_lr: f64,
    /// T: the step at which cosine and linear reach --min-lr (must exceed --warmup-steps).
    /// Default: --steps, or the T recorded in the checkpoint a run continues from (so extending
    /// --steps continues the same curve).
    #[arg(long)]
    pub lr_decay_steps: Option<u64>,
    /// step: the factor (finite, > 0).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.1)]
    pub lr_gamma: f64,
    /// step: steps between two multiplications (>= 1).
    #[arg(long, default_value_t = 1)]
    pub lr_step_size: u64,
    /// Clip the global gradient norm (over every parameter, after averaging over ranks and
    /// microbatches; torch.nn.utils.clip_grad_norm_) to this (finite, > 0).
    #[arg(long, allow_negative_numbers = true)]
    pub clip_grad_norm: Option<f64>,
    /// Evaluate every N steps (and after the last) on held-out data (--val-fraction,
    /// --eval-data, or the last tenth of --text): eval mode, no gradients, averaged over the ranks; the `val_loss` column.
    #[arg(long)]
    pub eval_every: Option<usize>,
    /// Train on through non-finite losses and parameters (default: stop with an error naming
    /// the step, keeping the last good checkpoint). A checkpoint such a run wrote, holding
    /// non-finite values, is continued under this flag only.
    #[arg(long)]
    pub allow_nonfinite: bool,
    /// Precision: f32 (default), bf16 (parameters, activations, GEMMs and gradient buckets in
    /// bf16; f32 master weights, AdamW moments and loss; checkpoints hold the f32 masters), or
    /// fp16 (the same, with dynamic loss scaling: a step with inf/NaN gradients is skipped and
    /// the scale halved; the `scale` column of --losses).
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    pub precision: brigade::MixedPrecision,
    /// The dtype the gradients are reduced in over the ranks (FSDP2's `reduce_dtype`): f32,
    /// bf16 or fp16; default: the --precision's parameter dtype. `--precision bf16
    /// --reduce-dtype f32` keeps f32 gradient buckets (the bf16 gradients widened as they
    /// accumulate, the sum exact in f32), twice the bucket bytes of bf16.
    #[arg(long, value_parser = parse_reduce_dtype)]
    pub reduce_dtype: Option<brigade::tensor::DType>,
}

impl RecipeArgs {
    /// `--precision` with `--reduce-dtype` applied.
    pub fn mixed_precision(&self) -> brigade::MixedPrecision {
        brigade::MixedPrecision {
            reduce_dtype: self.reduce_dtype.unwrap_or(self.precision.reduce_dtype),
            ..self.precision
        }
    }
}

/// `--precision`: f32, bf16 or fp16.
fn parse_precision(s: &str) -> std::result::Result<brigade::MixedPrecision, String> {
    brigade::MixedPrecision::parse(s)
}

/// `--reduce-dtype`: f32, bf16 or fp16.
fn parse_reduce_dtype(s: &str) -> std::result::Result<brigade::tensor::DType, String> {
    brigade::MixedPrecision::parse(s)
        .map(|p| p.param_dtype)
        .map_err(|_| format!("unknown reduce dtype '{s}' (f32, bf16, fp16)"))
}

/// The ranks and DDP: how many, over which backend, the buckets, the reducer policy, the
/// simulated network, the wait for the others.
#[derive(Args, Clone, Debug)]
pub struct DistributedArgs {
    /// Number of ranks (thread backend).
    #[arg(long, default_value_t = 1)]
    pub world_size: usize,
    /// Communication backend.
    #[arg(long, value_parser = backend_parser(), default_value_t = CommBackend::Thread)]
    pub backend: CommBackend,
    /// DDP bucket cap in MiB, or `auto` (the overlap model picks it from the recorded steps;
    /// see --autotune-*). `brigade sweep` takes a comma-separated list of caps.
    #[arg(long, allow_negative_numbers = true, value_delimiter = ',', default_value = "25", value_parser = parse_bucket_cap)]
    pub bucket_mb: Vec<BucketCap>,
    #[command(flatten)]
    pub autotune: AutotuneArgs,
    /// DDP first-bucket cap in MiB; a smaller --bucket-mb caps the first bucket too (as in
    /// `brigade sweep`, `brigade predict` and the autotuner).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    pub first_bucket_mb: f64,
    /// Mark parameters that get no gradient as ready instead of failing.
    #[arg(long)]
    pub find_unused_parameters: bool,
    /// The reducer policy of the run: `train --policy`, a sweep's row, or the older spellings
    /// `--zero` and `--comm-hook` ([`RunArgs::resolve_policy`] sets it).
    #[arg(skip = PolicySpec::AllReduce)]
    pub policy: PolicySpec,
    /// How the command line named the policy (`--policy fp16`, `--zero 2`), for errors;
    /// `None`: the default.
    #[arg(skip)]
    pub policy_given: Option<String>,
    /// `--comm-hook`, a hidden spelling of `--policy` ([`RunArgs::take_old_spellings`] names
    /// the flag).
    #[arg(long = "comm-hook", value_name = "HOOK", hide = true, value_parser = crate::policy::parse_entry)]
    pub comm_hook_alias: Option<String>,
    /// PowerSGD: rank of the approximation (>= 1).
    #[arg(long, default_value_t = 1)]
    pub powersgd_rank: usize,
    /// PowerSGD: iterations of plain all-reduce before compression starts.
    #[arg(long, default_value_t = 10)]
    pub powersgd_start_iter: usize,
    /// ZeRO stage: 0 plain DDP; 1 shards the optimizer state over the ranks (each bucket
    /// reduce-scattered, each rank steps its shard, parameters all-gathered); 2 also keeps only
    /// the rank's shard of the gradients; 3 also keeps only the rank's shard of the parameters,
    /// gathered per block for its forward and again for its backward. `--policy zero1|zero2|zero3`
    /// is the same.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,
    /// Simulated network bandwidth in gigabits per second (e.g. 10 for 10GbE), 0.001 to 1e6.
    #[arg(long, allow_negative_numbers = true)]
    pub net_gbps: Option<f64>,
    /// Simulated network latency per message in microseconds, 0 to 1e7; needs --net-gbps
    /// (without a bandwidth there is no simulated network, and a latency is an error).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub net_latency_us: f64,
    /// Seconds any rank waits for the others before failing (finite, > 0, at most 1e6).
    #[arg(long, allow_negative_numbers = true, default_value_t = 120.0)]
    pub timeout_s: f64,
}

impl DistributedArgs {
    /// The link collectives are costed on: the simulated one (`--net-gbps`, `--net-latency-us`),
    /// or, without one, the machine's own, fitted from the recorded buckets.
    pub fn link(&self) -> LinkCost {
        match self.net_gbps {
            Some(g) => LinkCost::Ring(net_model(g, self.net_latency_us)),
            None => LinkCost::Measured,
        }
    }
}

/// How the run executes: the device, the compute threads, the steps left out of the timing.
#[derive(Args, Clone, Debug)]
pub struct RuntimeArgs {
    /// Where the model, batches, gradients and optimizer state live: cpu, cuda (rank r on GPU
    /// r % count) or cuda:N (GPUs from N). DDP stages gradient buckets through the host.
    #[arg(long, value_parser = parse_device, default_value_t = DevicePlacement::Cpu)]
    pub device: DevicePlacement,
    /// Compute threads per rank (default: the cores divided among the ranks).
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Steps left out of the timing summary: the first N steps run are not timed (the
    /// learning rate's warmup is --warmup-steps).
    #[arg(long, default_value_t = 0)]
    pub untimed_steps: usize,
    /// Refuses, before step 0, a run predicted to hold more than this many MB (MiB, as
    /// --bucket-cap-mb) per rank at once during a step; the error names the largest part and
    /// what would make the run fit. The prediction (parameters, gradients, optimizer state,
    /// activations, backward's working set) is `memory.predicted_peak_bytes` of --json; a run
    /// whose measured peak passes the budget says by how much after its end.
    #[arg(long, value_name = "MB", allow_negative_numbers = true)]
    pub memory_budget: Option<f64>,
    /// `--warmup`, a hidden spelling of --untimed-steps ([`RunArgs::take_old_spellings`] moves
    /// it there and names the flag).
    #[arg(long = "warmup", hide = true, conflicts_with = "untimed_steps")]
    pub warmup: Option<usize>,
}

/// Says on stderr, one line each, the notes of [`RunArgs::take_old_spellings`].
pub fn say_old_spellings(notes: &[String]) {
    for note in notes {
        eprintln!("note: {note}");
    }
}

/// `--lr-schedule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScheduleFlag {
    /// --lr throughout (after the warmup).
    Constant,
    /// Half a cosine down to --min-lr at --lr-decay-steps.
    Cosine,
    /// A straight line down to --min-lr at --lr-decay-steps.
    Linear,
    /// x --lr-gamma every --lr-step-size steps.
    Step,
}

impl RunArgs {
    /// Moves a value given under a hidden old spelling to its flag, and returns a note per
    /// spelling used, with the flag's name, for [`say_old_spellings`] (said once the command
    /// succeeded, so that a refused run still says one line).
    pub fn take_old_spellings(&mut self) -> Vec<String> {
        let mut notes = vec![];
        if let Some(n) = self.runtime.warmup.take() {
            self.runtime.untimed_steps = n;
            notes.push(
                "--warmup is spelled --untimed-steps (the steps left out of the timing; --warmup-steps is the learning rate's warmup)".into(),
            );
        }
        if let Some(hook) = &self.distributed.comm_hook_alias {
            notes.push(format!("--comm-hook is spelled --policy (here --policy {hook})"));
        }
        notes
    }

    /// Sets the run's policy from `entry` (what `--policy` was given), else from the older
    /// spellings `--comm-hook` and `--zero`; a bare policy name takes its settings from their
    /// own flags (`--powersgd-rank`, `--powersgd-start-iter`).
    pub fn resolve_policy(&mut self, entry: Option<&str>) -> Result<()> {
        let d = &self.distributed;
        let (given, spec) = match (entry, &d.comm_hook_alias, d.zero) {
            (Some(e), _, _) => (format!("--policy {e}"), e.to_string()),
            (None, Some(h), 0) => (format!("--comm-hook {h}"), h.clone()),
            (None, Some(h), z) => {
                return Err(Error::Usage(format!(
                    "--zero {z} reduce-scatters each bucket itself and does not combine with --comm-hook {h}: drop one of them"
                )))
            }
            (None, None, 0) => return Ok(()),
            (None, None, z) => {
                let stage = ZeroStage::from_level(z).unwrap_or_default();
                let spec = PolicySpec::zero(stage).expect("--zero 1 to 3");
                (format!("--zero {z}"), spec.to_string())
            }
        };
        self.distributed.policy = crate::policy::resolve(&spec, d.powersgd_rank, d.powersgd_start_iter)?;
        self.distributed.policy_given = Some(given);
        Ok(())
    }

    /// The reducer policy of the run.
    pub fn hook_spec(&self) -> PolicySpec {
        self.distributed.policy.clone()
    }

    /// How the command line named the run's policy (`--policy SPEC` when it did not).
    pub fn policy_flag(&self) -> String {
        self.distributed
            .policy_given
            .clone()
            .unwrap_or_else(|| format!("--policy {}", self.distributed.policy))
    }

    /// The learning-rate schedule the flags describe.
    pub fn schedule(&self) -> brigade::ScheduleConfig {
        use brigade::ScheduleName;
        brigade::ScheduleConfig {
            name: match self.recipe.lr_schedule {
                ScheduleFlag::Constant => ScheduleName::Constant,
                ScheduleFlag::Cosine => ScheduleName::Cosine,
                ScheduleFlag::Linear => ScheduleName::Linear,
                ScheduleFlag::Step => ScheduleName::Step,
            },
            warmup_steps: self.recipe.warmup_steps,
            decay_steps: self.recipe.lr_decay_steps,
            min_lr: self.recipe.min_lr,
            step_size: self.recipe.lr_step_size,
            gamma: self.recipe.lr_gamma,
        }
    }

    /// SGD's momentum in effect (0 unless given, as in `torch.optim.SGD`).
    pub fn momentum(&self) -> f64 {
        self.recipe.momentum.unwrap_or(0.0)
    }

    /// The single bucket cap of a training run (with `auto`, the cap it starts from).
    pub fn bucket_cap(&self) -> Result<f64> {
        self.start_cap().ok_or_else(|| {
            let caps: Vec<String> = self.distributed.bucket_mb.iter().map(|b| b.to_string()).collect();
            Error::Usage(format!(
                "--bucket-mb takes one value for a training run, got {} (a list is for `brigade sweep`)",
                caps.join(",")
            ))
        })
    }

    /// `--data`'s path when it names a file per rank (it holds `{rank}`).
    pub fn rank_data(&self) -> Option<&str> {
        self.data
            .data
            .as_deref()
            .and_then(|p| p.to_str())
            .filter(|p| p.contains(RANK_PLACEHOLDER))
    }

    /// Rank `rank`'s data file when `--data` names a file per rank.
    pub fn rank_data_path(&self, rank: usize) -> Option<PathBuf> {
        self.rank_data()
            .map(|p| PathBuf::from(p.replace(RANK_PLACEHOLDER, &rank.to_string())))
    }

    /// The layout `--data-format` names (`None`: told by the file).
    pub fn token_format(&self) -> Option<TokenFormat> {
        self.data.data_format.map(DataFormatFlag::format)
    }

    /// Rows per rank per step (checked not to overflow by [`RunArgs::validate`]).
    pub fn rows_per_rank(&self) -> usize {
        self.data.batch_size.saturating_mul(self.data.accum)
    }

    /// The weight decay in effect.
    pub fn weight_decay(&self) -> f64 {
        self.recipe.weight_decay.unwrap_or(match self.recipe.optimizer {
            OptimizerName::Adamw => AdamW::DEFAULT_WEIGHT_DECAY,
            OptimizerName::Sgd => 0.0,
        })
    }
}
