//! Checkpoints: parameters and optimizer state with the step they were taken after, in one
//! safetensors file (written atomically), and loading them back for `--resume`.

use std::path::Path;

use brigade_autograd::Optimizer;
use brigade_models::{load_params_from_tensors, load_safetensors_with_metadata, save_safetensors, Model};
use brigade_policies::ZeroStage;
use brigade_tensor::Tensor;

use crate::error::{Error, Result};

const CHECKPOINT_FORMAT: &str = "brigade-checkpoint-v1";

/// What a checkpoint records besides the tensors, and a resume checks: the model's name, the
/// optimizer's name, the seed (it chooses the built-in data) and the data's fingerprint.
pub struct CheckpointIdentity<'a> {
    /// The model's name (`mlp`, `gpt`, or a user's).
    pub model: &'a str,
    /// The optimizer's name (`sgd`, `adamw`).
    pub optimizer: &'a str,
    /// `--seed`.
    pub seed: u64,
    /// The training data's fingerprint ([`crate::data::DataSource::fingerprint`]; `None`:
    /// neither recorded nor checked).
    pub data: Option<String>,
    /// The ZeRO stage (`--zero`): a checkpoint under ZeRO resumes only with the same stage and
    /// world size, and a plain one only without ZeRO.
    pub zero: ZeroStage,
    /// The number of ranks.
    pub world_size: usize,
}

/// Writes `model`'s parameters and `opt`'s state after `step` steps to `path`, with `id`.
pub fn save_checkpoint(
    path: &Path,
    id: &CheckpointIdentity<'_>,
    model: &dyn Model,
    opt: &dyn Optimizer,
    step: usize,
) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> = model
        .params()
        .named_values()
        .into_iter()
        .map(|(n, t)| (format!("model.{n}"), t))
        .collect();
    tensors.extend(opt.state()?.into_iter().map(|(n, t)| (format!("optim.{n}"), t)));
    let meta = [
        ("format", CHECKPOINT_FORMAT.to_string()),
        ("step", step.to_string()),
        ("model", id.model.to_string()),
        ("optimizer", id.optimizer.to_string()),
        ("seed", id.seed.to_string()),
        ("zero", id.zero.level().to_string()),
        ("world_size", id.world_size.to_string()),
    ]
    .into_iter()
    .chain(id.data.clone().map(|fp| ("data", fp)))
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    save_safetensors(path, &tensors, Some(meta))?;
    Ok(())
}

/// Loads a checkpoint into the model and optimizer after checking it was written for `id`;
/// returns the step to continue from.
pub fn load_checkpoint(
    path: &Path,
    id: &CheckpointIdentity<'_>,
    model: &dyn Model,
    opt: &mut dyn Optimizer,
) -> Result<usize> {
    let err = |msg: String| Error::Checkpoint {
        path: path.display().to_string(),
        msg,
    };
    let (tensors, meta) = load_safetensors_with_metadata(path)?;
    if meta.get("format").map(String::as_str) != Some(CHECKPOINT_FORMAT) {
        return Err(err("not a brigade checkpoint (written by --checkpoint)".into()));
    }
    for (key, want) in [("model", id.model), ("optimizer", id.optimizer)] {
        let got = meta.get(key).cloned().unwrap_or_default();
        if got != want {
            return Err(err(format!("it was written for {key} '{got}', this run uses '{want}'")));
        }
    }
    // the seed chooses the built-in data; the fingerprint tells any data apart (older
    // checkpoints have neither)
    let seed = id.seed.to_string();
    for (key, flag, want) in [
        ("seed", "--seed", Some(seed.as_str())),
        ("data", "data", id.data.as_deref()),
    ] {
        let Some(want) = want else { continue };
        if let Some(got) = meta.get(key).filter(|got| *got != want) {
            return Err(err(format!(
                "it was written with {flag} {got}, this run has {flag} {want}: resume with what it was written with"
            )));
        }
    }
    check_sharding(&meta, id).map_err(err)?;
    brigade_models::check_finite(path, &tensors)?;
    let step: usize = meta
        .get("step")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| err("no step recorded".into()))?;
    let strip = |prefix: &str| -> Vec<(String, Tensor)> {
        tensors
            .iter()
            .filter_map(|(n, t)| n.strip_prefix(prefix).map(|n| (n.to_string(), t.clone())))
            .collect()
    };
    load_params_from_tensors(model.params(), &strip("model.")).map_err(|e| e.at_path(path))?;
    opt.load_state(&strip("optim."))?;
    Ok(step)
}

/// A checkpoint written under ZeRO resumes with the same `--zero` stage and world size only, and
/// one written without ZeRO (or before checkpoints recorded it) only without ZeRO.
fn check_sharding(
    meta: &std::collections::HashMap<String, String>,
    id: &CheckpointIdentity<'_>,
) -> std::result::Result<(), String> {
    let zero: u8 = meta.get("zero").and_then(|z| z.parse().ok()).unwrap_or(0);
    let world: Option<usize> = meta.get("world_size").and_then(|w| w.parse().ok());
    if zero == 0 && id.zero == ZeroStage::Off {
        return Ok(());
    }
    if zero != id.zero.level() || world != Some(id.world_size) {
        let written = match world {
            Some(w) => format!("--zero {zero} on {w} ranks"),
            None => format!("--zero {zero}"),
        };
        return Err(format!(
            "it was written with {written}, this run has --zero {} on {} ranks: a ZeRO checkpoint resumes with the stage and world size it was written with",
            id.zero.level(),
            id.world_size
        ));
    }
    Ok(())
}
