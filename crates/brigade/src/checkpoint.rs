//! Checkpoints: parameters, optimizer state, every rank's reducer-policy state and every rank's
//! dropout generator with the step they were taken after, in one safetensors file (written
//! atomically), and loading them back to resume a run.
//!
//! Tensors are named `model.<param>`, `optim.<key>` (rank 0's) and `policy.rank<r>/<key>` (rank
//! `r`'s [`brigade_ddp::ReducerPolicy::state_dict`], gathered on rank 0: PowerSGD's error
//! feedback differs per rank); the metadata records the policy's spec (`powersgd:1@2`), and a
//! resume under another spec is refused. Under a policy whose ranks diverge between syncs
//! ([`brigade_ddp::Replicas::Diverge`]: local SGD, DiLoCo) every rank's own parameters and
//! optimizer state are `rank.rank<r>/params/<param>` and `rank.rank<r>/optimizer/<key>`, and
//! such a checkpoint resumes on as many ranks only ([`CheckpointMismatch::DivergedWorld`]).
//!
//! Once DDP regrouped its buckets (from the ready order after the first step), the metadata
//! records the grouping (`buckets`: each bucket's parameter names, a JSON list of lists;
//! `bucket_caps_mb`: `<cap>,<first cap>`; `bucket_generation`), and a resume reduces on the
//! same buckets ([`brigade_ddp::DdpConfig::grouping`]): a policy whose reduction depends on
//! which gradients share a bucket (int8's one scale per bucket) continues exactly. Under the
//! bucket-cap autotuner the metadata also records where its checks stand (`autotune_checks`,
//! `autotune_since_check`: [`brigade_ddp::overlap::AutotuneProgress`]), and a resume that tunes
//! the cap starts from the recorded caps and checks at the steps the checkpoint's run would.
//!
//! The parameters and the optimizer state are saved whole, under the parameters' names, whatever
//! the writing run's policy and world size. A resume under ZeRO-3 that starts sharded (f32
//! parameters on the CPU, the model built from recipes: [`crate::TrainConfig::starts_sharded`])
//! reads only its ranges of both from the file ([`load_checkpoint_by_shards`]), on any number of
//! ranks; every other resume loads the file whole and a ZeRO policy cuts its shards from it:
//! 16-bit parameters (the f32 master weights are made whole from the parameters before the
//! policy cuts them), a device (the parameters move whole before DDP is built), a model built
//! without recipes, and a run that takes non-finite values (the ranged reads refuse them).
//!
//! Rank `r`'s dropout generator ([`Model::rng_state`]: a seed and a count of masks drawn, two
//! `u64`s) is the metadata entry `dropout_rng.rank<r>` = `<seed>:<offset>`, so that a resume at
//! `p > 0` draws the masks an uninterrupted run would. A checkpoint without these entries (a
//! model that draws nothing, or an older checkpoint) resumes with the model's fresh generator.
//! On another number of ranks, a resume continues the generator only when every rank that
//! wrote it stood at the same state (the ranks drew the same masks: each new rank continues
//! it); otherwise it is refused in one line ([`CheckpointMismatch::DropoutRngWorld`]).

use std::path::Path;

use brigade_autograd::{Optimizer, StateInFile, StoredState};
use brigade_ddp::overlap::AutotuneProgress;
use brigade_ddp::BucketGrouping;
use std::collections::HashMap;

use brigade_models::{
    load_params_from_tensors, load_safetensors_with_metadata, save_safetensors, Model, NamedTensors, RngState,
    SamplerPosition, TRAINING_CHECKPOINT_FORMAT,
};
use brigade_policies::StateLayout;
use brigade_tensor::Tensor;

use crate::error::{CheckpointMismatch, Error, Result};

/// Checkpoint metadata key of the ranks the checkpoint's run trained on.
pub(crate) const WORLD_SIZE_KEY: &str = "world_size";

/// Checkpoint metadata key of the loss of the step before the checkpoint's (the global mean,
/// as [`crate::outcome::StepRecord::loss`], written in full): a program that keeps a record of
/// the losses checks against it that the record is this run's.
pub const LAST_LOSS_KEY: &str = "last_loss";

/// Prefix of the policy state's tensors.
const POLICY_PREFIX: &str = "policy.";

/// Prefix of every rank's own parameters and optimizer state (a diverging policy's).
const RANK_PREFIX: &str = "rank.";

/// Metadata keys of the buckets' grouping.
const BUCKETS_KEY: &str = "buckets";
const BUCKET_CAPS_KEY: &str = "bucket_caps_mb";
const BUCKET_GENERATION_KEY: &str = "bucket_generation";

/// Metadata keys of the autotuner's progress.
const AUTOTUNE_CHECKS_KEY: &str = "autotune_checks";
const AUTOTUNE_SINCE_CHECK_KEY: &str = "autotune_since_check";

/// Prefix of the metadata entries of the ranks' dropout generators (`dropout_rng.rank<r>`).
const RNG_PREFIX: &str = "dropout_rng.rank";

const CHECKPOINT_FORMAT: &str = TRAINING_CHECKPOINT_FORMAT;

/// What a checkpoint records besides the tensors, and a resume checks: the model's name, the
/// optimizer's name, the seed (it chooses the built-in data) and the data's fingerprint.
pub struct CheckpointIdentity<'a> {
    /// The model's name (`mlp`, `gpt`, or a user's).
    pub model: &'a str,
    /// The optimizer's name (`sgd`, `adamw`).
    pub optimizer: &'a str,
    /// The run's seed (it chooses the initial parameters and the built-in data).
    pub seed: u64,
    /// The training data's fingerprint ([`crate::source::DataSource::fingerprint`]; `None`:
    /// neither recorded nor checked).
    pub data: Option<String>,
    /// How the policy lays the state out over the ranks: a checkpoint resumes only under the
    /// layout it was written with (on any number of ranks).
    pub layout: StateLayout,
    /// The number of ranks.
    pub world_size: usize,
    /// How the run orders its rows ([`crate::source::DataOrder::describe`]; `None`: in order,
    /// not recorded). A resume checks it, and a sampled run's resume the world size too.
    pub data_order: Option<String>,
    /// Where rank 0's sampler stands after the checkpoint's step (written; a resume reads it
    /// back from the file).
    pub sampler: Option<SamplerPosition>,
    /// The model's shape ([`crate::config::ModelConfig::config`]; written, not checked).
    pub model_config: Option<String>,
    /// The recipe's metadata, written beside the rest (the schedule and every
    /// hyperparameter); a resume checks it with
    /// [`crate::resume::check_resume`], not here.
    pub recipe: Vec<(String, String)>,
    /// The reducer policy's spec as it reads (`allreduce`, `powersgd:4@2`, a user's name), or
    /// `None` without DDP: a checkpoint resumes only under the policy it was written with
    /// (older checkpoints, which do not record it, under any).
    pub policy: Option<&'a str>,
    /// Every rank's dropout generator after the checkpoint's step, rank `r`'s at index `r`
    /// (written; a resume reads them back from the file); empty when the model draws nothing.
    pub dropout_rng: Vec<RngState>,
    /// The checkpoint's lineage and generation entries
    /// ([`crate::checkpoint_files`]; written, not checked).
    pub lineage: Vec<(String, String)>,
    /// Whether a resume takes non-finite values (a run under
    /// [`crate::config::RecipeConfig::allow_nonfinite`] writes them); otherwise one is refused, naming
    /// the tensor. Not written.
    pub allow_nonfinite: bool,
}

/// The prefix of the caller's metadata keys in a checkpoint
/// ([`crate::config::CheckpointConfig::metadata`]).
pub const USER_PREFIX: &str = "user.";

/// A checkpoint's model: its name, its recorded shape and its parameters, for loading it
/// outside training (e.g. to sample from a GPT).
#[derive(Debug)]
pub struct CheckpointModel {
    /// The model's name (`gpt`, `mlp`, or a user's).
    pub name: String,
    /// The model's shape as recorded (`None`: the checkpoint records none).
    pub config: Option<String>,
    /// The step the checkpoint was taken before.
    pub step: usize,
    /// The parameters, by name (without the checkpoint's `model.` prefix).
    pub params: Vec<(String, Tensor)>,
    /// Every metadata entry of the file (Brigade's and the caller's,
    /// [`crate::config::CheckpointConfig::metadata`]).
    pub metadata: HashMap<String, String>,
}

/// A checkpoint file's tensors, by name, and its metadata.
type CheckpointContents = (Vec<(String, Tensor)>, HashMap<String, String>);

/// The tensors and metadata of the file at `path`, an error unless it is a Brigade checkpoint.
fn read_checkpoint(path: &Path) -> Result<CheckpointContents> {
    let (tensors, meta) = load_safetensors_with_metadata(path)?;
    if meta.get("format").map(String::as_str) != Some(CHECKPOINT_FORMAT) {
        return Err(Error::checkpoint(path, CheckpointMismatch::NotACheckpoint));
    }
    Ok((tensors, meta))
}

/// The metadata of the Brigade checkpoint at `path`, read from its header alone; `None` when
/// the file cannot be read, is not a regular file (a pipe is not opened: that would wait for a
/// writer) or is not a Brigade checkpoint.
pub fn read_metadata(path: &Path) -> Option<HashMap<String, String>> {
    use std::io::Read;
    if !std::fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let mut f = std::fs::File::open(path).ok()?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).ok()?;
    // a safetensors header is JSON of at most 100 MB (the format's own limit)
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 {
        return None;
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let meta: HashMap<String, String> = header
        .get("__metadata__")?
        .as_object()?
        .iter()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
        .collect();
    (meta.get("format").map(String::as_str) == Some(CHECKPOINT_FORMAT)).then_some(meta)
}

/// The step the checkpoint at `path` continues from, from its header alone ([`read_metadata`]).
pub fn checkpoint_step(path: &Path) -> Option<usize> {
    step_of(&read_metadata(path)?)
}

/// The step a checkpoint's metadata records (the step to run next).
fn step_of(meta: &HashMap<String, String>) -> Option<usize> {
    meta.get("step").and_then(|s| s.parse().ok())
}

/// Reads the model part of the checkpoint at `path`: errors when the file cannot be read, is
/// not a Brigade checkpoint, or holds a non-finite parameter.
pub fn load_model_tensors(path: &Path) -> Result<CheckpointModel> {
    let err = |mismatch| Error::checkpoint(path, mismatch);
    let (tensors, meta) = read_checkpoint(path)?;
    let step = step_of(&meta).ok_or_else(|| err(CheckpointMismatch::NoStep))?;
    let params: Vec<(String, Tensor)> = tensors
        .into_iter()
        .filter_map(|(n, t)| n.strip_prefix("model.").map(|n| (n.to_string(), t)))
        .collect();
    brigade_models::check_finite(path, &params)?;
    Ok(CheckpointModel {
        name: meta.get("model").cloned().unwrap_or_default(),
        config: meta.get("model_config").cloned(),
        step,
        params,
        metadata: meta,
    })
}

/// What a checkpoint holds of DDP beside rank 0's model and optimizer state: what a resume
/// needs to continue every rank bit for bit.
#[derive(Debug, Clone, Default)]
pub struct DistributedState {
    /// Every rank's policy state, entries `rank<r>/<key>`
    /// ([`brigade_ddp::DistributedDataParallel::gather_policy_state`]); empty when the policy
    /// keeps none.
    pub policy: Vec<(String, Tensor)>,
    /// Every rank's own parameters and optimizer state under a policy whose ranks diverge
    /// between syncs, entries `rank<r>/params/<name>` and `rank<r>/optimizer/<key>`
    /// ([`brigade_ddp::DistributedDataParallel::gather_rank_state`]); empty otherwise.
    pub ranks: Vec<(String, Tensor)>,
    /// The buckets' grouping once DDP regrouped them
    /// ([`brigade_ddp::DistributedDataParallel::bucket_grouping`]).
    pub buckets: Option<BucketGrouping>,
    /// Where the bucket-cap autotuner's checks stood
    /// ([`brigade_ddp::overlap::Autotuner::progress`]); `None` without one.
    pub autotune: Option<AutotuneProgress>,
}

/// What a resume continues from.
#[derive(Debug)]
pub struct Resumed {
    /// The step to run next.
    pub step: usize,
    /// Where the sampler stood (sampled runs' checkpoints): the epoch and the row of it the next
    /// step reads first, on every rank.
    pub sampler: Option<SamplerPosition>,
    /// The checkpoint's metadata (the recipe's among it).
    pub metadata: HashMap<String, String>,
    /// Every rank's policy state, every rank's own parameters and optimizer state (a diverging
    /// policy's) and the buckets' grouping, for DDP (its
    /// [`load_gathered_policy_state`](brigade_ddp::DistributedDataParallel::load_gathered_policy_state),
    /// [`load_rank_state`](brigade_ddp::DistributedDataParallel::load_rank_state) and
    /// [`DdpConfig::grouping`](brigade_ddp::DdpConfig::grouping)).
    pub distributed: DistributedState,
    /// Every writing rank's dropout generator, by rank (empty: the checkpoint records none).
    /// When this run has another number of ranks, they are all one state (checked on load).
    pub dropout_rng: Vec<RngState>,
    /// fp16's loss scale as the checkpoint holds it (`None`: it holds none).
    pub loss_scale: Option<f64>,
}

impl Resumed {
    /// The dropout generator rank `rank` continues from: its own, or on another number of
    /// ranks the one state every writing rank shared; `None` when the checkpoint records none
    /// (the model keeps its fresh generator).
    pub fn dropout_rng_of(&self, rank: usize) -> Option<RngState> {
        self.dropout_rng.get(rank).or(self.dropout_rng.first()).copied()
    }
}

/// `<seed>:<offset>`, the metadata value of one rank's dropout generator.
fn rng_record(s: &RngState) -> String {
    format!("{}:{}", s.seed, s.offset)
}

/// Every rank's dropout generator from a checkpoint's metadata, by rank: the entries must be
/// ranks `0..n`, each `<seed>:<offset>`.
fn read_rngs(meta: &HashMap<String, String>) -> std::result::Result<Vec<RngState>, CheckpointMismatch> {
    let bad = CheckpointMismatch::DropoutRng;
    let mut by_rank: Vec<(usize, RngState)> = vec![];
    for (k, v) in meta {
        let Some(rank) = k.strip_prefix(RNG_PREFIX) else {
            continue;
        };
        let rank: usize = rank.parse().map_err(|_| bad(format!("entry '{k}' names no rank")))?;
        let state = v
            .split_once(':')
            .and_then(|(s, o)| {
                Some(RngState {
                    seed: s.parse().ok()?,
                    offset: o.parse().ok()?,
                })
            })
            .ok_or_else(|| bad(format!("entry '{k}' is '{v}', not <seed>:<offset>")))?;
        by_rank.push((rank, state));
    }
    by_rank.sort_by_key(|(r, _)| *r);
    if let Some((i, (r, _))) = by_rank.iter().enumerate().find(|(i, (r, _))| i != r) {
        return Err(bad(format!(
            "it holds rank {r}'s generator where rank {i}'s belongs (ranks 0..{} expected)",
            by_rank.len()
        )));
    }
    Ok(by_rank.into_iter().map(|(_, s)| s).collect())
}

/// The model's full f32 weights by name: `opt`'s master weights when it keeps them beside
/// 16-bit parameters (mixed precision), else the parameters themselves.
pub(crate) fn full_weights(model: &dyn Model, opt: &dyn Optimizer) -> Vec<(String, Tensor)> {
    match opt.master_weights() {
        masters if masters.is_empty() => model.params().named_values(),
        masters => masters,
    }
}

/// Writes `model`'s parameters and `opt`'s state after `step` steps to `path`, with `id` and
/// what it holds of DDP (`distributed`). The model saved is the optimizer's f32 master weights
/// when it keeps them beside 16-bit parameters (mixed precision), else the parameters
/// themselves: either way full f32 weights.
pub fn save_checkpoint(
    path: &Path,
    id: &CheckpointIdentity<'_>,
    model: &dyn Model,
    opt: &dyn Optimizer,
    distributed: &DistributedState,
    step: usize,
) -> Result<()> {
    let weights = full_weights(model, opt);
    let mut tensors: Vec<(String, Tensor)> = weights.into_iter().map(|(n, t)| (format!("model.{n}"), t)).collect();
    tensors.extend(opt.state_dict()?.into_iter().map(|(n, t)| (format!("optim.{n}"), t)));
    for (prefix, entries) in [(POLICY_PREFIX, &distributed.policy), (RANK_PREFIX, &distributed.ranks)] {
        tensors.extend(entries.iter().map(|(n, t)| (format!("{prefix}{n}"), t.clone())));
    }
    let meta = [
        ("format", CHECKPOINT_FORMAT.to_string()),
        ("step", step.to_string()),
        ("model", id.model.to_string()),
        ("optimizer", id.optimizer.to_string()),
        ("seed", id.seed.to_string()),
        ("zero", id.layout.record().to_string()),
        (WORLD_SIZE_KEY, id.world_size.to_string()),
    ]
    .into_iter()
    .chain(id.data.clone().map(|fp| ("data", fp)))
    .chain(id.policy.map(|p| ("policy", p.to_string())))
    .chain(id.data_order.clone().map(|o| ("data_order", o)))
    .chain(id.model_config.clone().map(|c| ("model_config", c)))
    .chain(id.sampler.into_iter().flat_map(|p| {
        [
            ("sampler_epoch", p.epoch.to_string()),
            ("sampler_index", p.index.to_string()),
        ]
    }))
    .map(|(k, v)| (k.to_string(), v))
    .chain(distributed.buckets.as_ref().map_or_else(Vec::new, grouping_record))
    .chain(distributed.autotune.iter().flat_map(|p| {
        [
            (AUTOTUNE_CHECKS_KEY.to_string(), p.checks.to_string()),
            (AUTOTUNE_SINCE_CHECK_KEY.to_string(), p.since_check.to_string()),
        ]
    }))
    .chain(id.recipe.iter().cloned())
    .chain(id.lineage.iter().cloned())
    .chain(
        id.dropout_rng
            .iter()
            .enumerate()
            .map(|(r, s)| (format!("{RNG_PREFIX}{r}"), rng_record(s))),
    )
    .collect();
    save_safetensors(path, &tensors, Some(meta))?;
    Ok(())
}

/// Loads a checkpoint into the model and optimizer after checking it was written for `id`;
/// returns the step to continue from and the checkpoint's metadata.
pub fn load_checkpoint(
    path: &Path,
    id: &CheckpointIdentity<'_>,
    model: &dyn Model,
    opt: &mut dyn Optimizer,
) -> Result<Resumed> {
    let err = |mismatch| Error::checkpoint(path, mismatch);
    let (tensors, meta) = read_checkpoint(path)?;
    let (step, sampler) = check_identity(path, &meta, id)?;
    if !id.allow_nonfinite {
        brigade_models::check_finite(path, &tensors).map_err(|e| match e {
            brigade_models::ModelError::NonFinite {
                tensor, index, value, ..
            } => err(CheckpointMismatch::NonFinite {
                tensor,
                index: format!("{index:?}"),
                value: value.to_string(),
            }),
            e => e.into(),
        })?;
    }
    let strip = |prefix: &str| -> Vec<(String, Tensor)> {
        tensors
            .iter()
            .filter_map(|(n, t)| n.strip_prefix(prefix).map(|n| (n.to_string(), t.clone())))
            .collect()
    };
    let load = match id.allow_nonfinite {
        false => load_params_from_tensors,
        true => brigade_models::load_params_from_tensors_nonfinite,
    };
    load(model.params(), &strip("model.")).map_err(|e| e.at_path(path))?;
    opt.load_state_dict(&strip("optim."))?;
    let loss_scale = tensors
        .iter()
        .find(|(n, _)| n == "optim.grad_scaler.scale")
        .and_then(|(_, t)| t.to_f64_vec().ok()?.first().copied());
    resumed(
        path,
        meta,
        id,
        (step, sampler),
        (strip(POLICY_PREFIX), strip(RANK_PREFIX)),
        loss_scale,
    )
}

/// Resumes from the checkpoint at `path` as [`load_checkpoint`] does, under a policy that
/// keeps each rank's shard of the parameters and of the optimizer state (ZeRO-3 started
/// sharded: `model`'s parameters still deferred), holding nothing whole: only the file's
/// header is read here, and the entries of no parameter (the policy's state per rank, the
/// optimizer's step counter); every parameter's recipe becomes its bytes in the file
/// ([`brigade_models::defer_params_to_file`]) and the optimizer state is left there beside
/// `opt` ([`StateInFile`]), so that each rank reads only its ranges of both as it cuts its
/// shards. A truncated file is refused here, from its header; a NaN or infinity is found by
/// the rank whose range holds it (so a run that takes non-finite values loads whole).
pub fn load_checkpoint_by_shards(
    path: &Path,
    id: &CheckpointIdentity<'_>,
    model: &dyn Model,
    opt: Box<dyn Optimizer>,
) -> Result<(Resumed, Box<dyn Optimizer>)> {
    let (stored, meta) = brigade_models::stored_tensors(path)?;
    if meta.get("format").map(String::as_str) != Some(CHECKPOINT_FORMAT) {
        return Err(Error::checkpoint(path, CheckpointMismatch::NotACheckpoint));
    }
    let at = check_identity(path, &meta, id)?;
    brigade_models::defer_params_to_file(model.params(), path)?;
    let read = |prefix: &str| -> Result<Vec<(String, Tensor)>> {
        (stored.iter())
            .filter_map(|s| Some((s.name.strip_prefix(prefix)?, s)))
            .map(|(n, s)| Ok((n.to_string(), s.read()?)))
            .collect()
    };
    let state = (stored.iter())
        .filter_map(|s| Some((s.name.strip_prefix("optim.")?, s)))
        .map(|(n, s)| {
            Ok(StoredState {
                name: n.to_string(),
                shape: s.shape.clone(),
                init: s.recipe()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let loss_scale = match state.iter().find(|s| s.name == "grad_scaler.scale") {
        Some(s) => s.read()?.to_f64_vec()?.first().copied(),
        None => None,
    };
    let resumed = resumed(
        path,
        meta,
        id,
        at,
        (read(POLICY_PREFIX)?, read(RANK_PREFIX)?),
        loss_scale,
    )?;
    Ok((resumed, Box::new(StateInFile::new(opt, state))))
}

/// The step a checkpoint's metadata `meta` resumes at and where its sampler stood, after
/// checking it was written for `id`.
fn check_identity(
    path: &Path,
    meta: &HashMap<String, String>,
    id: &CheckpointIdentity<'_>,
) -> Result<(usize, Option<SamplerPosition>)> {
    let err = |mismatch| Error::checkpoint(path, mismatch);
    check_written_for(meta, id).map_err(err)?;
    let sampler = check_data_order(meta, id).map_err(err)?;
    let step = step_of(meta).ok_or_else(|| err(CheckpointMismatch::NoStep))?;
    Ok((step, sampler))
}

/// What a resume continues from: the checkpoint's metadata, `(step, sampler)`, the policy's
/// and the ranks' own entries (`(policy, ranks)`, prefixes stripped) and the loss scale,
/// checked against this run's world and its dropout generators read.
fn resumed(
    path: &Path,
    meta: HashMap<String, String>,
    id: &CheckpointIdentity<'_>,
    (step, sampler): (usize, Option<SamplerPosition>),
    (policy, ranks): (NamedTensors, NamedTensors),
    loss_scale: Option<f64>,
) -> Result<Resumed> {
    let err = |mismatch| Error::checkpoint(path, mismatch);
    let distributed = DistributedState {
        policy,
        ranks,
        buckets: read_grouping(&meta).map_err(err)?,
        autotune: read_autotune(&meta).map_err(err)?,
    };
    check_world(&meta, &distributed, id).map_err(err)?;
    let dropout_rng = read_dropout_rngs(&meta, id).map_err(err)?;
    Ok(Resumed {
        step,
        sampler,
        metadata: meta,
        distributed,
        dropout_rng,
        loss_scale,
    })
}

/// That the checkpoint was written for this run: its model, optimizer, seed, data, sharding
/// and policy (the seed chooses the built-in data; the fingerprint tells any data apart; older
/// checkpoints have neither).
fn check_written_for(
    meta: &HashMap<String, String>,
    id: &CheckpointIdentity<'_>,
) -> std::result::Result<(), CheckpointMismatch> {
    for (what, want) in [("model", id.model), ("optimizer", id.optimizer)] {
        let written = meta.get(what).cloned().unwrap_or_default();
        if written != want {
            return Err(CheckpointMismatch::Written {
                what,
                written,
                this_run: want.to_string(),
            });
        }
    }
    if let Some(written) = meta.get("seed").filter(|got| **got != id.seed.to_string()) {
        return Err(CheckpointMismatch::Seed {
            written: written.clone(),
            this_run: id.seed,
        });
    }
    if let (Some(written), Some(this_run)) = (meta.get("data"), &id.data) {
        if written != this_run {
            return Err(CheckpointMismatch::Data {
                written: written.clone(),
                this_run: this_run.clone(),
            });
        }
    }
    check_sharding(meta, id)?;
    if let (Some(written), Some(this_run)) = (meta.get("policy"), id.policy) {
        if written != this_run {
            return Err(CheckpointMismatch::Written {
                what: "policy",
                written: written.clone(),
                this_run: this_run.to_string(),
            });
        }
    }
    Ok(())
}

/// The ranks' own parameters and a policy's state are per rank: they resume on as many ranks
/// as wrote them.
fn check_world(
    meta: &HashMap<String, String>,
    distributed: &DistributedState,
    id: &CheckpointIdentity<'_>,
) -> std::result::Result<(), CheckpointMismatch> {
    let world: Option<usize> = meta.get(WORLD_SIZE_KEY).and_then(|w| w.parse().ok());
    if !distributed.ranks.is_empty() && world != Some(id.world_size) {
        return Err(CheckpointMismatch::DivergedWorld {
            policy: meta.get("policy").cloned().unwrap_or_default(),
            written_world: world,
            world: id.world_size,
        });
    }
    if !distributed.policy.is_empty() && world != Some(id.world_size) {
        return Err(CheckpointMismatch::PolicyWorld {
            policy: meta.get("policy").cloned().unwrap_or_default(),
            written_world: world,
            world: id.world_size,
        });
    }
    Ok(())
}

/// The dropout generators: each rank continues its own; on another number of ranks only a
/// state they all shared can be continued.
fn read_dropout_rngs(
    meta: &HashMap<String, String>,
    id: &CheckpointIdentity<'_>,
) -> std::result::Result<Vec<RngState>, CheckpointMismatch> {
    let dropout_rng = read_rngs(meta)?;
    if dropout_rng.len() > 1 && dropout_rng.len() != id.world_size && dropout_rng.iter().any(|s| *s != dropout_rng[0]) {
        return Err(CheckpointMismatch::DropoutRngWorld {
            written_world: dropout_rng.len(),
            world: id.world_size,
        });
    }
    Ok(dropout_rng)
}

/// The metadata entries of the buckets' grouping (see the module docs).
fn grouping_record(g: &BucketGrouping) -> Vec<(String, String)> {
    let names = serde_json::to_string(&g.buckets).expect("lists of strings serialize");
    vec![
        (BUCKETS_KEY.to_string(), names),
        (BUCKET_CAPS_KEY.to_string(), format!("{},{}", g.caps_mb.0, g.caps_mb.1)),
        (BUCKET_GENERATION_KEY.to_string(), g.generation.to_string()),
    ]
}

/// The buckets' grouping the metadata records, if any (a checkpoint written before DDP
/// regrouped its buckets, or under a policy that fixes them, records none).
fn read_grouping(meta: &HashMap<String, String>) -> std::result::Result<Option<BucketGrouping>, CheckpointMismatch> {
    let Some(names) = meta.get(BUCKETS_KEY) else {
        return Ok(None);
    };
    let bad = |what: &str| CheckpointMismatch::BucketGrouping(format!("its {what} cannot be read"));
    let buckets: Vec<Vec<String>> = serde_json::from_str(names).map_err(|_| bad(BUCKETS_KEY))?;
    let caps_mb = meta
        .get(BUCKET_CAPS_KEY)
        .and_then(|c| c.split_once(','))
        .and_then(|(cap, first)| Some((cap.parse().ok()?, first.parse().ok()?)))
        .ok_or_else(|| bad(BUCKET_CAPS_KEY))?;
    let generation = meta
        .get(BUCKET_GENERATION_KEY)
        .and_then(|g| g.parse().ok())
        .ok_or_else(|| bad(BUCKET_GENERATION_KEY))?;
    Ok(Some(BucketGrouping {
        buckets,
        caps_mb,
        generation,
    }))
}

/// The autotuner's progress the metadata records, if any (see the module docs).
fn read_autotune(meta: &HashMap<String, String>) -> std::result::Result<Option<AutotuneProgress>, CheckpointMismatch> {
    let read = |key: &str| -> std::result::Result<Option<usize>, CheckpointMismatch> {
        meta.get(key)
            .map(|v| {
                v.parse()
                    .map_err(|_| CheckpointMismatch::BucketGrouping(format!("its {key} cannot be read")))
            })
            .transpose()
    };
    Ok(match (read(AUTOTUNE_CHECKS_KEY)?, read(AUTOTUNE_SINCE_CHECK_KEY)?) {
        (Some(checks), Some(since_check)) => Some(AutotuneProgress { checks, since_check }),
        _ => None,
    })
}

/// The data order must be the one the checkpoint was written with (in order when it records
/// none); a sampled run's position is per rank, so it resumes on as many ranks only. Returns
/// the recorded position.
fn check_data_order(
    meta: &std::collections::HashMap<String, String>,
    id: &CheckpointIdentity<'_>,
) -> std::result::Result<Option<SamplerPosition>, CheckpointMismatch> {
    const IN_ORDER: &str = "rows in order";
    let written = meta.get("data_order").map(String::as_str).unwrap_or(IN_ORDER);
    let this_run = id.data_order.as_deref().unwrap_or(IN_ORDER);
    if written != this_run {
        return Err(CheckpointMismatch::Written {
            what: "data order",
            written: written.to_string(),
            this_run: this_run.to_string(),
        });
    }
    if id.data_order.is_none() {
        return Ok(None);
    }
    let written_world = meta.get(WORLD_SIZE_KEY).cloned().unwrap_or_default();
    if written_world != id.world_size.to_string() {
        return Err(CheckpointMismatch::SampledWorldSize {
            written: written_world,
            this_run: id.world_size,
        });
    }
    let field = |k: &str| meta.get(k).and_then(|v| v.parse::<u64>().ok());
    match (field("sampler_epoch"), field("sampler_index")) {
        (Some(epoch), Some(index)) => Ok(Some(SamplerPosition {
            epoch,
            index: index as usize,
        })),
        _ => Err(CheckpointMismatch::NoSamplerPosition),
    }
}

/// A checkpoint written under ZeRO resumes under the same stage, on any number of ranks (it
/// holds the parameters and the optimizer state whole: each rank cuts its shards again on
/// load), and one written without ZeRO (or before checkpoints recorded it) only without ZeRO.
fn check_sharding(
    meta: &std::collections::HashMap<String, String>,
    id: &CheckpointIdentity<'_>,
) -> std::result::Result<(), CheckpointMismatch> {
    let zero: u8 = meta.get("zero").and_then(|z| z.parse().ok()).unwrap_or(0);
    if zero != id.layout.record() {
        return Err(CheckpointMismatch::Sharding {
            written_stage: zero,
            stage: id.layout.record(),
        });
    }
    Ok(())
}
