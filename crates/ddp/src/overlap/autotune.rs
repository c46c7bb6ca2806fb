//! Tuning the bucket cap online (`--bucket-mb auto`): the overlap model picks the cap.
//!
//! After the first synchronized step (whose end rebuilt the buckets in rank 0's ready order),
//! and then every `every` steps, each rank hands the [`Autotuner`] its profile of the steps
//! since the last check; the ranks gather them, rank 0 [`replay`]s every candidate cap on each
//! observed step and takes the cap with the lowest median predicted step time, and broadcasts
//! its decision. The cap changes only when the predicted gain beats `min_gain` (a fraction of
//! the current cap's predicted step), and then every rank regroups its buckets under it
//! ([`DistributedDataParallel::set_bucket_caps`]), in the same order, so every rank holds the
//! same buckets. Only the grouping changes, never the arithmetic of a gradient, so the losses
//! match a fixed cap's up to the order of float additions.
//!
//! The compute in each replay is the recorded one, the same for every candidate, so the choice
//! depends on how the communication fits behind backward, not on the noise of the minute.
//!
//! A checkpoint records where the checks stand ([`Autotuner::progress`]: how many were made, and
//! how many steps ran since the last) beside the buckets' grouping and caps; a resume continues
//! from them ([`Autotuner::resume`]), so that its checks fall on the steps an uninterrupted run's
//! would and its steps run on the same buckets. The profiles of the steps before the resume are
//! not kept (they are measured times): the next check decides from the steps since the resume.

use std::ops::Range;

use brigade_comm::{Buffer, NetModel};
use serde::{Deserialize, Serialize};

use super::{
    replay_with, BucketOrder, LaunchOverhead, LinkCost, ParamProfile, ProfilePolicy, RankProfile, ReplayConfig,
    StepProfile, PROFILE_VERSION,
};
use crate::{DdpError, DistributedDataParallel, Result};

/// The caps `auto` chooses from by default, in MiB (PyTorch's 25 among them).
pub const AUTOTUNE_CAPS_MB: [f64; 9] = [0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0];
/// The cap `auto` starts from, in MiB (PyTorch's default).
pub const AUTOTUNE_START_CAP_MB: f64 = 25.0;
/// The predicted gain, as a fraction of the current cap's predicted step, below which the cap
/// stays (a rebuild is not free, and a prediction within 2% is within the model's error).
pub const DEFAULT_MIN_GAIN: f64 = 0.02;

/// How the autotuner chooses.
#[derive(Debug, Clone, PartialEq)]
pub struct AutotuneConfig {
    /// Re-check every this many steps after the first decision (`None`: decide once, after
    /// the first step).
    pub every: Option<usize>,
    /// The caps to choose from, in MiB.
    pub candidates_mb: Vec<f64>,
    /// The first bucket's cap, in MiB (each candidate's first bucket is the smaller of the two).
    pub first_bucket_cap_mb: f64,
    /// Change the cap only when the best candidate's predicted step is shorter than the current
    /// cap's by more than this fraction of it. 0 moves on any predicted gain; a negative value
    /// `-f` also moves to a best candidate predicted slower than the current cap, by less than
    /// `f` of the current cap's step (`-1e9`: whatever the prediction).
    pub min_gain: f64,
    /// The link to cost collectives on (`None`: fitted to the recorded buckets,
    /// [`LinkCost::Measured`]).
    pub link: Option<NetModel>,
}

impl Default for AutotuneConfig {
    fn default() -> Self {
        AutotuneConfig {
            every: None,
            candidates_mb: AUTOTUNE_CAPS_MB.to_vec(),
            first_bucket_cap_mb: 1.0,
            min_gain: DEFAULT_MIN_GAIN,
            link: None,
        }
    }
}

impl AutotuneConfig {
    /// Checks the numbers; the message names the field at fault.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(DdpError::Autotune(m));
        if self.candidates_mb.is_empty() {
            return bad("no candidate caps to choose from".into());
        }
        let positive = |v: f64| v > 0.0 && v.is_finite();
        if let Some(c) = self.candidates_mb.iter().find(|&&c| !positive(c)) {
            return bad(format!("candidate caps must be positive numbers of MiB, got {c}"));
        }
        if !positive(self.first_bucket_cap_mb) {
            return bad(format!(
                "the first bucket cap must be a positive number of MiB, got {}",
                self.first_bucket_cap_mb
            ));
        }
        if self.every == Some(0) {
            return bad("the re-check period must be at least 1 step".into());
        }
        if self.min_gain.is_nan() {
            return bad("the minimum gain is not a number".into());
        }
        Ok(())
    }
}

/// One check of the autotuner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutotuneDecision {
    /// The step after which it was taken (the new cap holds from the next one).
    pub after_step: usize,
    /// Steps whose profiles it replayed.
    pub steps_observed: usize,
    /// The cap before, in MiB.
    pub from_cap_mb: f64,
    /// The candidate with the shortest predicted step, in MiB.
    pub best_cap_mb: f64,
    /// The cap after, in MiB (`best_cap_mb` when the gain beat the threshold, else `from_cap_mb`).
    pub cap_mb: f64,
    /// Median predicted step time at `from_cap_mb`, in seconds.
    pub predicted_from_step_s: f64,
    /// Median predicted step time at `best_cap_mb`, in seconds.
    pub predicted_best_step_s: f64,
    /// Whether the cap changed (and every rank rebuilt its buckets).
    pub changed: bool,
}

/// What the autotuner did over a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutotuneReport {
    /// The cap in effect at the end, in MiB.
    pub cap_mb: f64,
    /// The first bucket's cap in effect at the end, in MiB.
    pub first_bucket_cap_mb: f64,
    /// The predicted step time at that cap, in milliseconds: the median of the checks'
    /// predictions from steps run at it, or the last check's when that check set it (from
    /// steps run at the cap before).
    pub predicted_step_ms: Option<f64>,
    /// The steps whose profiles `predicted_step_ms` was replayed from (half-open).
    #[serde(default)]
    pub predicted_steps: Option<Range<usize>>,
    /// This rank's median measured step time at that cap, in milliseconds: over the steps
    /// `predicted_step_ms` was replayed from when they ran at it (compare the two), else over
    /// every step since the cap was set.
    pub measured_step_ms: Option<f64>,
    /// The steps `measured_step_ms` covers (half-open): `predicted_steps` when they ran at the
    /// cap, else the steps since the cap was set.
    #[serde(default)]
    pub measured_steps: Option<Range<usize>>,
    /// Every check, in order.
    pub decisions: Vec<AutotuneDecision>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Rank 0's decision from the profiles of the observed steps: replays each candidate (and the
/// current cap) on every profile, takes the median predicted step time per cap, and picks the
/// lowest (ties go to the larger cap: fewer collectives for the same prediction).
pub fn decide(
    profiles: &[StepProfile],
    from_cap_mb: f64,
    cfg: &AutotuneConfig,
    after_step: usize,
) -> Result<AutotuneDecision> {
    cfg.validate()?;
    if profiles.is_empty() {
        return Err(DdpError::Autotune("no step profile to decide from".into()));
    }
    // the backend's launch overhead, fitted once from every observed step
    let overhead = LaunchOverhead::fit(&profiles.iter().collect::<Vec<_>>());
    let predicted = |cap: f64| -> Result<f64> {
        let rc = ReplayConfig {
            bucket_cap_mb: cap,
            first_bucket_cap_mb: cfg.first_bucket_cap_mb.min(cap),
            link: cfg.link.map_or(LinkCost::Measured, LinkCost::Ring),
            world_size: None,
            order: BucketOrder::Ready,
        };
        let mut steps = profiles
            .iter()
            .map(|p| replay_with(p, &rc, overhead).map(|r| r.predicted_step_s))
            .collect::<Result<Vec<f64>>>()?;
        Ok(median(&mut steps))
    };
    let mut candidates = cfg.candidates_mb.clone();
    candidates.sort_by(f64::total_cmp);
    let (mut best_cap, mut best) = (f64::NAN, f64::INFINITY);
    for &c in &candidates {
        let p = predicted(c)?;
        if p <= best {
            (best_cap, best) = (c, p);
        }
    }
    let from = predicted(from_cap_mb)?;
    let changed = best_cap != from_cap_mb && from - best > cfg.min_gain * from;
    Ok(AutotuneDecision {
        after_step,
        steps_observed: profiles.len(),
        from_cap_mb,
        best_cap_mb: best_cap,
        cap_mb: if changed { best_cap } else { from_cap_mb },
        predicted_from_step_s: from,
        predicted_best_step_s: best,
        changed,
    })
}

/// The times of a rank profile other ranks need (everything but its buckets), as f64s.
const SPANS: usize = 9;

fn encode(p: &RankProfile, out: &mut Vec<f64>) {
    out.extend_from_slice(&[
        p.backward_start_s,
        p.backward_end_s,
        p.optimizer_start_s,
        p.optimizer_end_s,
        p.step_end_s,
        // the instant its collectives ended, which rank 0 knows on its own clock (NaN: none)
        p.buckets.iter().map(|b| b.finish_s).fold(f64::NAN, f64::max),
        // what the policy computed itself (NaN: not recorded)
        p.policy_s.map_or(f64::NAN, |t| t.reduce_s),
        p.policy_s.map_or(f64::NAN, |t| t.after_step_s),
        p.policy_s.map_or(f64::NAN, |t| t.after_step_link_s),
    ]);
    out.extend_from_slice(&p.grad_ready_s);
}

fn decode(rank: usize, v: &[f64]) -> RankProfile {
    RankProfile {
        rank,
        backward_start_s: v[0],
        backward_end_s: v[1],
        optimizer_start_s: v[2],
        optimizer_end_s: v[3],
        step_end_s: v[4],
        grad_ready_s: v[SPANS..].to_vec(),
        buckets: vec![],
        gathers: vec![],
        control: vec![],
        policy_s: v[6].is_finite().then(|| super::PolicyTimes {
            reduce_s: v[6],
            after_step_s: v[7],
            after_step_link_s: v[8],
            ..Default::default()
        }),
    }
}

/// The figures of rank 0's verdict: `[ok, cap, best cap, predicted at from, predicted at best,
/// steps observed]`.
const VERDICT: usize = 6;

/// A decision as the verdict rank 0 broadcasts (`ok` = 1).
fn to_verdict(d: &AutotuneDecision) -> [f64; VERDICT] {
    [
        1.0,
        d.cap_mb,
        d.best_cap_mb,
        d.predicted_from_step_s,
        d.predicted_best_step_s,
        d.steps_observed as f64,
    ]
}

/// Every rank's observed steps, gathered: this rank's encoding's length and all ranks'
/// values. Every rank sends the same number of steps of SPANS + n times (NaN: no profile).
fn gather_profiles(ddp: &DistributedDataParallel, observed: &[Option<RankProfile>]) -> Result<(usize, Vec<f64>)> {
    let n = ParamProfile::all_of(ddp).len();
    let mut mine = Vec::with_capacity(observed.len() * (SPANS + n));
    for p in observed {
        match p {
            Some(p) if p.grad_ready_s.len() == n => encode(p, &mut mine),
            _ => mine.extend(std::iter::repeat_n(f64::NAN, SPANS + n)),
        }
    }
    let gathered = ddp
        .comm()
        .all_gather(Buffer::U8(to_bytes(&mine)), "ddp.autotune.profiles")
        .wait()?;
    let Buffer::U8(gathered) = gathered else {
        return Err(DdpError::Autotune("the profiles came back as another dtype".into()));
    };
    Ok((mine.len(), from_bytes(&gathered)))
}

/// The observed steps that every rank profiled, each as one step's profile of all ranks
/// (`all`: the gathered values, `per_rank` of them from each rank).
fn step_profiles(
    ddp: &DistributedDataParallel,
    observed: &[Option<RankProfile>],
    per_rank: usize,
    all: &[f64],
) -> Vec<StepProfile> {
    let params = ParamProfile::all_of(ddp);
    let policy = ProfilePolicy::of(ddp);
    let (from_cap, first_cap) = ddp.bucket_caps();
    let world = ddp.comm().world_size();
    let row = SPANS + params.len();
    (0..observed.len())
        .filter_map(|i| {
            let ranks = (0..world)
                .map(|r| {
                    let v = &all[r * per_rank + i * row..r * per_rank + (i + 1) * row];
                    if v.iter().any(|x| x.is_nan()) {
                        return None;
                    }
                    Some(rank_profile(r, v, &observed[i].as_ref()?.buckets))
                })
                .collect::<Option<Vec<_>>>()?;
            Some(StepProfile {
                version: PROFILE_VERSION,
                world_size: world,
                bucket_cap_mb: from_cap,
                first_bucket_cap_mb: first_cap,
                activation_checkpointing: 0,
                policy: Some(policy.clone()),
                run: None,
                params: params.clone(),
                ranks,
            })
        })
        .collect()
}

/// Rank `rank`'s profile from its encoded spans `v`, with rank 0's buckets `rank0_buckets`: another
/// rank ran the same collectives, whose last one ended at one instant on every rank, on its clock
/// at `v[5]`, so they are shifted there (the replay charges what followed the rank's wait as
/// recorded, not the wait itself). Its wait may have ended later than that, with its backward.
fn rank_profile(rank: usize, v: &[f64], rank0_buckets: &[super::BucketProfile]) -> RankProfile {
    let mut p = decode(rank, v);
    let last = rank0_buckets.iter().map(|b| b.finish_s).fold(f64::NAN, f64::max);
    let shift = if rank == 0 || !last.is_finite() || !v[5].is_finite() {
        0.0
    } else {
        v[5] - last
    };
    // When each bucket was ready and issued is this rank's own (its gradients' ready times, in
    // strict bucket order), not rank 0's moved to this clock: a rank that started its step
    // after rank 0 issued a bucket would otherwise get negative times.
    let mut issued = 0.0f64;
    p.buckets = rank0_buckets
        .iter()
        .map(|b| {
            let mut b = b.clone();
            b.ready_s = b.params.iter().map(|&q| p.grad_ready_s[q]).fold(0.0, f64::max);
            issued = issued.max(b.ready_s);
            // rank 0's compute inside `reduce`, from this rank's launch
            b.issued_s = b.issued_s.map(|_| issued + b.reduce_s());
            b.launch_s = issued;
            // where the collectives' start is not one instant on every rank (no shared link),
            // the shift is approximate: no collective starts on this rank before it issued it
            b.start_s = (b.start_s + shift).max(issued);
            b.finish_s = (b.finish_s + shift).max(b.start_s);
            b
        })
        .collect();
    p
}

fn to_bytes(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

/// Where an autotuner's checks stand, for a checkpoint ([`Autotuner::progress`]) and a resume
/// ([`Autotuner::resume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AutotuneProgress {
    /// The checks made so far (the first one follows the first step observed).
    pub checks: usize,
    /// The steps observed since the last check.
    pub since_check: usize,
}

/// Tunes one rank's DDP bucket cap as training runs (see the module docs). Every rank must call
/// [`Autotuner::observe`] after every step: the checks are collectives.
pub struct Autotuner {
    cfg: AutotuneConfig,
    /// Checks made before a resume (by the run whose checkpoint it continues).
    checks_before: usize,
    /// Steps since the last check that ran before a resume (their profiles are not kept).
    unseen_since_check: usize,
    /// This rank's profiles since the last check (`None`: the step had no synchronized pass).
    observed: Vec<Option<RankProfile>>,
    /// This rank's step times since the cap last changed: (step, seconds).
    step_s_at_cap: Vec<(usize, f64)>,
    /// The first step observed (since the start or the resume).
    first_step: Option<usize>,
    decisions: Vec<AutotuneDecision>,
}

impl Autotuner {
    /// An autotuner choosing as `cfg` says.
    pub fn new(cfg: AutotuneConfig) -> Result<Self> {
        Self::resume(cfg, AutotuneProgress::default())
    }

    /// An autotuner choosing as `cfg` says, continuing from a checkpoint's `progress`: its next
    /// check falls where the checkpoint's run would have made it. The DDP it observes must hold
    /// the buckets and caps recorded with that progress.
    pub fn resume(cfg: AutotuneConfig, progress: AutotuneProgress) -> Result<Self> {
        cfg.validate()?;
        Ok(Autotuner {
            cfg,
            checks_before: progress.checks,
            unseen_since_check: progress.since_check,
            observed: vec![],
            step_s_at_cap: vec![],
            first_step: None,
            decisions: vec![],
        })
    }

    /// Whether `ddp`'s bucket cap can be tuned, in one line naming its policy when not: on more
    /// than one rank, its policy must let the buckets change and declare how the overlap model
    /// costs its collectives ([`crate::ReducerPolicy::wire_model`]). A trainer asks before its
    /// first step, so that the first check does not fail after it.
    pub fn check(ddp: &DistributedDataParallel) -> Result<()> {
        if ddp.comm().world_size() < 2 {
            return Ok(());
        }
        let refuse = |why: &str| {
            Err(DdpError::Autotune(format!(
                "policy '{}' {why}: the bucket cap cannot be tuned (give a fixed cap)",
                ddp.policy_name()
            )))
        };
        if !ddp.buckets_can_change() {
            return refuse("fixes its buckets");
        }
        if ddp.wire_model().0.is_none() {
            return refuse("declares no wire model, so the overlap model cannot cost its collectives");
        }
        Ok(())
    }

    /// Where the checks stand after the steps observed so far (for a checkpoint).
    pub fn progress(&self) -> AutotuneProgress {
        AutotuneProgress {
            checks: self.checks_before + self.decisions.len(),
            since_check: self.unseen_since_check + self.observed.len(),
        }
    }

    /// Takes this rank's profile of `step` (just finished); at a check (the first step
    /// observed, then every `every` steps) decides with the other ranks and, if the cap
    /// changes, regroups `ddp`'s buckets. Returns the decision when there was a check.
    pub fn observe(
        &mut self,
        ddp: &DistributedDataParallel,
        step: usize,
        profile: Option<RankProfile>,
    ) -> Result<Option<AutotuneDecision>> {
        self.first_step.get_or_insert(step);
        if let Some(p) = &profile {
            self.step_s_at_cap.push((step, p.step_end_s));
        }
        self.observed.push(profile);
        if !self.due() || ddp.comm().world_size() < 2 {
            return Ok(None);
        }
        if !ddp.buckets_can_change() {
            return Err(DdpError::Autotune(format!(
                "policy '{}' fixes its buckets: the bucket cap cannot be tuned (give a fixed cap)",
                ddp.policy_name()
            )));
        }
        let observed = std::mem::take(&mut self.observed);
        self.unseen_since_check = 0;
        let (own, all) = gather_profiles(ddp, &observed)?;
        // rank 0 decides from every rank's profiles and tells the others
        let mut verdict = [0.0f64; VERDICT];
        let mut own_error = None;
        if ddp.comm().rank() == 0 {
            let profiles = step_profiles(ddp, &observed, own, &all);
            match decide(&profiles, ddp.bucket_caps().0, &self.cfg, step) {
                Ok(d) => verdict = to_verdict(&d),
                Err(e) => own_error = Some(e),
            }
        }
        let got = ddp
            .comm()
            .broadcast(Buffer::U8(to_bytes(&verdict)), 0, "ddp.autotune.decision")
            .wait()?;
        let Buffer::U8(got) = got else {
            return Err(DdpError::Autotune("the decision came back as another dtype".into()));
        };
        let v = from_bytes(&got);
        if let Some(e) = own_error {
            return Err(e);
        }
        if v.len() != verdict.len() || v[0] != 1.0 {
            return Err(DdpError::Autotune(
                "rank 0 could not decide (its error names why)".into(),
            ));
        }
        self.apply(ddp, step, &v).map(Some)
    }

    /// Whether the step just observed is a check: the first step observed, then every `every`.
    fn due(&self) -> bool {
        let progress = self.progress();
        match (progress.checks == 0, self.cfg.every) {
            (true, _) => true,
            (false, Some(k)) => progress.since_check >= k,
            (false, None) => false,
        }
    }

    /// Rank 0's verdict `v` (as [`to_verdict`] lays it out) applied: the caps changed when it
    /// says so, and the decision recorded.
    fn apply(&mut self, ddp: &DistributedDataParallel, step: usize, v: &[f64]) -> Result<AutotuneDecision> {
        let (from_cap, _) = ddp.bucket_caps();
        let changed = v[1] != from_cap;
        if changed {
            ddp.set_bucket_caps(v[1], self.cfg.first_bucket_cap_mb.min(v[1]))?;
            self.step_s_at_cap.clear();
        }
        let decision = AutotuneDecision {
            after_step: step,
            steps_observed: v[5] as usize,
            from_cap_mb: from_cap,
            best_cap_mb: v[2],
            cap_mb: v[1],
            predicted_from_step_s: v[3],
            predicted_best_step_s: v[4],
            changed,
        };
        self.decisions.push(decision.clone());
        Ok(decision)
    }

    /// What the autotuner did, with `ddp`'s caps at the end.
    pub fn report(&self, ddp: &DistributedDataParallel) -> AutotuneReport {
        let (cap_mb, first_bucket_cap_mb) = ddp.bucket_caps();
        let at = at_final_cap(&self.decisions, self.first_step.unwrap_or(0), &self.step_s_at_cap);
        AutotuneReport {
            cap_mb,
            first_bucket_cap_mb,
            predicted_step_ms: at.predicted_s.map(|s| 1e3 * s),
            predicted_steps: at.predicted_steps,
            measured_step_ms: at.measured_s.map(|s| 1e3 * s),
            measured_steps: at.measured_steps,
            decisions: self.decisions.clone(),
        }
    }
}

/// The predicted and the measured step at the final cap, each with the steps it covers.
#[derive(Debug, Clone, PartialEq)]
struct AtFinalCap {
    predicted_s: Option<f64>,
    predicted_steps: Option<Range<usize>>,
    measured_s: Option<f64>,
    measured_steps: Option<Range<usize>>,
}

/// The step at the cap in effect after the last of `decisions` (the first observed step was
/// `first_step`; `step_s_at_cap`: (step, seconds) of the steps run at that cap): predicted as
/// [`predicted_at_final_cap`] says, and measured over the same steps when the predictions came
/// from steps run at the cap (the checks since it was set); when the last check set it, its
/// prediction came from the steps before, and the measurement covers every step since.
fn at_final_cap(decisions: &[AutotuneDecision], first_step: usize, step_s_at_cap: &[(usize, f64)]) -> AtFinalCap {
    // a check's steps: those after the check before it (or from the first observed) to its own
    let window = |i: usize| {
        let start = if i == 0 {
            first_step
        } else {
            decisions[i - 1].after_step + 1
        };
        start..decisions[i].after_step + 1
    };
    let since = decisions.iter().rposition(|d| d.changed).map_or(0, |i| i + 1);
    let last = decisions.len().checked_sub(1);
    // the checks since the cap was set, or the one that set it
    let predicted_steps = last.map(|l| window(since.min(l)).start..window(l).end);
    let ran_at_cap = since < decisions.len();
    let measured: Vec<(usize, f64)> = step_s_at_cap
        .iter()
        .copied()
        .filter(|(s, _)| !ran_at_cap || predicted_steps.as_ref().is_some_and(|r| r.contains(s)))
        .collect();
    let mut secs: Vec<f64> = measured.iter().map(|&(_, s)| s).collect();
    let measured_steps = match (measured.first(), measured.last()) {
        (Some(_), _) if ran_at_cap => predicted_steps.clone(),
        (Some(&(a, _)), Some(&(b, _))) => Some(a..b + 1),
        _ => None,
    };
    AtFinalCap {
        predicted_s: predicted_at_final_cap(decisions),
        predicted_steps,
        measured_s: (!secs.is_empty()).then(|| median(&mut secs)),
        measured_steps,
    }
}

/// The predicted step (seconds) at the cap in effect after the last of `decisions`: the median of
/// what the checks since the cap last changed predicted for it (each from steps run at it); the
/// prediction of the check that set it when none followed.
fn predicted_at_final_cap(decisions: &[AutotuneDecision]) -> Option<f64> {
    let last_change = decisions.iter().rposition(|d| d.changed);
    let mut since: Vec<f64> = decisions[last_change.map_or(0, |i| i + 1)..]
        .iter()
        .map(|d| d.predicted_from_step_s)
        .collect();
    if !since.is_empty() {
        return Some(median(&mut since));
    }
    decisions.last().map(|d| {
        if d.cap_mb == d.best_cap_mb {
            d.predicted_best_step_s
        } else {
            d.predicted_from_step_s
        }
    })
}

#[cfg(test)]
mod rank_profile_tests {
    use super::*;
    use crate::overlap::{replay, BucketOrder, BucketProfile, LinkCost, ParamProfile, ReplayConfig};

    /// A comm-bound step as two ranks record it: backward ends at 0.1 s, one bucket runs on the
    /// link until 0.4 s, the optimizer runs 0.41–0.42 s. Rank 1's clock is 0.005 s behind.
    fn spans(skew: f64, buckets: &[BucketProfile]) -> RankProfile {
        RankProfile {
            rank: 0,
            backward_start_s: 0.05 + skew,
            backward_end_s: 0.1 + skew,
            optimizer_start_s: 0.41 + skew,
            optimizer_end_s: 0.42 + skew,
            step_end_s: 0.42 + skew,
            grad_ready_s: vec![0.08 + skew],
            buckets: buckets.to_vec(),
            gathers: vec![],
            control: vec![],
            policy_s: None,
        }
    }

    #[test]
    fn a_rank_whose_buckets_were_hidden_gets_them_at_their_own_instants() {
        // Rank 1's clock runs 5 ms behind rank 0's; its one bucket ran 0.075..0.085 on its
        // clock, hidden by a backward that ended at 0.095: its wait ended with its backward,
        // not with the bucket, and the rebuilt bucket must not move there.
        let bucket = BucketProfile {
            params: vec![0],
            bytes: 4 << 20,
            wire_bytes: None,
            ready_s: 0.076,
            launch_s: 0.076,
            issued_s: None,
            start_s: 0.08,
            finish_s: 0.09,
            link_s: None,
        };
        let rank0 = spans(0.0, std::slice::from_ref(&bucket));
        let mut rank1 = spans(-0.005, &[]);
        rank1.buckets = vec![BucketProfile {
            start_s: 0.075,
            finish_s: 0.085,
            ..bucket.clone()
        }];
        let mut v = vec![];
        encode(&rank1, &mut v);
        let rebuilt = rank_profile(1, &v, &rank0.buckets);
        let b = &rebuilt.buckets[0];
        assert!(
            (b.start_s - 0.075).abs() < 1e-12 && (b.finish_s - 0.085).abs() < 1e-12,
            "{b:?}"
        );
        // its own ready and issue times (0.08 - 0.005), not rank 0's
        assert!((b.ready_s - 0.075).abs() < 1e-12 && b.launch_s == b.ready_s, "{b:?}");
        assert!((rebuilt.waited_until() - 0.095).abs() < 1e-12);
    }

    #[test]
    fn the_reported_prediction_is_the_median_of_the_checks_at_the_final_cap() {
        let d = |changed: bool, from: f64, best: f64, from_s: f64, best_s: f64| super::AutotuneDecision {
            after_step: 0,
            steps_observed: 2,
            from_cap_mb: from,
            best_cap_mb: best,
            cap_mb: if changed { best } else { from },
            predicted_from_step_s: from_s,
            predicted_best_step_s: best_s,
            changed,
        };
        // 25 -> 1 MiB at the first check (predicted 0.40 s there), then three checks at 1 MiB
        let mut ds = vec![d(true, 25.0, 1.0, 0.46, 0.40)];
        assert_eq!(super::predicted_at_final_cap(&ds), Some(0.40));
        ds.extend([
            d(false, 1.0, 1.0, 0.33, 0.33),
            d(false, 1.0, 1.0, 0.30, 0.30),
            d(false, 1.0, 5.0, 0.36, 0.35),
        ]);
        assert_eq!(super::predicted_at_final_cap(&ds), Some(0.33));
        assert_eq!(super::predicted_at_final_cap(&[]), None);
    }

    #[test]
    fn the_measured_step_covers_the_steps_the_prediction_came_from() {
        let d = |after_step: usize, changed: bool, from_s: f64, best_s: f64| super::AutotuneDecision {
            after_step,
            steps_observed: 1,
            from_cap_mb: 25.0,
            best_cap_mb: 1.0,
            cap_mb: if changed { 1.0 } else { 25.0 },
            predicted_from_step_s: from_s,
            predicted_best_step_s: best_s,
            changed,
        };
        // 3 steps, one check after the cold step 0 (0.9 s), which kept 25 MiB and predicted
        // 0.8 s from it: the measurement is step 0's too, not the median of the warm 0.2 s ones
        let times = [(0, 0.9), (1, 0.2), (2, 0.2)];
        let kept = super::at_final_cap(&[d(0, false, 0.8, 0.85)], 0, &times);
        assert_eq!(kept.predicted_s, Some(0.8));
        assert_eq!((kept.predicted_steps, kept.measured_steps), (Some(0..1), Some(0..1)));
        assert_eq!(kept.measured_s, Some(0.9));
        // with checks every 2 steps (after 0, 2, 4) of 6: the checks' steps 0..5, not step 5
        let times = [(0, 0.9), (1, 0.3), (2, 0.3), (3, 0.2), (4, 0.2), (5, 0.1)];
        let ds = [d(0, false, 0.8, 0.8), d(2, false, 0.3, 0.3), d(4, false, 0.2, 0.2)];
        let every = super::at_final_cap(&ds, 0, &times);
        assert_eq!((every.predicted_steps, every.measured_steps), (Some(0..5), Some(0..5)));
        // median of 0.9, 0.3, 0.3, 0.2, 0.2
        assert_eq!(every.measured_s, Some(0.3));
        // the check after step 0 set 1 MiB from step 0's profile: steps 1 and 2 ran at it (the
        // times of the steps since), and each says which steps it covers
        let changed = super::at_final_cap(&[d(0, true, 0.8, 0.5)], 0, &[(1, 0.2), (2, 0.4)]);
        assert_eq!(changed.predicted_s, Some(0.5));
        assert_eq!(
            (changed.predicted_steps, changed.measured_steps),
            (Some(0..1), Some(1..3))
        );
        assert_eq!(changed.measured_s, Some(0.4));
        // no check: nothing predicted, every step measured
        let none = super::at_final_cap(&[], 3, &[(3, 0.2)]);
        assert_eq!((none.predicted_steps, none.measured_steps), (None, Some(3..4)));
    }

    #[test]
    fn another_ranks_wait_ends_with_its_collectives_and_is_not_charged_twice() {
        let bucket = BucketProfile {
            params: vec![0],
            bytes: 4 << 20,
            wire_bytes: None,
            ready_s: 0.08,
            launch_s: 0.08,
            issued_s: None,
            start_s: 0.1,
            finish_s: 0.4,
            link_s: None,
        };
        let rank0 = spans(0.0, std::slice::from_ref(&bucket));
        let mut rank1 = spans(-0.005, &[]);
        rank1.buckets = vec![BucketProfile {
            start_s: 0.095,
            finish_s: 0.395,
            ..bucket.clone()
        }];
        // what rank 1 sends over the wire, and what rank 0 rebuilds from it
        let mut v = vec![];
        encode(&rank1, &mut v);
        let rebuilt = rank_profile(1, &v, &rank0.buckets);
        assert_eq!(rebuilt.rank, 1);
        assert!((rebuilt.waited_until() - 0.395).abs() < 1e-12, "{rebuilt:?}");
        // the replay of the two ranks predicts the recorded step (~0.42 s), not the wait twice
        let profile = StepProfile {
            version: crate::overlap::PROFILE_VERSION,
            world_size: 2,
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 25.0,
            activation_checkpointing: 0,
            // an f32 all-reduce
            policy: Some(crate::overlap::ProfilePolicy {
                name: "allreduce".into(),
                wire: Some(crate::policy::WireModel::AllReduce { bytes_per_element: 4.0 }),
                after_step: None,
            }),
            run: None,
            params: vec![ParamProfile {
                name: "w".into(),
                bytes: 4 << 20,
                shape: vec![],
            }],
            ranks: vec![rank0, rebuilt],
        };
        let rc = ReplayConfig {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 25.0,
            link: LinkCost::Measured,
            world_size: None,
            order: BucketOrder::Ready,
        };
        let step = replay(&profile, &rc).unwrap().predicted_step_s;
        assert!(
            (step - 0.42).abs() < 0.02,
            "predicted {step} s for a recorded 0.42 s step"
        );
    }
}
