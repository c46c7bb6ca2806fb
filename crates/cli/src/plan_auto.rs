//! `brigade train --plan auto`: before training, one short profiled run per policy family on
//! the run's own model, data and ranks (the calibration: each family's own compute measured,
//! its casts, PowerSGD's matmuls, ZeRO's shard steps and gathers), then the plan
//! ([`brigade::plan`], as `brigade plan` prints it) under `--memory-budget` less the memory
//! model's 10% accuracy, then the flags of the fastest configuration predicted to fit. The calibration runs are not part of the
//! training: they write nothing, and the training starts from step 0 under the choice, so its
//! losses are those of the chosen flags given directly. The choice is recorded in every
//! checkpoint (`user.plan`), and a `--resume` of such a checkpoint keeps it without
//! calibrating again.

use std::sync::Arc;

use brigade::observe::TrainObserver;
use brigade::plan::{plan, PlanQuery, DEFAULT_PLAN_CAPS_MB};
use brigade::policies::PolicySpec;
use brigade_ddp::overlap::StepProfile;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::args::{compact, ModelName, RunArgs};
use crate::bucket_cap::BucketCap;
use crate::error::{Error, Result};
use crate::run::{run_config, train_config, LateHeldOut, RunOptions};

/// `--plan`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlanMode {
    /// Calibrate, plan under --memory-budget, train under the fastest configuration that fits.
    Auto,
}

/// The checkpoint metadata key the choice is recorded under (written `user.plan`).
pub const PLAN_KEY: &str = "plan";

/// Steps of one calibration run: the first rebuilds the buckets in ready order, the next
/// settles the allocator, the rest ([`CALIBRATION_PROFILED`]) are profiled.
pub const CALIBRATION_STEPS: usize = 5;

/// The calibration steps profiled; the plan reads the median of them
/// ([`brigade::plan::median_step`]).
pub const CALIBRATION_PROFILED: std::ops::Range<usize> = 2..CALIBRATION_STEPS;

/// One calibration run: a policy, with or without activation checkpointing.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// The policy the run trains under.
    pub policy: PolicySpec,
    /// Every how many GPT blocks one is checkpointed (0: none).
    pub activation_checkpointing: usize,
}

/// What `--plan auto` chose: the flags it sets, and what the plan predicted for them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// The reducer policy (`zero2`, `powersgd:1@10`).
    pub policy: String,
    /// The bucket cap, in MiB.
    pub bucket_mb: f64,
    /// The first bucket's cap, in MiB.
    pub first_bucket_mb: f64,
    /// Every how many GPT blocks one is checkpointed (0: none).
    pub activation_checkpointing: usize,
    /// The predicted step, in ms.
    pub predicted_step_ms: f64,
    /// The predicted peak per rank, in bytes.
    pub predicted_peak_bytes: u64,
    /// The budget it is weighed against, in MiB: the one it was chosen under, or a resume's own.
    pub memory_budget_mb: f64,
    /// Candidates the plan weighed, and how many of them fit and were predicted.
    pub candidates: usize,
    /// Of them, those that fit the budget with a predicted step.
    pub eligible: usize,
    /// Calibration runs made for it (0: kept from the checkpoint it resumes).
    pub calibration_runs: usize,
}

impl Choice {
    /// The one line a run prints about its plan.
    pub fn line(&self) -> String {
        let how = if self.calibration_runs == 0 {
            "kept from the checkpoint it resumes".to_string()
        } else {
            format!(
                "{} of {} candidates fit and were predicted after {} calibration runs of {CALIBRATION_STEPS} steps (not part of this run)",
                self.eligible, self.candidates, self.calibration_runs
            )
        };
        // a kept plan is weighed against this run's budget, which may be another
        let margin = if within_margin(self.memory_budget_mb).is_ok_and(|b| self.predicted_peak_bytes <= b) {
            "the memory model's 10% margin kept"
        } else {
            "within it, but not by the memory model's 10% margin"
        };
        format!(
            "plan: --policy {} --bucket-mb {} --first-bucket-mb {}{}: predicted {:.2} ms a step, peak {} per rank of {} MB ({margin}); {how}",
            self.policy,
            compact(self.bucket_mb),
            compact(self.first_bucket_mb),
            if self.activation_checkpointing > 0 {
                format!(" --activation-checkpointing {}", self.activation_checkpointing)
            } else {
                String::new()
            },
            self.predicted_step_ms,
            crate::footprint::human(self.predicted_peak_bytes),
            compact(self.memory_budget_mb)
        )
    }

    /// Sets the flags it chose in `args`.
    fn apply(&self, args: &mut RunArgs) -> Result<()> {
        let d = &mut args.distributed;
        (d.comm_hook_alias, d.zero) = (None, 0);
        args.resolve_policy(Some(&self.policy))?;
        let d = &mut args.distributed;
        d.bucket_mb = vec![BucketCap::Mib(self.bucket_mb)];
        d.first_bucket_mb = self.first_bucket_mb;
        args.model.activation_checkpointing =
            (self.activation_checkpointing > 0).then_some(self.activation_checkpointing);
        Ok(())
    }
}

/// The calibration runs for `args`: every policy a plan weighs (the registry's), PowerSGD at
/// `--powersgd-rank` compressing from its first step (its steady state), and for the GPT
/// allreduce again with every block checkpointed (the recompute, measured once).
pub fn calibrations(args: &RunArgs) -> Vec<Calibration> {
    let plain = |policy| Calibration {
        policy,
        activation_checkpointing: 0,
    };
    let powersgd = PolicySpec::PowerSgd {
        rank: args.distributed.powersgd_rank,
        start_iter: 0,
    };
    // not the policies that train another run (top-k and sign compression with error
    // feedback, DiLoCo's local steps): their steps to a loss differ from the run's as asked,
    // which a plan by step time cannot weigh (`brigade study` does)
    let mut runs: Vec<Calibration> = brigade::policies::registry::plan_candidates(&[powersgd])
        .into_iter()
        .filter(|p| {
            !matches!(
                p,
                PolicySpec::TopK { .. } | PolicySpec::EfSign | PolicySpec::Diloco(_) | PolicySpec::StreamingDiloco(_)
            )
        })
        .map(plain)
        .collect();
    if args.model.model == ModelName::Gpt {
        runs.push(Calibration {
            policy: PolicySpec::AllReduce,
            activation_checkpointing: 1,
        });
    }
    runs
}

/// Checks that `--plan auto` can choose for `args`: it needs a budget and two ranks of the
/// thread backend, and it chooses the policy, the cap and the checkpointing itself.
fn check(args: &RunArgs, policy_given: bool) -> Result<f64> {
    let bad = |m: &str| Err(Error::Usage(format!("--plan auto {m}")));
    let Some(mb) = args.runtime.memory_budget else {
        return bad("plans under a memory budget: give --memory-budget MB (per rank)");
    };
    crate::footprint::budget_bytes(mb)?;
    // every other flag before any calibration runs (the plan, not one policy, answers to the
    // budget; each calibration checks its own policy's combinations)
    let mut flags = args.clone();
    flags.runtime.memory_budget = None;
    flags.validate_for(&PolicySpec::AllReduce)?;
    if args.distributed.world_size < 2 {
        return bad("chooses how ranks share the work: give --world-size 2 or more");
    }
    if args.distributed.backend != brigade::launch::CommBackend::Thread {
        return bad(
            "calibrates in this process, on the thread backend: under mpirun run `brigade plan` on profiles \
             (brigade train --profile) and give its flags",
        );
    }
    if policy_given || args.distributed.comm_hook_alias.is_some() || args.distributed.zero != 0 {
        return bad("chooses the reducer policy: drop --policy, --comm-hook and --zero");
    }
    if args.model.activation_checkpointing.is_some() {
        return bad("chooses activation checkpointing: drop --activation-checkpointing");
    }
    if args.bucket_auto() {
        return bad("chooses the bucket cap from --bucket-mb's list: give caps in MiB, not auto");
    }
    Ok(mb)
}

/// The caps the plan weighs: `--bucket-mb`'s list when it names two or more, else
/// [`DEFAULT_PLAN_CAPS_MB`].
fn caps(args: &RunArgs) -> Result<Vec<f64>> {
    let caps = args.fixed_caps()?;
    Ok(if caps.len() >= 2 {
        caps
    } else {
        DEFAULT_PLAN_CAPS_MB.to_vec()
    })
}

/// How an error says that the plan kept the memory model's margin.
const MARGIN_SAID: &str = " with the memory model's 10% margin";

/// The bytes a plan under `--memory-budget budget_mb` lets a configuration's predicted peak
/// reach: the budget less the memory model's accuracy
/// ([`brigade::plan::memory::ACCURACY`]), so that a run the model underestimates by as much
/// still fits.
fn within_margin(budget_mb: f64) -> Result<u64> {
    let budget = crate::footprint::budget_bytes(budget_mb)?;
    Ok((budget as f64 / (1.0 + brigade::plan::memory::ACCURACY)) as u64)
}

/// The calibrations worth running under a budget of `budget_mb` per rank, by the memory model
/// alone (before anything runs): a family none of whose candidates fits is not calibrated, but
/// allreduce always is (the other families' own compute is measured against it, and so is the
/// recompute of activation checkpointing). None fits at all: one error line, naming the
/// smallest configuration and its largest part.
fn fitting_calibrations(args: &RunArgs, budget_mb: f64) -> Result<Vec<Calibration>> {
    let budget = within_margin(budget_mb)?;
    let every: &[usize] = if args.model.model == ModelName::Gpt {
        &[0, 1]
    } else {
        &[0]
    };
    let rows = args.data.batch_size;
    let peak = |policy: &PolicySpec, ac: usize| args.predicted_peak(policy, ac, rows);
    let fits = |policies: &[PolicySpec]| {
        policies
            .iter()
            .any(|p| every.iter().any(|&ac| peak(p, ac).is_some_and(|p| p.total() <= budget)))
    };
    // the plain run and every policy that shards: what holds least
    let least: Vec<PolicySpec> = brigade::policies::registry::plan_candidates(&[])
        .into_iter()
        .filter(|p| *p == PolicySpec::AllReduce || p.shards_optimizer_state())
        .collect();
    if !fits(&least) {
        let smallest = least
            .iter()
            .flat_map(|z| every.iter().filter_map(move |&ac| Some((z, ac, peak(z, ac)?))))
            .min_by_key(|(_, _, p)| p.total());
        return Err(Error::Usage(match smallest {
            Some((z, ac, p)) => format!(
                "--plan auto: no configuration fits --memory-budget {} MB{MARGIN_SAID}: the smallest, {}{}, is predicted at {} per rank, the largest part {} ({})",
                compact(budget_mb),
                if *z == PolicySpec::AllReduce { "DDP".to_string() } else { z.to_string() },
                if ac > 0 { " with activation checkpointing" } else { "" },
                crate::footprint::human(p.total()),
                p.largest().0,
                crate::footprint::human(p.largest().1)
            ),
            None => "--plan auto: this run needs more than 2^64 bytes per rank under any configuration".to_string(),
        }));
    }
    Ok(calibrations(args)
        .into_iter()
        .filter(|c| match &c.policy {
            PolicySpec::AllReduce => true,
            other => fits(std::slice::from_ref(other)),
        })
        .collect())
}

/// Runs the calibrations `runs` of `args` ([`CALIBRATION_STEPS`] steps each, no files, no
/// progress bar) and returns the median profiled step of each that ran, with a note for each that could not (its
/// family's candidates then come out "not predicted"). `observer` watches each run: a signal
/// stops the calibration.
pub fn calibrate(
    args: &RunArgs,
    runs: &[Calibration],
    observer: Arc<dyn TrainObserver>,
) -> Result<(Vec<StepProfile>, Vec<String>)> {
    let mut short = args.clone();
    short.recipe.steps = CALIBRATION_STEPS;
    short.recipe.eval_every = None;
    // the plan, not each calibration run, answers to the budget
    short.runtime.memory_budget = None;
    let opts = RunOptions {
        profile: true,
        profile_steps: Some(CALIBRATION_PROFILED),
        observer: Some(observer),
        ..RunOptions::default()
    };
    let late = Arc::new(LateHeldOut::default());
    let (mut profiles, mut notes) = (vec![], vec![]);
    for c in runs {
        let c = c.clone();
        let mut run = short.clone();
        run.model.activation_checkpointing = (c.activation_checkpointing > 0).then_some(c.activation_checkpointing);
        let what = if c.activation_checkpointing > 0 {
            format!("{} with activation checkpointing", c.policy)
        } else {
            c.policy.to_string()
        };
        if let Err(e) = run.validate_for(&c.policy) {
            notes.push(format!("--plan auto: {what} was not calibrated: {e}"));
            continue;
        }
        let mut cfg = train_config(&run, &opts, &late)?;
        if let Some(d) = cfg.distributed.as_mut() {
            d.policy = Arc::new(c.policy.clone());
        }
        let mut report = match run_config(&run, &opts, &cfg, &late) {
            Ok(r) => r,
            Err(e) => {
                notes.push(format!("--plan auto: {what} was not calibrated: {e}"));
                continue;
            }
        };
        if report.outcome.interrupted {
            return Err(Error::Interrupted {
                step: 0,
                steps: args.recipe.steps,
            });
        }
        let steps = std::mem::take(&mut report.outcome.profiles);
        match (report.outcome.stopped.take(), brigade::plan::median_step(steps)) {
            (None, Some(p)) => profiles.push(p),
            (Some(e), _) => notes.push(format!("--plan auto: {what} was not calibrated: {e}")),
            (None, None) => notes.push(format!("--plan auto: {what} was not calibrated: no step was profiled")),
        }
    }
    Ok((profiles, notes))
}

/// The plan recorded in the checkpoint at `path`, weighed against this run's `budget_mb`.
fn recorded_choice(path: &std::path::Path, budget_mb: f64) -> Result<Choice> {
    let meta = brigade::checkpoint::load_model_tensors(path)?.metadata;
    let key = format!("{}{PLAN_KEY}", brigade::checkpoint::USER_PREFIX);
    let Some(text) = meta.get(&key) else {
        return Err(Error::Usage(format!(
            "--resume {}: the checkpoint records no plan (it was not written by a --plan auto run): \
             drop --plan auto and give the run's --policy, --bucket-mb and --activation-checkpointing",
            path.display()
        )));
    };
    let mut choice: Choice = serde_json::from_str(text).map_err(|e| {
        Error::Usage(format!(
            "--resume {}: its recorded plan is not readable: {e}",
            path.display()
        ))
    })?;
    // weighed against this run's budget, not the one it was chosen under
    choice.calibration_runs = 0;
    choice.memory_budget_mb = budget_mb;
    Ok(choice)
}

/// `--plan auto`: chooses the policy, the caps and the checkpointing of `args` (kept from the
/// checkpoint `resume` when it records a plan; else calibrated and planned), sets them in
/// `args`, and returns the choice.
pub fn choose(
    args: &mut RunArgs,
    policy_given: bool,
    resume: Option<&std::path::Path>,
    observer: Arc<dyn TrainObserver>,
) -> Result<Choice> {
    let budget_mb = check(args, policy_given)?;
    if let Some(path) = resume {
        let choice = recorded_choice(path, budget_mb)?;
        choice.apply(args)?;
        return Ok(choice);
    }
    let caps = caps(args)?;
    let runs = fitting_calibrations(args, budget_mb)?;
    let (profiles, notes) = calibrate(args, &runs, observer)?;
    for n in &notes {
        eprintln!("note: {n}");
    }
    if profiles.is_empty() {
        return Err(Error::Usage(
            "--plan auto: no calibration run finished, so there is nothing to plan from".into(),
        ));
    }
    let query = PlanQuery {
        bucket_caps_mb: caps,
        first_bucket_cap_mb: Some(args.distributed.first_bucket_mb),
        ..PlanQuery::new(within_margin(budget_mb)?, args.distributed.link())
    };
    let p = plan(&profiles, &query)?;
    let eligible = p.candidates.iter().filter(|c| c.is_eligible()).count();
    let Some(w) = p.winner() else {
        let smallest = p.candidates.iter().min_by_key(|c| c.memory.total());
        return Err(Error::Usage(match smallest {
            Some(c) => format!(
                "--plan auto: no configuration fits --memory-budget {} MB{MARGIN_SAID}: the smallest, {} with {}activation checkpointing, is predicted at {} per rank",
                compact(budget_mb),
                c.policy,
                if c.activation_checkpointing > 0 { "" } else { "no " },
                crate::footprint::human(c.memory.total())
            ),
            None => format!("--plan auto: the plan weighed no configuration under --memory-budget {} MB", compact(budget_mb)),
        }));
    };
    let step = w
        .step
        .as_ref()
        .map_err(|why| Error::Usage(format!("--plan auto: {why}")))?;
    // PowerSGD was calibrated compressing from its first step (its steady state); the run
    // keeps its own start iteration
    let policy = match w.policy {
        PolicySpec::PowerSgd { rank, .. } => PolicySpec::PowerSgd {
            rank,
            start_iter: args.distributed.powersgd_start_iter,
        },
        ref p => p.clone(),
    };
    let choice = Choice {
        policy: policy.to_string(),
        bucket_mb: w.bucket_cap_mb,
        first_bucket_mb: w.first_bucket_cap_mb,
        activation_checkpointing: w.activation_checkpointing,
        predicted_step_ms: step.step_s * 1e3,
        predicted_peak_bytes: w.memory.total(),
        memory_budget_mb: budget_mb,
        candidates: p.candidates.len(),
        eligible,
        calibration_runs: profiles.len(),
    };
    choice.apply(args)?;
    Ok(choice)
}
