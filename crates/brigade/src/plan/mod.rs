//! The plan: from a few profiled steps of one run (`brigade train --profile`, at most one per
//! policy family), the fastest configuration that fits a memory budget per rank.
//!
//! Every candidate (a reducer policy, a bucket cap, activation checkpointing on or off) gets a
//! predicted peak per rank from the memory model ([`memory::predict_peak`]) and a predicted step
//! from the overlap model ([`brigade_ddp::overlap::replay_with`]) replaying the profile **of the
//! candidate's own policy family** under the candidate's cap, link and world size, so that each
//! policy's own compute (casts, PowerSGD's matmuls, ZeRO's shard steps) is measured, never
//! assumed. Every built-in policy is its own family, PowerSGD one per rank `r`: even the pairs
//! that send the same bytes measure apart (fp16's casts cost more than bf16's, whose widening
//! is a shift; ZeRO-1 gathers into its whole buffer where ZeRO-2 gathers in chunks). What a profile cannot say is a reason, not
//! a number: a family nobody profiled, a PowerSGD rank never run, a policy whose collectives
//! the overlap model cannot cost.
//!
//! A family's profile is one step; from a run that profiled several ([`median_step`]) the one
//! whose measured step is the median, so that one step slowed by the machine does not become
//! the family's calibration.

pub mod memory;

use brigade_ddp::overlap::{replay_with, wire_note, BucketOrder, LaunchOverhead, LinkCost, ReplayConfig, StepProfile};
use brigade_models::ModelKind;
use brigade_policies::PolicySpec;
use serde::Serialize;

use crate::error::{Error, Result};
use memory::{PeakPrediction, PeakQuery};

/// The bucket caps a plan tries when the query names none, in MiB.
pub const DEFAULT_PLAN_CAPS_MB: [f64; 3] = [1.0, 5.0, 25.0];

/// What a plan is asked.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanQuery {
    /// Bytes one rank may hold at once during a step.
    pub budget_bytes: u64,
    /// Ranks to plan for (default: the profiles').
    pub world_size: Option<usize>,
    /// The link the collectives are costed on.
    pub link: LinkCost,
    /// Bucket caps to try, in MiB.
    pub bucket_caps_mb: Vec<f64>,
    /// The first bucket's cap in MiB (default 1), never above the bucket cap.
    pub first_bucket_cap_mb: Option<f64>,
}

impl PlanQuery {
    /// A budget of `budget_bytes` per rank on `link`, at the profiles' world size, over
    /// [`DEFAULT_PLAN_CAPS_MB`].
    pub fn new(budget_bytes: u64, link: LinkCost) -> PlanQuery {
        PlanQuery {
            budget_bytes,
            world_size: None,
            link,
            bucket_caps_mb: DEFAULT_PLAN_CAPS_MB.to_vec(),
            first_bucket_cap_mb: None,
        }
    }
}

/// A candidate's predicted step, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepPrediction {
    /// The step: compute, and the communication left exposed after backward.
    pub step_s: f64,
    /// The step without communication (backward, the optimizer, the rest), as the family's
    /// profile measured it.
    pub compute_s: f64,
    /// Communication left after the last rank's backward compute ended.
    pub exposed_comm_s: f64,
    /// Sum of the buckets' link times.
    pub comm_s: f64,
    /// What the policy's own work added to the compute over allreduce's (casts, PowerSGD's
    /// matmuls, ZeRO's shard steps), from its own profile against the allreduce profile at the
    /// same activation checkpointing; `None` without such an allreduce profile. It can come out
    /// slightly negative where the policy adds nothing (two measurements' noise).
    pub policy_compute_s: Option<f64>,
    /// Which of the plan's profiles was replayed (its index).
    pub profile: usize,
}

/// One configuration the plan weighed.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The reducer policy.
    pub policy: PolicySpec,
    /// The bucket cap, in MiB.
    pub bucket_cap_mb: f64,
    /// The first bucket's cap, in MiB.
    pub first_bucket_cap_mb: f64,
    /// Activation checkpointing of every N-th block (0: none).
    pub activation_checkpointing: usize,
    /// Ranks.
    pub world_size: usize,
    /// The predicted peak per rank.
    pub memory: PeakPrediction,
    /// Over the budget: the largest part of the peak (the one to cut) and how many bytes the
    /// peak exceeds the budget by; `None`: it fits.
    pub over_budget: Option<(&'static str, u64)>,
    /// The predicted step, or why it cannot be predicted from the profiles.
    pub step: std::result::Result<StepPrediction, String>,
}

impl Candidate {
    /// Whether it fits the budget and its step was predicted.
    pub fn is_eligible(&self) -> bool {
        self.over_budget.is_none() && self.step.is_ok()
    }
}

/// The candidates, ranked, and the pick.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Fitting and predicted first, fastest first; then over the budget (smallest peak first);
    /// then not predicted.
    pub candidates: Vec<Candidate>,
    /// The fastest predicted candidate that fits (index into `candidates`: 0 when any).
    pub winner: Option<usize>,
    /// The profiles' precision (`f32`, `bf16`, `fp16`): every candidate runs at it.
    pub precision: String,
    /// The command line of the first profile that recorded one (empty: none did), as the
    /// program that recorded it wrote it.
    pub command: Vec<String>,
    /// The link the plan costed its candidates on.
    pub link: LinkCost,
    /// How the overlap model priced a profile under another model than its policy's steady
    /// one (a PowerSGD step before its start step, priced as the plain all-reduce it ran), one
    /// line each, as `brigade predict` notes it; empty when none was.
    pub notes: Vec<String>,
}

/// The policy family whose profiles a candidate of `spec` is predicted from: the spec a plan
/// groups it under (its entry in [`brigade_policies::registry`]); `None` when a plan does not
/// weigh it.
fn family_of(spec: &PolicySpec) -> Option<PolicySpec> {
    spec.plan_family()
}

/// The step of one run's profiled steps that a plan reads: the one whose measured step (its
/// slowest rank's end) is the median, the lower of the two middle ones for an even count.
/// `None` for no step.
pub fn median_step(mut steps: Vec<StepProfile>) -> Option<StepProfile> {
    let measured = |p: &StepProfile| p.ranks.iter().map(|r| r.step_end_s).fold(f64::NEG_INFINITY, f64::max);
    steps.sort_by(|a, b| measured(a).total_cmp(&measured(b)));
    let middle = steps.len().checked_sub(1)? / 2;
    Some(steps.swap_remove(middle))
}

/// The policy a profile was recorded under (`allreduce` for one that names none).
fn profiled_policy(p: &StepProfile) -> Option<PolicySpec> {
    match &p.policy {
        None => Some(PolicySpec::AllReduce),
        Some(pp) => pp.name.parse().ok(),
    }
}

/// The model, rows, optimizer state and precision every profile shares.
struct RunFacts {
    kind: ModelKind,
    rows: usize,
    state_per_param: u64,
    precision: String,
    world: usize,
}

fn run_facts(profiles: &[StepProfile]) -> Result<RunFacts> {
    let plan_err = |m: String| Err(Error::Plan(m));
    let Some(first) = profiles.first() else {
        return plan_err("no step profile to plan from".into());
    };
    for (i, p) in profiles.iter().enumerate() {
        p.validate().map_err(|e| Error::Plan(format!("profile {i}: {e}")))?;
        if profiled_policy(p).as_ref().and_then(family_of).is_none() {
            let name = p.policy.as_ref().map_or("", |pp| pp.name.as_str());
            return plan_err(format!(
                "profile {i} records policy '{name}', which a plan does not weigh (it weighs {}): leave it out",
                brigade_policies::registry::planned_names()
            ));
        }
        if p.run.is_none() {
            return plan_err(format!(
                "profile {i} does not record what ran (model, batch, optimizer, precision): \
                 re-record it with this build's {}",
                crate::field::PROFILE
            ));
        }
    }
    let run = |p: &StepProfile| p.run.clone().expect("checked above");
    let r0 = run(first);
    for (i, p) in profiles.iter().enumerate().skip(1) {
        let r = run(p);
        let differs = [
            ("model", r.model != r0.model || r.model_config != r0.model_config),
            ("world size", p.world_size != first.world_size),
            ("precision", r.precision != r0.precision),
            ("rows per microbatch", r.rows != r0.rows),
            ("optimizer", r.optimizer_state_per_param != r0.optimizer_state_per_param),
        ];
        if let Some((what, _)) = differs.iter().find(|(_, d)| *d) {
            return plan_err(format!(
                "profile {i} differs from profile 0 in its {what}: a plan compares profiles of one run \
                 (the same model, world size, precision, batch and optimizer) under other policies"
            ));
        }
    }
    // one profile per policy and checkpointing setting: of two, which one counts would be
    // the order of the list
    for (i, p) in profiles.iter().enumerate() {
        let spec = profiled_policy(p);
        if let Some(j) = profiles[..i]
            .iter()
            .position(|q| profiled_policy(q) == spec && q.activation_checkpointing == p.activation_checkpointing)
        {
            let spec = spec.map_or_else(String::new, |s| s.to_string());
            return plan_err(format!(
                "profile {i} records {spec} as profile {j} does: a plan weighs one profile per policy (and \
                 activation checkpointing setting): leave one out"
            ));
        }
    }
    let Some(config) = r0.model_config.as_deref() else {
        return plan_err(format!(
            "the profiles do not record the {} model's configuration (ModelConfig::config): the memory model needs it",
            r0.model
        ));
    };
    Ok(RunFacts {
        kind: crate::config::model_kind(&r0.model, config)?,
        rows: r0.rows,
        state_per_param: r0.optimizer_state_per_param,
        precision: r0.precision,
        world: first.world_size,
    })
}

/// Mean over the ranks of backward's compute span.
fn backward_span(p: &StepProfile) -> f64 {
    p.ranks
        .iter()
        .map(|r| r.backward_end_s - r.backward_start_s)
        .sum::<f64>()
        / p.ranks.len() as f64
}

/// `p` with its backward compute stretched by `ratio` (every gradient's ready time and
/// backward's end scaled from backward's start; what follows backward shifted by as much; each
/// recorded bucket keeps its duration).
fn stretched(p: &StepProfile, ratio: f64) -> StepProfile {
    let mut out = p.clone();
    for r in &mut out.ranks {
        let (bs, be) = (r.backward_start_s, r.backward_end_s);
        let delta = (be - bs) * (ratio - 1.0);
        let map = |t: f64| {
            if t <= be {
                bs + (t - bs).max(0.0) * ratio
            } else {
                t + delta
            }
        };
        for t in &mut r.grad_ready_s {
            *t = map(*t);
        }
        for b in &mut r.buckets {
            let d = b.finish_s - b.start_s;
            b.ready_s = map(b.ready_s);
            b.launch_s = map(b.launch_s);
            b.start_s = map(b.start_s);
            b.finish_s = b.start_s + d;
        }
        r.backward_end_s = bs + (be - bs) * ratio;
        r.optimizer_start_s += delta;
        r.optimizer_end_s += delta;
        r.step_end_s += delta;
    }
    out
}

/// Plans from `profiles` (one run's steps under one or more policy families) for `q`: every
/// candidate's predicted peak and step, ranked (see [`Plan`]).
///
/// Activation checkpointing: a candidate whose setting differs from the profile of its family
/// is predicted only when the profiles include an allreduce pair with checkpointing off (0)
/// and on (1): the recompute is then measured, and the candidate's profile has its backward
/// compute stretched by that pair's ratio of backward spans (mean over the ranks) before it is
/// replayed. Without the pair such a candidate is "not predicted".
///
/// Errors (one line each): no profile; a profile that does not validate, records a policy
/// outside the families weighed, or records no run facts
/// ([`brigade_ddp::overlap::ProfileRun`]); profiles of different models, world sizes,
/// precisions, batches or optimizers; two profiles of one policy at one checkpointing setting;
/// a bucket cap that is not a positive number of MiB.
pub fn plan(profiles: &[StepProfile], q: &PlanQuery) -> Result<Plan> {
    let facts = run_facts(profiles)?;
    let world = check_query(q, &facts)?;
    let recorded: Vec<Option<PolicySpec>> = profiles.iter().map(profiled_policy).collect();
    let family_of_profile: Vec<Option<PolicySpec>> = recorded.iter().map(|s| s.as_ref().and_then(family_of)).collect();
    // the recompute, measured: allreduce at checkpointing 0 and 1
    let allreduce_at = |ac: usize| {
        (0..profiles.len()).find(|&i| {
            family_of_profile[i] == Some(PolicySpec::AllReduce) && profiles[i].activation_checkpointing == ac
        })
    };
    let weighing = Weighing {
        profiles,
        q,
        facts: &facts,
        world,
        ac_pair: allreduce_at(0).zip(allreduce_at(1)),
        overhead: LaunchOverhead::fit(&profiles.iter().collect::<Vec<_>>()),
        family_of_profile: &family_of_profile,
    };
    // the policies: the built-in families, each of them at every setting some profile
    // recorded (PowerSGD at each rank; rank 1 when none did, to say that it was not profiled)
    let recorded_specs: Vec<PolicySpec> = recorded.iter().flatten().cloned().collect();
    let policies = brigade_policies::registry::plan_candidates(&recorded_specs);
    let checkpointing: &[usize] = match facts.kind {
        ModelKind::Gpt(_) => &[0, 1],
        ModelKind::Mlp(_) => &[0],
    };
    let mut candidates = vec![];
    for policy in &policies {
        for &ac in checkpointing {
            candidates.extend(weighing.candidates(policy, ac)?);
        }
    }
    rank_candidates(&mut candidates);
    let winner = candidates.first().filter(|c| c.is_eligible()).map(|_| 0);
    let notes = wire_notes(profiles, &family_of_profile);
    Ok(Plan {
        candidates,
        winner,
        precision: facts.precision,
        command: profiles
            .iter()
            .find_map(|p| {
                p.run
                    .as_ref()
                    .filter(|r| !r.command.is_empty())
                    .map(|r| r.command.clone())
            })
            .unwrap_or_default(),
        link: q.link,
        notes,
    })
}

/// The overlap model's note on each profile of a weighed family that it prices under another
/// model than its policy's steady one ([`wire_note`]), each once.
fn wire_notes(profiles: &[StepProfile], families: &[Option<PolicySpec>]) -> Vec<String> {
    let mut notes: Vec<String> = vec![];
    for (p, _) in profiles.iter().zip(families).filter(|(_, f)| f.is_some()) {
        if let Some(note) = wire_note(p).filter(|n| !notes.contains(n)) {
            notes.push(note);
        }
    }
    notes
}

/// The query's bucket caps checked, and the world size it plans for (the profiles' unless it
/// names one).
fn check_query(q: &PlanQuery, facts: &RunFacts) -> Result<usize> {
    if q.bucket_caps_mb.is_empty() {
        return Err(Error::Plan("no bucket cap to try".into()));
    }
    if let Some(c) = q
        .bucket_caps_mb
        .iter()
        .chain(&q.first_bucket_cap_mb)
        .find(|c| !(c.is_finite() && **c > 0.0))
    {
        return Err(Error::Plan(format!(
            "a bucket cap must be a positive number of MiB, got {c}"
        )));
    }
    let world = q.world_size.unwrap_or(facts.world);
    if world == 0 {
        return Err(Error::Plan("the world size must be at least 1".into()));
    }
    Ok(world)
}

/// What every candidate is weighed against: the profiles (with each one's policy family),
/// the query, the run's facts, the world planned for, the allreduce pair that measures the
/// recompute, and the backend's launch overhead.
struct Weighing<'a> {
    profiles: &'a [StepProfile],
    q: &'a PlanQuery,
    facts: &'a RunFacts,
    world: usize,
    ac_pair: Option<(usize, usize)>,
    overhead: LaunchOverhead,
    family_of_profile: &'a [Option<PolicySpec>],
}

impl Weighing<'_> {
    /// The candidates of `policy` at checkpointing `ac`, one per bucket cap: its predicted
    /// peak (and how far over the budget), and its predicted step.
    fn candidates(&self, policy: &PolicySpec, ac: usize) -> Result<Vec<Candidate>> {
        let (q, facts) = (self.q, self.facts);
        let family = family_of(policy).expect("a planned policy has a family");
        let memory = memory::predict_peak(&PeakQuery {
            kind: &facts.kind,
            rows: facts.rows,
            state_per_param: facts.state_per_param,
            policy,
            world: self.world,
            checkpoint_every: ac,
        })
        .ok_or_else(|| Error::Plan("the model's predicted peak is more than 2^64 bytes per rank".into()))?;
        let over_budget =
            (memory.total() > q.budget_bytes).then(|| (memory.largest().0, memory.total() - q.budget_bytes));
        Ok(q.bucket_caps_mb
            .iter()
            .map(|&cap| {
                let first = q.first_bucket_cap_mb.unwrap_or(1.0).min(cap);
                let step = predict_step(
                    self.profiles,
                    self.family_of_profile,
                    &family,
                    ac,
                    self.ac_pair,
                    self.overhead,
                    &ReplayConfig {
                        bucket_cap_mb: cap,
                        first_bucket_cap_mb: first,
                        link: q.link,
                        world_size: Some(self.world),
                        order: BucketOrder::Ready,
                    },
                );
                Candidate {
                    policy: policy.clone(),
                    bucket_cap_mb: cap,
                    first_bucket_cap_mb: first,
                    activation_checkpointing: ac,
                    world_size: self.world,
                    memory,
                    over_budget,
                    step,
                }
            })
            .collect())
    }
}

/// Fitting and predicted candidates first, by step; then those over budget, by peak; then
/// those not predicted, as listed.
fn rank_candidates(candidates: &mut [Candidate]) {
    let rank = |c: &Candidate| match (&c.step, c.over_budget) {
        (Ok(s), None) => (0, s.step_s),
        (_, Some(_)) => (1, c.memory.total() as f64),
        (Err(_), None) => (2, 0.0),
    };
    candidates.sort_by(|a, b| {
        let (ra, rb) = (rank(a), rank(b));
        ra.0.cmp(&rb.0).then(ra.1.total_cmp(&rb.1))
    });
}

/// The step of a candidate of `family` at checkpointing `ac` under `cfg` (its order set here
/// from the profile replayed), or why it cannot be predicted.
fn predict_step(
    profiles: &[StepProfile],
    families: &[Option<PolicySpec>],
    family: &PolicySpec,
    ac: usize,
    ac_pair: Option<(usize, usize)>,
    overhead: LaunchOverhead,
    cfg: &ReplayConfig,
) -> std::result::Result<StepPrediction, String> {
    let of_family: Vec<usize> = (0..profiles.len())
        .filter(|&i| families[i].as_ref() == Some(family))
        .collect();
    if of_family.is_empty() {
        // the same policy profiled at other settings (PowerSGD at other ranks)
        let profiled: Vec<String> = families
            .iter()
            .flatten()
            .filter(|f| f.name() == family.name())
            .map(|f| f.to_string())
            .collect();
        if !profiled.is_empty() {
            return Err(format!(
                "{family}'s compute was not measured (profiled: {})",
                profiled.join(", ")
            ));
        }
        return Err(format!("no profiled step under {}", family.name()));
    }
    let same_ac = of_family
        .iter()
        .copied()
        .find(|&i| profiles[i].activation_checkpointing == ac);
    let (index, profile) = match same_ac {
        Some(i) => (i, profiles[i].clone()),
        None => {
            let i = of_family[0];
            let from = profiles[i].activation_checkpointing;
            let Some((off, on)) = ac_pair.filter(|_| from <= 1 && ac <= 1) else {
                return Err("no profiled step with activation checkpointing".into());
            };
            let span = |k: usize| backward_span(&profiles[k]);
            let ratio = if ac == 1 {
                span(on) / span(off)
            } else {
                span(off) / span(on)
            };
            if !(ratio.is_finite() && ratio > 0.0) {
                return Err("the profiled backward spans give no recompute ratio".into());
            }
            (i, stretched(&profiles[i], ratio))
        }
    };
    let cfg = ReplayConfig {
        order: BucketOrder::recorded(&profile),
        ..*cfg
    };
    let r = replay_with(&profile, &cfg, overhead).map_err(|e| e.to_string())?;
    // allreduce's compute at the same checkpointing, from its own profile (or stretched)
    let base = |i: usize| replay_with(&profiles[i], &cfg, overhead).ok().map(|b| b.compute_step_s);
    let allreduce = (0..profiles.len())
        .find(|&i| families[i] == Some(PolicySpec::AllReduce) && profiles[i].activation_checkpointing == ac);
    let policy_compute_s = match family {
        PolicySpec::AllReduce => Some(0.0),
        _ => allreduce.and_then(base).map(|b| r.compute_step_s - b),
    };
    Ok(StepPrediction {
        step_s: r.predicted_step_s,
        compute_s: r.compute_step_s,
        exposed_comm_s: r.exposed_comm_s,
        comm_s: r.comm_s,
        policy_compute_s,
        profile: index,
    })
}

impl Plan {
    /// The winner, when one fits.
    pub fn winner(&self) -> Option<&Candidate> {
        self.winner.map(|i| &self.candidates[i])
    }
}
