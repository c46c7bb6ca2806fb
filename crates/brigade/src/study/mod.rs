//! A study of reducer policies: at a target world size and link, which policy reaches a target
//! loss soonest? Each policy trains at the target world size on thread ranks (the losses are
//! real; the same configuration, data, seed and initial weights for every policy), its steps
//! are profiled, and the overlap model predicts its step on each target link, and from the same
//! profiles at other world sizes ([`crate::ddp::overlap`]). Per policy the study reports its
//! losses, the steps and predicted seconds to each target loss, the bytes it sent per step, and
//! the prediction's error band: its own profiles replayed on the link they were recorded on,
//! against the steps they measured. With [`StudyConfig::tensorboard`] each policy's run writes
//! its scalars as TensorBoard event files, one run directory per policy
//! ([`crate::tensorboard`]).
//!
//! ```no_run
//! use brigade::launch::{net_model, LaunchConfig};
//! use brigade::models::{Dataset, Mlp, MlpConfig};
//! use brigade::policies::Registry;
//! use brigade::study::{study, StudyConfig};
//! use brigade::{OptimizerConfig, TrainConfig};
//!
//! let sgd = OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, weight_decay: 0.0 };
//! let cfg = TrainConfig::new(40, 32, sgd);
//! let sc = StudyConfig::new(vec![net_model(1.0, 20.0)], vec![0.5]);
//! let policies = ["allreduce".to_string(), "fp16".to_string()];
//! let studied = study(
//!     &LaunchConfig::threads(2),
//!     &cfg,
//!     &Registry::new(),
//!     &policies,
//!     &sc,
//!     |_world| Dataset::teacher(4096, 16, 4, 0).map_err(Into::into),
//!     |_ctx| Ok(Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 4]), 0)?)),
//! )?;
//! for r in &studied.policies {
//!     println!("{}: {:?}", r.policy, r.predictions[0].reached);
//! }
//! // a policy that failed while it trained stopped the study after the ones above
//! if let Some(e) = studied.stopped {
//!     return Err(e);
//! }
//! # Ok::<(), brigade::Error>(())
//! ```

mod predict;

use std::path::PathBuf;
use std::sync::Arc;

use brigade_comm::NetModel;
use brigade_models::Model;
use brigade_policies::{PolicySpec, Registry};
use serde::Serialize;

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::launch::{LaunchConfig, RankContext};
use crate::outcome::TrainOutcome;
use crate::policy::Registered;
use crate::source::DataSource;
use crate::tensorboard::{predicted_ms_tag, run_dir, TensorBoard};

pub use predict::{reach, OwnBand};

/// What a study predicts for, beside the training configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct StudyConfig {
    /// The links to predict each policy's step on (at least one).
    pub links: Vec<NetModel>,
    /// World sizes to predict the step at beside the trained one (from the same profiles; the
    /// losses are the trained world's, so time to a target is given at the trained world only).
    pub other_worlds: Vec<usize>,
    /// The target losses.
    pub targets: Vec<f64>,
    /// Steps at the start that are not profiled (the first steps build the buckets and warm
    /// the caches).
    pub warmup: usize,
    /// A TensorBoard log directory: each policy's run writes its scalars in a directory of its
    /// own there, named by its spec ([`crate::tensorboard::run_dir`]), so that `tensorboard
    /// --logdir` draws one curve per policy: every step's [`crate::tensorboard::step_scalars`]
    /// as the run goes, then at every step its predicted step on each link at the trained world
    /// ([`crate::tensorboard::predicted_ms_tag`]). `None`: none are written.
    pub tensorboard: Option<PathBuf>,
}

impl StudyConfig {
    /// A study of `targets` on `links`, at the trained world size alone, two warm-up steps.
    pub fn new(links: Vec<NetModel>, targets: Vec<f64>) -> StudyConfig {
        StudyConfig {
            links,
            other_worlds: vec![],
            targets,
            warmup: 2,
            tensorboard: None,
        }
    }
}

/// A policy's predicted step at one world size on one link.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Ranks.
    pub world_size: usize,
    /// The link's bandwidth, in Gb/s.
    pub net_gbps: f64,
    /// Its latency per message, in µs.
    pub net_latency_us: f64,
    /// The predicted step, in seconds (the mean over the profiled steps' replays); `None`
    /// when the overlap model cannot cost the policy (a user policy without a wire model).
    pub step_s: Option<f64>,
    /// Each target loss reached at this prediction (the trained world only; empty at others).
    pub reached: Vec<Reached>,
}

/// When a run first reached a target loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Reached {
    /// The target loss.
    pub target: f64,
    /// Steps run up to and including the first whose loss is at most the target; `None`: never.
    pub steps: Option<usize>,
    /// Those steps at the predicted step time, in seconds.
    pub seconds: Option<f64>,
}

/// One policy's study.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyStudy {
    /// The policy (its spec).
    pub policy: String,
    /// The world size it trained at: its losses, and so the steps to each target, are this
    /// world's (at the other worlds of `predictions` only the step is predicted).
    pub world_size: usize,
    /// The loss of each step (the global mean over the ranks, before its update), up to the
    /// first that was not finite.
    pub losses: Vec<f64>,
    /// Mean payload bytes rank 0 handed to its collectives per step.
    pub payload_bytes_per_step: f64,
    /// Mean bytes rank 0 sent per step under the ring algorithms.
    pub wire_bytes_per_step: f64,
    /// The profiled steps' measured step, in seconds: their mean, as the time to a target
    /// counts every step (`None`: no step was profiled, the run diverged before).
    pub measured_step_s: Option<f64>,
    /// The prediction's error band on its own profiles (`None`: not predicted).
    pub own_band: Option<OwnBand>,
    /// The predictions: the trained world on every link, then each other world on every link.
    /// A diverged run reaches no target.
    pub predictions: Vec<Prediction>,
    /// The step whose loss or update was not finite: the run diverged there, and its losses are
    /// those of the steps before it (`None`: it ran every step).
    pub diverged_at: Option<usize>,
    /// What the policy says about its run (e.g. that PowerSGD never compressed, its
    /// [`TrainOutcome::policy_diagnostics`]), then what the study could not predict for it and
    /// why (the overlap model's words): `not predicted: ...` when its step was not, `no error
    /// band: ...` when only its own profiles could not be replayed; joined by `; `, empty when
    /// there is nothing to say.
    pub note: String,
    /// The first write of its TensorBoard events that failed ([`StudyConfig::tensorboard`]),
    /// in words: the events before it were written, and the run went on. Not serialized.
    #[serde(skip)]
    pub tensorboard_failure: Option<String>,
}

/// What [`study()`] ran: the studies of the policies that finished, in the order given, and
/// the error that stopped the study early, if one did (a policy that failed while it trained:
/// [`Error::StudyPolicyFailed`]). A stop request ends it with fewer policies and no error.
#[derive(Debug)]
pub struct Studied {
    /// The policies that finished.
    pub policies: Vec<PolicyStudy>,
    /// Why the study stopped before its last policy.
    pub stopped: Option<Error>,
}

/// Trains every policy of `policies` (specs: the built-ins' and those `registry` registers) in
/// turn under `cfg` on the ranks `launch` starts, each from the same data (`data(world_size)`),
/// model (`model(ctx)`) and seed, profiling its steps after `sc.warmup`, and predicts each on
/// `sc`'s links and worlds, writing each run's TensorBoard events where `sc` says (a write
/// that fails is kept in [`PolicyStudy::tensorboard_failure`], and the study goes on). A run
/// that diverges is kept, with [`PolicyStudy::diverged_at`], and the study goes on. A run that a
/// stop request of `cfg`'s observer stops ends the study: the policies that finished before it
/// are returned (fewer than `policies`). A bad spec or a policy listed twice is refused before
/// anything runs; so is a policy that cannot be built on the model and ranks (e.g. more
/// fragments than parameters: [`Error::StudyPolicyRefused`]), as every policy is built once,
/// for no step, before the first trains. A run that fails while it trains (a collective that
/// times out) stops the study there, the studies of the policies before it returned with
/// [`Studied::stopped`] an [`Error::StudyPolicyFailed`] naming it; the later policies do not run.
pub fn study<D: DataSource>(
    launch: &LaunchConfig,
    cfg: &TrainConfig,
    registry: &Registry,
    policies: &[String],
    sc: &StudyConfig,
    data: impl Fn(usize) -> Result<D>,
    model: impl Fn(&RankContext) -> Result<Box<dyn Model>> + Sync,
) -> Result<Studied> {
    check(cfg, policies, sc)?;
    let specs = policies
        .iter()
        .map(|p| registry.parse(p).map_err(Error::from))
        .collect::<Result<Vec<_>>>()?;
    // one policy twice would be one run twice, its TensorBoard events in one directory
    let names: Vec<String> = specs.iter().map(ToString::to_string).collect();
    if let Some((first, again)) = repeated(&names) {
        return Err(Error::Config(format!(
            "a study lists the policy {} twice (entries {first} and {again}): each policy is one run",
            names[again - 1]
        )));
    }
    // every policy built for no step first: one that cannot run here costs no policy's training
    build_each(launch, cfg, registry, &specs, &data, &model)?;
    let mut out = vec![];
    for spec in specs {
        let mut run = with_policy(cfg, &spec, registry);
        run.runtime.instrument.profile = true;
        run.runtime.instrument.profile_steps = Some(sc.warmup..cfg.recipe.steps);
        let board = sc
            .tensorboard
            .as_ref()
            .map(|dir| Arc::new(TensorBoard::new(run_dir(dir, &spec.to_string()))));
        if let Some(b) = &board {
            let theirs = run.runtime.instrument.observer.take();
            run.runtime.instrument.observer = Some(Arc::new((theirs, b.clone())));
        }
        let failed = |source: Error, finished: Vec<PolicyStudy>| Studied {
            stopped: Some(Error::StudyPolicyFailed {
                policy: spec.to_string(),
                finished: finished.len(),
                source: Box::new(source),
            }),
            policies: finished,
        };
        let mut report = match crate::fit(launch, &run, &data, &model) {
            Ok(r) => r,
            Err(e) => return Ok(failed(e, out)),
        };
        if report.outcome.interrupted {
            break;
        }
        if let Some(e) = report
            .outcome
            .stopped
            .take_if(|e| !matches!(e, Error::NonFinite { .. }))
        {
            return Ok(failed(e, out));
        }
        let mut s = of_run(spec.to_string(), &report.outcome, report.world_size, sc);
        if let Some(b) = &board {
            add_predictions(b, &report.outcome, &s);
            s.tensorboard_failure = b.take_failure().map(|e| e.to_string());
        }
        out.push(s);
    }
    Ok(Studied {
        policies: out,
        stopped: None,
    })
}

/// Builds every policy of `specs` for no step (each's ranks, model and policy, as `fit` would):
/// one that cannot be built on the model and ranks fails as [`Error::StudyPolicyRefused`].
fn build_each<D: DataSource>(
    launch: &LaunchConfig,
    cfg: &TrainConfig,
    registry: &Registry,
    specs: &[PolicySpec],
    data: impl Fn(usize) -> Result<D>,
    model: impl Fn(&RankContext) -> Result<Box<dyn Model>> + Sync,
) -> Result<()> {
    for spec in specs {
        let mut dry = with_policy(cfg, spec, registry);
        dry.recipe.steps = 0;
        dry.runtime.instrument.profile = false;
        dry.runtime.instrument.profile_steps = None;
        dry.runtime.instrument.observer = None;
        dry.runtime.checkpoint = crate::config::CheckpointConfig::default();
        if let Err(e) = crate::fit(launch, &dry, &data, &model) {
            return Err(Error::StudyPolicyRefused {
                policy: spec.to_string(),
                source: Box::new(e),
            });
        }
    }
    Ok(())
}

/// `cfg` with `spec` (of `registry`) as its reducer policy.
fn with_policy(cfg: &TrainConfig, spec: &PolicySpec, registry: &Registry) -> TrainConfig {
    let mut run = cfg.clone();
    let d = run
        .distributed
        .get_or_insert_with(|| crate::config::DistributedConfig::with_policy(spec.clone()));
    d.policy = Arc::new(Registered {
        spec: spec.clone(),
        registry: registry.clone(),
    });
    run
}

/// The first entry of `items` that repeats an earlier one, as the 1-based positions of both
/// (a list flag's entries are one run or row each: the CLI's `--policy` and `--precisions`).
pub fn repeated<T: PartialEq>(items: &[T]) -> Option<(usize, usize)> {
    let again = (1..items.len()).find(|&i| items[..i].contains(&items[i]))?;
    let first = items.iter().position(|x| *x == items[again])?;
    Some((first + 1, again + 1))
}

/// The predicted step on each link at the trained world, in milliseconds, at every step the run
/// ran (one tag per link: a flat line beside the measured `train/step_ms`).
fn add_predictions(board: &TensorBoard, outcome: &TrainOutcome, s: &PolicyStudy) {
    let links: Vec<(String, f32)> = s
        .predictions
        .iter()
        .filter(|p| p.world_size == s.world_size)
        .filter_map(|p| Some((predicted_ms_tag(p.net_gbps, p.net_latency_us), (1e3 * p.step_s?) as f32)))
        .collect();
    if links.is_empty() {
        return;
    }
    let scalars: Vec<(&str, f32)> = links.iter().map(|(tag, v)| (tag.as_str(), *v)).collect();
    for r in &outcome.steps {
        board.add_scalars(r.step as u64, &scalars);
    }
}

/// The study of one policy's finished run on `world` ranks. One that diverged (its
/// [`TrainOutcome::stopped`] a non-finite loss or update, or a loss that is not finite in a run
/// that allows them) reaches no target, and keeps the losses before the first that was not finite.
pub fn of_run(policy: String, outcome: &TrainOutcome, world: usize, sc: &StudyConfig) -> PolicyStudy {
    let mut losses = outcome.losses();
    let first_bad = losses.iter().position(|l| !l.is_finite());
    let diverged_at = match &outcome.stopped {
        Some(Error::NonFinite { step, .. }) => Some(*step),
        _ => first_bad.map(|i| outcome.first_step + i),
    };
    losses.truncate(first_bad.unwrap_or(losses.len()));
    let sent = outcome.sent();
    let per_step = |f: fn(&brigade_comm::CommBytes) -> f64| sent.iter().map(f).sum::<f64>() / sent.len().max(1) as f64;
    let reaching: &[f64] = if diverged_at.is_some() { &[] } else { &losses };
    let ran_plainly = (outcome.policy_diagnostics.iter()).any(|d| d.code == brigade_policies::NEVER_COMPRESSED);
    let predicted = match ran_plainly {
        true => predict::predict(&as_plain_all_reduce(&outcome.profiles), world, reaching, sc),
        false => predict::predict(&outcome.profiles, world, reaching, sc),
    };
    let priced_plainly = ran_plainly.then(|| "its steps are predicted as the plain all-reduce it ran".to_string());
    PolicyStudy {
        policy,
        world_size: world,
        payload_bytes_per_step: per_step(|b| b.payload_bytes as f64),
        wire_bytes_per_step: per_step(|b| b.wire_bytes),
        measured_step_s: predicted.measured_step_s,
        own_band: predicted.own_band,
        predictions: predicted.predictions,
        note: outcome
            .policy_diagnostics
            .iter()
            .map(|d| d.message.clone())
            .chain(priced_plainly)
            .chain(Some(predicted.note).filter(|n| !n.is_empty()))
            .collect::<Vec<_>>()
            .join("; "),
        losses,
        diverged_at,
        tensorboard_failure: None,
    }
}

/// `profiles` of a low-rank policy whose run never compressed, each recorded as the plain f32
/// all-reduce it ran: the overlap model prices them so at every world size, the trained one
/// included (on one rank the recorded buckets send nothing, so they cannot tell it apart).
fn as_plain_all_reduce(profiles: &[brigade_ddp::overlap::StepProfile]) -> Vec<brigade_ddp::overlap::StepProfile> {
    use brigade_ddp::policy::WireModel;
    let mut out = profiles.to_vec();
    for w in out
        .iter_mut()
        .filter_map(|p| p.policy.as_mut())
        .filter_map(|p| p.wire.as_mut())
    {
        if matches!(w, WireModel::LowRank { .. }) {
            *w = WireModel::AllReduce { bytes_per_element: 4.0 };
        }
    }
    out
}

/// One line naming what is wrong with a study's request: what [`study`] checks before its first
/// policy trains, for a caller that prepares outputs first and undoes them when it fails.
pub fn check(cfg: &TrainConfig, policies: &[String], sc: &StudyConfig) -> Result<()> {
    let bad = |m: String| Err(Error::Config(m));
    if policies.is_empty() {
        return bad("a study needs at least one policy".into());
    }
    if sc.links.is_empty() {
        return bad("a study needs at least one link to predict for".into());
    }
    if let Some(l) = sc
        .links
        .iter()
        .find(|l| !(l.bandwidth_bytes_per_s > 0.0 && l.bandwidth_bytes_per_s.is_finite()))
    {
        return bad(format!(
            "a link's bandwidth must be positive and finite, got {} B/s",
            l.bandwidth_bytes_per_s
        ));
    }
    if let Some(t) = sc.targets.iter().find(|t| !t.is_finite()) {
        return bad(format!("a target loss must be a finite number, got {t}"));
    }
    if sc.other_worlds.contains(&0) {
        return bad("a world size to predict at must be at least 1".into());
    }
    if cfg.recipe.steps <= sc.warmup {
        return bad(format!(
            "a study profiles the steps after its {} warm-up steps: give it more than {} steps",
            sc.warmup, sc.warmup
        ));
    }
    Ok(())
}
