//! What a checkpoint records of the training recipe (the schedule and the optimizer's
//! hyperparameters, as key-value metadata), so that a resume either continues the same run or
//! says what it changed.
//!
//! Resume rules (checked by [`check_resume`]):
//! - the optimizer kind and the schedule (its kind, warmup, `T`, floor, step size and factor)
//!   must be the checkpoint's: another is refused in one line
//!   ([`CheckpointMismatch::Written`],
//!   [`CheckpointMismatch::Schedule`]);
//! - a changed hyperparameter (`lr`, `momentum`, `weight_decay`, `betas`, `eps`,
//!   `clip_grad_norm`) is this run's to choose: the run uses it, and the change is reported
//!   ([`HyperparameterChange`], told to [`TrainObserver::resumed`](crate::observe::TrainObserver::resumed));
//! - a schedule whose `T` was left to default (`decay_steps: None`) takes the checkpoint's `T`,
//!   so a resume that extends the run's steps continues the same curve (and holds `min_lr`
//!   past `T`, which [`defaulted_t_note`] says);
//! - the rows a step reads over all ranks (`world_size * batch_size * accum`, from
//!   [`ROWS_PER_STEP_KEY`] and the world size the checkpoint records) must be the checkpoint's
//!   where the data is read in order, and under a join mode the ranks and the rows per rank
//!   both: another would continue at another row ([`CheckpointMismatch::RowsPerStep`]);
//! - the activation checkpointing ([`ACTIVATION_CHECKPOINTING_KEY`]) may differ: it changes
//!   memory, not results, and the change is reported as a [`HyperparameterChange`];
//! - the precision ([`PRECISION_KEY`]) and the reduce dtype ([`REDUCE_DTYPE_KEY`]) may differ
//!   (the checkpoint holds f32 master weights and optimizer state whatever its precision): the
//!   change is reported, and what becomes of fp16's loss scale said ([`loss_scale_note`]);
//! - a sampled run resumed at another batch ([`sampled_batch_note`]) and a dropout run resumed
//!   on another number of ranks ([`dropout_world_note`]) continue, and are told how their steps
//!   differ;
//! - other bucket caps than the checkpoint's regroup its buckets, and a policy's state with them
//!   ([`regrouped_buckets_note`]): the run continues, told it is not the uninterrupted run's bit
//!   for bit.

use std::collections::HashMap;

use brigade_autograd::LrSchedule;

use crate::checkpoint::{DistributedState, WORLD_SIZE_KEY};
use crate::config::{OptimizerConfig, TrainConfig};
use crate::error::{CheckpointMismatch, Error};
use crate::field::{BUCKET_CAP, FIRST_BUCKET_CAP};
use crate::recipe::{schedule_record, HyperparameterChange};

/// `T` of a recorded schedule, if it has one.
fn recorded_t(record: &str) -> Option<u64> {
    record
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("T="))
        .and_then(|t| t.parse().ok())
}

/// Checkpoint metadata key of the schedule.
const SCHEDULE_KEY: &str = "schedule";
/// Checkpoint metadata key of the rows a step reads per rank (`batch_size * accum`).
pub const ROWS_PER_STEP_KEY: &str = "rows_per_step";
/// Checkpoint metadata key of the activation checkpointing (every N-th block, 0: none).
pub const ACTIVATION_CHECKPOINTING_KEY: &str = "activation_checkpointing";
/// Checkpoint metadata key of the run's precision (the parameters' dtype: `f32`, `bf16`, `fp16`).
pub const PRECISION_KEY: &str = "precision";
/// Checkpoint metadata key of the dtype the gradients are reduced in.
pub const REDUCE_DTYPE_KEY: &str = "reduce_dtype";
/// Prefix of the hyperparameters' metadata keys.
const HP_PREFIX: &str = "hp.";

/// The optimizer's hyperparameters and the clipping, as `(name, value)`.
pub fn hyperparameters(opt: &OptimizerConfig, clip_grad_norm: Option<f64>) -> Vec<(&'static str, String)> {
    let mut hp = match *opt {
        OptimizerConfig::Sgd {
            lr,
            momentum,
            weight_decay,
        } => vec![
            ("lr", lr.to_string()),
            ("momentum", momentum.to_string()),
            ("weight_decay", weight_decay.to_string()),
        ],
        OptimizerConfig::AdamW {
            lr,
            betas,
            eps,
            weight_decay,
        } => vec![
            ("lr", lr.to_string()),
            ("betas", format!("{},{}", betas.0, betas.1)),
            ("eps", eps.to_string()),
            ("weight_decay", weight_decay.to_string()),
        ],
    };
    hp.push((
        "clip_grad_norm",
        clip_grad_norm.map_or_else(|| "none".to_string(), |c| c.to_string()),
    ));
    hp
}

/// What a checkpoint records of the recipe: the schedule, the rows a step reads per rank and
/// every hyperparameter.
pub(crate) fn recipe_metadata(cfg: &TrainConfig, schedule: &LrSchedule) -> Vec<(String, String)> {
    [
        (SCHEDULE_KEY.to_string(), schedule_record(schedule)),
        (ROWS_PER_STEP_KEY.to_string(), cfg.rows_per_step().to_string()),
        (
            ACTIVATION_CHECKPOINTING_KEY.to_string(),
            cfg.model.activation_checkpointing.to_string(),
        ),
        (PRECISION_KEY.to_string(), cfg.recipe.precision.name().to_string()),
        (REDUCE_DTYPE_KEY.to_string(), reduce_dtype_name(cfg).to_string()),
    ]
    .into_iter()
    .chain(
        hyperparameters(&cfg.recipe.optimizer, cfg.recipe.clip_grad_norm)
            .into_iter()
            .map(|(k, v)| (format!("{HP_PREFIX}{k}"), v)),
    )
    .collect()
}

/// The schedule of a run that resumes a checkpoint with metadata `meta` (or starts afresh:
/// `meta` is `None`), and the hyperparameters it changed. A checkpoint written before recipes
/// were recorded is resumed with this run's recipe, unchecked.
pub fn check_resume(
    cfg: &TrainConfig,
    meta: Option<&HashMap<String, String>>,
) -> std::result::Result<(LrSchedule, Vec<HyperparameterChange>), ResumeError> {
    let lr = cfg.recipe.optimizer.lr();
    let written = meta.and_then(|m| m.get(SCHEDULE_KEY));
    let default_t = written.and_then(|w| recorded_t(w)).unwrap_or(cfg.recipe.steps as u64);
    let schedule = cfg.recipe.schedule.build(lr, default_t).map_err(ResumeError::Config)?;
    let Some(meta) = meta else {
        return Ok((schedule, vec![]));
    };
    if let Some(written) = written {
        let this_run = schedule_record(&schedule);
        if *written != this_run {
            return Err(ResumeError::Refused(CheckpointMismatch::Schedule {
                written: written.clone(),
                this_run,
            }));
        }
    }
    let changes = hyperparameters(&cfg.recipe.optimizer, cfg.recipe.clip_grad_norm)
        .into_iter()
        .filter_map(|(name, this_run)| {
            let written = meta.get(&format!("{HP_PREFIX}{name}"))?;
            (*written != this_run).then(|| HyperparameterChange {
                name: name.to_string(),
                written: written.clone(),
                this_run,
            })
        })
        .collect::<Vec<_>>();
    let changes = changes
        .into_iter()
        .chain(model_changes(meta.get("model_config"), cfg.model.config.as_deref()))
        .chain(recorded_change(
            meta,
            ACTIVATION_CHECKPOINTING_KEY,
            "model.activation_checkpointing",
            &cfg.model.activation_checkpointing.to_string(),
        ))
        .chain(recorded_change(
            meta,
            PRECISION_KEY,
            "precision",
            cfg.recipe.precision.name(),
        ))
        // the reduce dtype where it is not the precision's own on either side
        .chain(
            recorded_change(meta, REDUCE_DTYPE_KEY, "reduce_dtype", reduce_dtype_name(cfg))
                .filter(|c| meta.get(PRECISION_KEY) != Some(&c.written) || cfg.recipe.precision.name() != c.this_run),
        )
        .collect();
    Ok((schedule, changes))
}

/// Refuses a resume that reads another number of rows a step than the checkpoint's run
/// (`meta`) when the data's position follows from the step (`position_from_step`: data in
/// order, or under a join mode): it would continue at another row, and a join run's ranks
/// would join at other steps. In order, step `s` reads the rows from `s` times the rows of a
/// step over all ranks (`world_size * batch_size * accum`), so that product must be the
/// checkpoint's (the split among the ranks may change); under a join mode each rank reads its
/// own file, so the ranks and the rows per rank must both be the checkpoint's. A checkpoint
/// that records no number is not checked (and one without a world size is compared per rank).
pub fn check_rows_per_step(
    cfg: &TrainConfig,
    meta: &HashMap<String, String>,
    position_from_step: bool,
    world_size: usize,
) -> std::result::Result<(), CheckpointMismatch> {
    let this_run = cfg.rows_per_step();
    let Some(written) = meta.get(ROWS_PER_STEP_KEY).and_then(|w| w.parse::<usize>().ok()) else {
        return Ok(());
    };
    let written_world = meta
        .get(WORLD_SIZE_KEY)
        .and_then(|w| w.parse::<usize>().ok())
        .unwrap_or(world_size);
    let same = if cfg.data.join.is_some() {
        written == this_run && written_world == world_size
    } else {
        written * written_world == this_run * world_size
    };
    if position_from_step && !same {
        return Err(CheckpointMismatch::RowsPerStep {
            written,
            written_world,
            this_run,
            world: world_size,
        });
    }
    Ok(())
}

/// What to say when a resumed run goes past the `T` its schedule took from the checkpoint
/// (`T` left to default, `decay_steps: None`): from `T` on the learning rate holds `min_lr`.
pub fn defaulted_t_note(cfg: &TrainConfig, meta: &HashMap<String, String>) -> Option<String> {
    if cfg.recipe.schedule.decay_steps.is_some() {
        return None;
    }
    let record = meta.get(SCHEDULE_KEY)?;
    let t = recorded_t(record)?;
    let min_lr = record
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("min_lr="))
        .unwrap_or("0");
    (cfg.recipe.steps as u64 > t).then(|| {
        format!(
            "the schedule's T was left to default, so it is the checkpoint's T = {t} (its run's steps): \
             from step {t} to this run's end at step {} the learning rate holds min_lr {min_lr}; \
             a run that should decay over {} steps sets T ({} {}) from its start",
            cfg.recipe.steps,
            cfg.recipe.steps,
            crate::field::DECAY_STEPS,
            cfg.recipe.steps
        )
    })
}

/// A setting a resume may change, reported as `name` when the checkpoint's record under `key`
/// differs from `this_run`: the activation checkpointing (the gradients are the same), the
/// precision and the reduce dtype (the f32 master weights and the optimizer state carry over;
/// see [`loss_scale_note`]). A checkpoint that records none is not compared.
fn recorded_change(
    meta: &HashMap<String, String>,
    key: &str,
    name: &str,
    this_run: &str,
) -> Option<HyperparameterChange> {
    let written = meta.get(key)?;
    (written != this_run).then(|| HyperparameterChange {
        name: name.to_string(),
        written: written.clone(),
        this_run: this_run.to_string(),
    })
}

/// The name of the dtype the run reduces its gradients in (`f32`, `bf16`, `fp16`).
fn reduce_dtype_name(cfg: &TrainConfig) -> &'static str {
    brigade_autograd::MixedPrecision::uniform(cfg.recipe.precision.reduce_dtype).name()
}

/// What a resume under another precision does with fp16's loss scale (`written_scale`: the
/// checkpoint's, when it holds one): both fp16, it is kept (nothing to say); from fp16 to
/// another precision it is dropped (only fp16 scales its loss); from another precision to fp16
/// it starts afresh at [`brigade_autograd::scaler::INIT_SCALE`]. A checkpoint that records no
/// precision counts as fp16 when it holds a scale, and is not compared otherwise.
pub fn loss_scale_note(
    cfg: &TrainConfig,
    meta: &HashMap<String, String>,
    written_scale: Option<f64>,
) -> Option<String> {
    let written = match (meta.get(PRECISION_KEY), written_scale) {
        (Some(p), _) => p.as_str(),
        (None, Some(_)) => "fp16",
        (None, None) => return None,
    };
    let this_run = cfg.recipe.precision.name();
    match (written == "fp16", this_run == "fp16") {
        (true, false) => Some(format!(
            "the checkpoint's fp16 loss scale{} is dropped: only fp16 scales its loss",
            written_scale.map(|s| format!(" ({s})")).unwrap_or_default()
        )),
        (false, true) => Some(format!(
            "the loss scale starts afresh at {} (the checkpoint's {written} run scaled no loss)",
            brigade_autograd::scaler::INIT_SCALE
        )),
        _ => None,
    }
}

/// What a resume under other bucket caps than its checkpoint's does to a policy that keeps
/// state (`resumed`: the checkpoint's distributed state): the recorded buckets are regrouped
/// under this run's caps, and the state with them (error feedback, whatever the policy keeps
/// beside the buckets it reduces), so the run is not the uninterrupted run's bit for bit from
/// there. `None` under the recorded caps (a run that tunes the cap continues from them), without
/// a recorded grouping, or without policy state.
pub fn regrouped_buckets_note(cfg: &TrainConfig, resumed: &DistributedState) -> Option<String> {
    let (grouping, ddp) = (resumed.buckets.as_ref()?, cfg.ddp()?);
    let tuned_from_recorded = cfg.autotunes() && resumed.autotune.is_some_and(|p| p.checks > 0);
    let caps = (ddp.bucket_cap_mb, ddp.first_bucket_cap_mb);
    if resumed.policy.is_empty() || tuned_from_recorded || grouping.caps_mb == caps {
        return None;
    }
    let ((was, was_first), (now, now_first)) = (grouping.caps_mb, caps);
    Some(format!(
        "the checkpoint's buckets were grouped under {BUCKET_CAP} {was} and {FIRST_BUCKET_CAP} {was_first}; \
         this run's {BUCKET_CAP} {now} and {FIRST_BUCKET_CAP} {now_first} regroup them, and the policy's state \
         with them, so the run is not the uninterrupted run's bit for bit from here (resume under the \
         checkpoint's caps for that)"
    ))
}

/// What a sampled run (`--shuffle`) resumed at another number of rows a step per rank does:
/// the epoch's order goes on from the checkpoint's row, cut into other batches, so its steps
/// are neither the checkpoint's run's nor those of a run at this batch from step 0.
pub fn sampled_batch_note(cfg: &TrainConfig, meta: &HashMap<String, String>) -> Option<String> {
    if !matches!(cfg.data.order, crate::source::DataOrder::Sampled(_)) {
        return None;
    }
    let written: usize = meta.get(ROWS_PER_STEP_KEY)?.parse().ok()?;
    let this_run = cfg.rows_per_step();
    (written != this_run).then(|| {
        format!(
            "the shuffled rows go on from where the checkpoint's run stood, {this_run} a step per rank (batch size x \
             accum) where it read {written}: the steps from here group the rows otherwise than either run at one \
             batch size would"
        )
    })
}

/// What a resume of a dropout run on another number of ranks does: the ranks of the
/// checkpoint's run (`written_world` of them) shared one generator state, which every rank of
/// this run (`world`) continues, so a row draws the mask of its place in its rank's batch, which
/// moves with the ranks: the masks differ from the checkpoint's run's.
pub fn dropout_world_note(written_world: usize, world: usize) -> Option<String> {
    (written_world > 0 && written_world != world).then(|| {
        format!(
            "dropout: the checkpoint's run drew its masks on {written_world} ranks, this run on {world}: each rank \
             goes on from the same generator, but a row's mask follows its place in its rank's batch, so the \
             masks (and the steps) differ from those of a run on {written_world} ranks"
        )
    })
}

/// What differs between the model configuration a checkpoint recorded (`written`) and this
/// run's: one change per key of the JSON object (`model.dropout 0.1 -> 0.3`), or the whole
/// record where it is not an object. A change of shape never gets this far in use (the
/// parameters would not load); what is left is what a run may change, such as dropout.
fn model_changes(written: Option<&String>, this_run: Option<&str>) -> Vec<HyperparameterChange> {
    let (Some(written), Some(this_run)) = (written, this_run) else {
        return vec![];
    };
    if written == this_run {
        return vec![];
    }
    let object = |text: &str| match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => Some(map),
        _ => None,
    };
    match (object(written), object(this_run)) {
        (Some(old), Some(new)) => new
            .iter()
            .filter(|(k, v)| old.get(*k) != Some(*v))
            .map(|(k, v)| HyperparameterChange {
                name: format!("model.{k}"),
                written: old.get(k).map_or_else(|| "unset".to_string(), |w| w.to_string()),
                this_run: v.to_string(),
            })
            .collect(),
        _ => vec![HyperparameterChange {
            name: "model_config".to_string(),
            written: written.clone(),
            this_run: this_run.to_string(),
        }],
    }
}

/// Why [`check_resume`] failed: the run's own schedule is invalid, or the checkpoint's differs.
#[derive(Debug)]
pub enum ResumeError {
    /// This run's schedule cannot be built.
    Config(Error),
    /// The checkpoint was written under another schedule.
    Refused(CheckpointMismatch),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::{ScheduleConfig, ScheduleName};

    #[test]
    fn the_recorded_t_is_read_back() {
        let cfg = ScheduleConfig {
            name: ScheduleName::Cosine,
            warmup_steps: 2,
            min_lr: 1e-4,
            ..ScheduleConfig::default()
        };
        let s = cfg.build(1e-3, 10).unwrap();
        assert_eq!(recorded_t(&schedule_record(&s)), Some(10));
    }

    #[test]
    fn a_changed_dropout_is_reported_and_an_unchanged_model_is_not() {
        let written = r#"{"widths":[4,8,2],"dropout":0.1}"#.to_string();
        let changes = model_changes(Some(&written), Some(r#"{"widths":[4,8,2],"dropout":0.3}"#));
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].to_string(), "model.dropout 0.1 -> 0.3");
        assert!(model_changes(Some(&written), Some(&written)).is_empty());
        // a checkpoint from before dropout was recorded: the new key is reported as unset
        let old = r#"{"widths":[4,8,2]}"#.to_string();
        let changes = model_changes(Some(&old), Some(r#"{"widths":[4,8,2],"dropout":0.3}"#));
        assert_eq!(changes[0].to_string(), "model.dropout unset -> 0.3");
        // no record on either side: nothing to say
        assert!(model_changes(None, Some(&written)).is_empty());
    }
}
