//! The step profile: what one recorded training step tells the overlap model.
//!
//! Schema (JSON through serde; `version` is [`PROFILE_VERSION`]); every time is in seconds from
//! the start of that rank's step:
//!
//! ```text
//! { "version": 2, "world_size": 2, "bucket_cap_mb": 25.0, "first_bucket_cap_mb": 1.0,
//!   "policy": { "name": "fp16", "wire": { "kind": "all_reduce", "bytes_per_element": 2.0 },
//!               "after_step": { "op": "all_reduce", "bytes_per_element": 4.0, "every": 10 } },
//!   "params": [ { "name": "layers.0.weight", "bytes": 1048576, "shape": [512, 512] }, ... ],
//!   "ranks": [ { "rank": 0,
//!                "backward_start_s": 0.010, "backward_end_s": 0.031,   // compute only
//!                "optimizer_start_s": 0.034, "optimizer_end_s": 0.036, "step_end_s": 0.036,
//!                "grad_ready_s": [0.030, 0.029, ...],                  // per parameter
//!                "policy_s": { "reduce_s": 0.001, "after_step_s": 0.0004,
//!                              "after_step_link_s": 0.0, "in_flight_until_s": 0.012 },
//!                "buckets": [ { "params": [3, 2], "bytes": 4096, "wire_bytes": 2048.0,
//!                               "ready_s": 0.021, "launch_s": 0.021, "start_s": 0.021,
//!                               "finish_s": 0.024, "link_s": 0.0025 } ],
//!                "gathers": [ { "unit": "blocks.1", "bytes": 65536, "phase": "forward",
//!                               "issued_s": 0.002, "needed_s": 0.004, "start_s": 0.002,
//!                               "finish_s": 0.003 } ] } ] }
//! ```
//!
//! `policy` (which reducer policy made the step, and how its collectives are costed: see
//! [`WireModel`]), `shape` and `wire_bytes` (what the rank sent for the bucket under the ring
//! algorithms) are absent from profiles written before policies were recorded: those replay as
//! the f32 all-reduce they were.
//!
//! Version 2 adds what the policy computes itself: each bucket's `link_s` (the seconds its
//! collectives held the link, each as its comm-level work reports it: a simulated link's slot,
//! not the continuations after it; the rest of `start_s..finish_s` is the policy's own
//! compute between them, which the replay charges beside the priced collectives), each rank's
//! `policy_s` (the seconds inside the policy's `reduce`, within backward, and inside its
//! `after_step`, within the optimizer span, with the part of it its collectives held the comm
//! stream) and the policy's `after_step` wire (what it sends after the step, every how many
//! steps). Version 1 profiles, without them, are read as before. `policy_s`'s
//! `in_flight_until_s` (when the after-step collectives of earlier steps left the comm stream,
//! absent when none held it in the step) and the after-step wire's `parts` (each fragment's
//! share of the parameters) are absent from profiles written before them: those replay as before.
//!
//! `control` (absent when none was recorded) lists the collectives the training step issues
//! itself, outside DDP's buckets and the policy (the ranks' agreement on the loss, between the
//! last bucket and the optimizer): `{ "op": "all_reduce", "bytes": 12, "link_s": 4.0e-5 }`, with
//! the seconds it held a simulated link (0 on a link that was not simulated), so that the replay
//! prices it on another link and world. Its `finish_s` (when it finished on the rank's clock,
//! an instant every rank shares: [`StepProfile::clock_offsets`]) is absent from profiles written
//! before it was recorded: those take the ranks' clocks from their buckets as before.
//!
//! `gathers` (absent unless the policy shards the parameters: ZeRO-3) lists the all-gathers of a
//! unit's parameters in issue order: the unit, the gathered buffer's bytes, the pass it served,
//! when it was issued (before `needed_s` when prefetched), when the compute needed it (the
//! unit's scope was entered, backward reached the unit; absent for a prefetch the pass never
//! used) and when it ran on the link.
//!
//! `backward_end_s` is when the last backward kernel finished, before the reducer waited for
//! its buckets; the recorded buckets (what ran, under the recorded caps) let the model fit the
//! link (`LinkCost::Measured`) and be checked against what happened.

use serde::{Deserialize, Serialize};

use std::time::Instant;

use crate::policy::{AfterStepWire, GatherPhase, GatherTimes, WireModel, WireOp};
use crate::{DdpError, MemoryReport, PassTimes};

/// Latest time a profile may hold, in seconds from a step's start (a step of over 11 days is
/// not a recording).
const MAX_TIME_S: f64 = 1e6;

/// A time for an error line: as written in plain form between 1e-6 and 1e9 (and 0), in
/// exponent form outside (`1e300`, `-2.5e-12`), never three hundred digits.
fn short(t: f64) -> String {
    if t == 0.0 || !t.is_finite() || (1e-6..1e9).contains(&t.abs()) {
        format!("{t}")
    } else {
        format!("{t:e}")
    }
}
/// Most bytes one parameter's gradient may have (1 TiB): sums of them stay far from overflow.
const MAX_PARAM_BYTES: usize = 1 << 40;

/// Version of the profile schema this build writes; it reads it and every earlier one.
pub const PROFILE_VERSION: u32 = 2;

/// One parameter of the model, in registration order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamProfile {
    /// PyTorch-style name (`layers.0.weight`).
    pub name: String,
    /// Bytes of its gradient in a bucket.
    pub bytes: usize,
    /// Its shape (empty when not recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shape: Vec<usize>,
}

/// Which reducer policy recorded a step profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfilePolicy {
    /// Its name (`allreduce`, `fp16`, `powersgd:4@10`, `zero1`, a user's).
    pub name: String,
    /// How its collectives are costed; `None`: a user's policy the overlap model cannot replay.
    pub wire: Option<WireModel>,
    /// What it sends after each optimizer step (`None`: nothing, or a version 1 profile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_step: Option<AfterStepWire>,
}

/// What ran in a recorded step beside its times: what a plan needs to predict the memory of
/// another configuration of the same run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileRun {
    /// The model's name (`mlp`, `gpt`, a user's).
    pub model: String,
    /// The model's shape as its checkpoint records it (`model_config`, a JSON object); `None`:
    /// the run did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_config: Option<String>,
    /// Rows of one microbatch on one rank.
    pub rows: usize,
    /// Optimizer values kept per parameter (AdamW 2, SGD with momentum 1, plain SGD 0).
    pub optimizer_state_per_param: u64,
    /// The parameters' precision: `f32`, `bf16` or `fp16`.
    pub precision: String,
    /// What rank 0 measured in the step (its activations and peak included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryReport>,
    /// The command line that ran it, when a program says (the `brigade` binary's argv); empty
    /// from the library.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
}

/// One bucket's collective as it ran in the recorded step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketProfile {
    /// Its parameters (registration indices), in bucket order.
    pub params: Vec<usize>,
    /// Bytes of its buffer (padding included).
    pub bytes: usize,
    /// Bytes this rank sent on the wire for it (every collective its policy issued for it, ring
    /// algorithms); absent in profiles written before policies were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wire_bytes: Option<f64>,
    /// When its last gradient became ready.
    pub ready_s: f64,
    /// When the reducer issued its collective (strict bucket order may delay it past `ready_s`).
    pub launch_s: f64,
    /// When the policy's `reduce` returned, its compute before its collectives done (a top-k
    /// selection, packing signs); absent in profiles written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued_s: Option<f64>,
    /// When it started on the link (every rank had joined and the link was free).
    pub start_s: f64,
    /// When it finished.
    pub finish_s: f64,
    /// Seconds its collectives held the link (absent before version 2), each its comm-level
    /// work's span (a simulated link's slot): the rest of `start_s..finish_s` is the policy's
    /// own compute between and after them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_s: Option<f64>,
}

impl BucketProfile {
    /// The policy's compute before the bucket's collectives, inside its `reduce` (0 when not
    /// recorded).
    pub fn reduce_s(&self) -> f64 {
        self.issued_s.map_or(0.0, |_| self.issued_by() - self.launch_s)
    }

    /// The policy's own compute between and after the bucket's collectives, once it had issued
    /// them (0 when not recorded).
    pub fn policy_compute_s(&self) -> f64 {
        self.policy_compute_after(None)
    }

    /// [`BucketProfile::policy_compute_s`] less what it waited for `before` (the bucket before
    /// it on the same rank): the continuations of a rank's collectives run one after another
    /// on one thread, so a bucket whose collectives left the link while the previous bucket's
    /// continuation still ran began its own at that one's finish. Only for a bucket whose
    /// start is its own (not a chain's, see `BucketProfile::issued_by`).
    pub fn policy_compute_after(&self, before: Option<&BucketProfile>) -> f64 {
        self.link_s.map_or(0.0, |l| {
            let left = self.start_s.max(self.issued_by()) + l;
            let from = match before {
                Some(b) if self.start_s >= self.launch_s => left.max(b.finish_s),
                _ => left,
            };
            (self.finish_s - from).max(0.0)
        })
    }

    /// When the policy had issued the bucket's collectives: when its `reduce` returned, or when
    /// they started on the link if that came first. A collective starts only once this rank
    /// issued it, so what `reduce` spent after the start (its thread kept from returning, on
    /// busy cores by the transfer it set off) was not compute before it. A start before the
    /// bucket was handed over is an earlier bucket's (a chained policy's collectives are
    /// counted from the chain's first) and bounds nothing.
    fn issued_by(&self) -> f64 {
        let issued = self.issued_s.unwrap_or(self.launch_s).max(self.launch_s);
        if self.start_s >= self.launch_s {
            issued.min(self.start_s)
        } else {
            issued
        }
    }
}

/// What one rank's policy computed itself in the recorded step (version 2).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PolicyTimes {
    /// Seconds inside its `reduce`, summed over the buckets (within backward's span).
    pub reduce_s: f64,
    /// Seconds inside its `after_step` (within the optimizer's span).
    pub after_step_s: f64,
    /// The part of `after_step_s` its collectives held the comm stream.
    pub after_step_link_s: f64,
    /// When the collectives it issued in earlier steps' `after_step` left the comm stream, when
    /// that was within this step (absent: none was on it then). The step's own collectives
    /// (its buckets, the ranks' agreement after backward) queued behind them: the replay
    /// charges that wait as the priced share of the after-step collectives instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight_until_s: Option<f64>,
}

/// One all-gather of a unit's parameters (ZeRO-3) as it ran in the recorded step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GatherProfile {
    /// The unit (its scope: `blocks.0`).
    pub unit: String,
    /// Bytes of the gathered buffer (every rank's shard, padding included).
    pub bytes: usize,
    /// The pass it served.
    pub phase: GatherPhase,
    /// When it was issued on the comm stream.
    pub issued_s: f64,
    /// When the compute needed it; absent for a prefetch the pass never used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needed_s: Option<f64>,
    /// When it started on the link.
    pub start_s: f64,
    /// When it finished.
    pub finish_s: f64,
}

impl GatherProfile {
    /// What the compute waited for it: from when it was needed to when it finished.
    pub fn waited_s(&self) -> f64 {
        self.needed_s.map_or(0.0, |n| (self.finish_s - n).max(0.0))
    }
}

/// One rank's view of the recorded step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankProfile {
    /// The rank.
    pub rank: usize,
    /// When backward began.
    pub backward_start_s: f64,
    /// When backward's compute ended (before waiting for the buckets).
    pub backward_end_s: f64,
    /// When the optimizer step began.
    pub optimizer_start_s: f64,
    /// When the optimizer step ended.
    pub optimizer_end_s: f64,
    /// When the step ended.
    pub step_end_s: f64,
    /// When each parameter's gradient became final, by registration index.
    pub grad_ready_s: Vec<f64>,
    /// The buckets as they ran.
    pub buckets: Vec<BucketProfile>,
    /// The parameter gathers as they ran, in issue order (ZeRO-3; empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gathers: Vec<GatherProfile>,
    /// What the policy computed itself (absent before version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_s: Option<PolicyTimes>,
    /// The step's own collectives beside DDP's and the policy's (the ranks' agreement on the
    /// loss), in issue order; absent when none was recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub control: Vec<ControlProfile>,
}

/// One collective the training step issues itself, between the buckets and the optimizer (the
/// ranks' agreement on the loss): the replay prices it on the replayed link and world.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlProfile {
    /// The collective.
    pub op: WireOp,
    /// Bytes of the buffer each rank handed in.
    pub bytes: usize,
    /// Seconds it held the link as the run's link priced it: the simulated link's ring time, 0
    /// on a link that was not simulated (its time is then in the recorded span).
    pub link_s: f64,
    /// When it finished, on the rank's step clock: a simulated link's slot finish (the same
    /// instant on every rank: a blocking collective every rank leaves together), else the
    /// instant it returned. Absent from profiles written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_s: Option<f64>,
}

/// One recorded step on every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepProfile {
    /// Schema version ([`PROFILE_VERSION`]).
    pub version: u32,
    /// Ranks in the recorded run.
    pub world_size: usize,
    /// The bucket cap the step ran with, in MiB.
    pub bucket_cap_mb: f64,
    /// The first bucket's cap the step ran with, in MiB.
    pub first_bucket_cap_mb: f64,
    /// Every how many blocks the model checkpointed its activations (0: none; absent in
    /// profiles that do not record it), so that the recompute inside backward is not read as
    /// a slower backward.
    #[serde(default)]
    pub activation_checkpointing: usize,
    /// The reducer policy that made the step (absent: recorded before policies were; an f32
    /// all-reduce).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<ProfilePolicy>,
    /// What ran: the model, its batch, its optimizer, its precision and the memory rank 0
    /// measured in the step (absent in profiles written before runs were recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<ProfileRun>,
    /// The model's parameters in registration order.
    pub params: Vec<ParamProfile>,
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankProfile>,
}

impl RankProfile {
    /// When the rank's wait for its buckets ended: its last bucket's finish (or backward's end).
    pub fn waited_until(&self) -> f64 {
        self.buckets
            .iter()
            .map(|b| b.finish_s)
            .fold(self.backward_end_s, f64::max)
    }

    /// One rank's profile of a step from DDP's [`PassTimes`] of its synchronized backward, its
    /// parameter gathers and the training loop's instants, in seconds from `step_start`. `None`
    /// when the pass did not run to its end.
    pub fn from_pass(
        rank: usize,
        step_start: Instant,
        pass: &PassTimes,
        gathers: &[GatherTimes],
        optimizer: (Instant, Instant),
        step_end: Instant,
    ) -> Option<RankProfile> {
        let secs = |t: Instant| t.saturating_duration_since(step_start).as_secs_f64();
        let (started, compute_end) = (pass.started?, pass.compute_end?);
        let grad_ready_s: Vec<f64> = pass.grad_ready.iter().map(|t| secs(t.unwrap_or(started))).collect();
        let buckets = pass
            .buckets
            .iter()
            .map(|b| {
                let launch_s = secs(b.launched);
                let (start, finish) = b.ran.map_or((launch_s, launch_s), |(s, f)| (secs(s), secs(f)));
                BucketProfile {
                    params: b.params.clone(),
                    bytes: b.bytes,
                    wire_bytes: Some(b.wire_bytes),
                    ready_s: b.params.iter().map(|&p| grad_ready_s[p]).fold(0.0, f64::max),
                    launch_s,
                    issued_s: Some(secs(b.issued)),
                    start_s: start,
                    finish_s: finish,
                    link_s: b.ran.map(|_| b.link_s),
                }
            })
            .collect();
        let gathers = gathers
            .iter()
            .map(|g| {
                let issued_s = secs(g.issued);
                let (start_s, finish_s) = g.ran.map_or((issued_s, issued_s), |(s, f)| (secs(s), secs(f)));
                GatherProfile {
                    unit: g.unit.clone(),
                    bytes: g.bytes,
                    phase: g.phase,
                    issued_s,
                    needed_s: g.needed.map(secs),
                    start_s,
                    finish_s,
                }
            })
            .collect();
        Some(RankProfile {
            rank,
            backward_start_s: secs(started),
            backward_end_s: secs(compute_end),
            optimizer_start_s: secs(optimizer.0),
            optimizer_end_s: secs(optimizer.1),
            step_end_s: secs(step_end),
            grad_ready_s,
            buckets,
            gathers,
            policy_s: Some(PolicyTimes {
                reduce_s: pass.reduce_s,
                after_step_s: pass.after_step.map_or(0.0, |a| a.0),
                after_step_link_s: pass.after_step.map_or(0.0, |a| a.1),
                in_flight_until_s: pass.earlier_after_step_left.filter(|&t| t > step_start).map(secs),
            }),
            control: vec![],
        })
    }
}

impl StepProfile {
    /// The last rank's end of backward compute on rank 0's clock, given the ranks' `offsets`
    /// ([`StepProfile::clock_offsets`]).
    pub(crate) fn backward_end_at(&self, offsets: &[f64]) -> f64 {
        self.ranks
            .iter()
            .zip(offsets)
            .map(|(r, o)| r.backward_end_s - o)
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// What the recorded step waited for its buckets after backward's compute ended, in
    /// seconds on rank 0's clock (the measured counterpart of the replay's wait): the last
    /// bucket's finish minus the last rank's end of backward. `None` without buckets.
    pub fn waited_s(&self) -> Option<f64> {
        let offsets = self.clock_offsets();
        let end = self.backward_end_at(&offsets);
        let finish = self
            .ranks
            .iter()
            .zip(&offsets)
            .flat_map(|(r, o)| r.buckets.iter().map(move |b| b.finish_s - o))
            .fold(f64::NEG_INFINITY, f64::max);
        (finish.is_finite() && end.is_finite()).then(|| (finish - end).max(0.0))
    }

    /// What the compute waited for its parameter gathers (ZeRO-3) in the recorded step: each
    /// rank's sum, the mean over the ranks (0 without gathers).
    pub fn gather_waited_s(&self) -> f64 {
        let sum: f64 = self
            .ranks
            .iter()
            .map(|r| r.gathers.iter().map(GatherProfile::waited_s).sum::<f64>())
            .sum();
        sum / self.ranks.len().max(1) as f64
    }

    /// How far each rank's clock runs ahead of rank 0's, in seconds: a time `t` in rank `r`'s
    /// entry is `t - offsets[r]` on rank 0's clock. Every rank stamps its times from the start of
    /// its own step, and the steps do not start together (each rank starts its next step after
    /// its own optimizer, and ranks sharing cores start them far apart): the offsets come from an
    /// instant every rank shares. The ranks' agreement on the loss, a blocking collective every
    /// rank leaves together, gives one when every rank recorded its finish
    /// ([`ControlProfile::finish_s`]); a bucket's start does not always (a chained policy's
    /// bucket, PowerSGD's, starts on each rank when its own previous chain ended). Without it, a
    /// collective starts on the link at one instant on every rank: the offset is the median over
    /// the buckets both ranks recorded of the difference of their starts. A rank with neither
    /// gets 0.
    pub fn clock_offsets(&self) -> Vec<f64> {
        match self.agreement_finishes() {
            Some(ends) => ends.iter().map(|e| e - ends[0]).collect(),
            None => self.bucket_start_offsets(),
        }
    }

    /// Whether [`StepProfile::clock_offsets`] come from the ranks' agreement on the loss (every
    /// rank recorded its finish), not from the buckets' starts.
    pub fn agreed_clocks(&self) -> bool {
        self.agreement_finishes().is_some()
    }

    /// Each rank's finish of the agreement on the loss, when every rank recorded it.
    fn agreement_finishes(&self) -> Option<Vec<f64>> {
        let finish = |r: &RankProfile| r.control.first().and_then(|c| c.finish_s);
        self.ranks.iter().map(finish).collect()
    }

    /// [`StepProfile::clock_offsets`] from the buckets' starts alone.
    fn bucket_start_offsets(&self) -> Vec<f64> {
        let zero = self.ranks.first().map(|r| &r.buckets[..]).unwrap_or(&[]);
        self.ranks
            .iter()
            .map(|r| {
                let mut d: Vec<f64> = r
                    .buckets
                    .iter()
                    .zip(zero)
                    // a start before the bucket was handed over is not its collective's (a
                    // chained policy's wait for the previous step's last bucket)
                    .filter(|(b, b0)| b.params == b0.params && b.start_s >= b.launch_s && b0.start_s >= b0.launch_s)
                    .map(|(b, b0)| b.start_s - b0.start_s)
                    .collect();
                if d.is_empty() {
                    return 0.0;
                }
                d.sort_by(f64::total_cmp);
                let m = d.len() / 2;
                if d.len() % 2 == 1 {
                    d[m]
                } else {
                    0.5 * (d[m - 1] + d[m])
                }
            })
            .collect()
    }

    /// Checks what the replay relies on; the message names the first problem.
    pub fn validate(&self) -> Result<(), DdpError> {
        self.check().map_err(DdpError::Replay)
    }

    fn check(&self) -> Result<(), String> {
        self.check_header()?;
        self.check_policy()?;
        for (i, r) in self.ranks.iter().enumerate() {
            self.check_rank(i, r)?;
        }
        Ok(())
    }

    /// The version, the world, the caps and the parameters.
    fn check_header(&self) -> Result<(), String> {
        if self.version == 0 || self.version > PROFILE_VERSION {
            return Err(format!(
                "profile schema version {} (this build reads versions 1 to {PROFILE_VERSION})",
                self.version
            ));
        }
        if self.ranks.is_empty() || self.ranks.len() != self.world_size {
            return Err(format!(
                "world_size {} but {} rank entries",
                self.world_size,
                self.ranks.len()
            ));
        }
        if self.params.is_empty() {
            return Err("no parameters".into());
        }
        for (flag, v) in [
            ("bucket_cap_mb", self.bucket_cap_mb),
            ("first_bucket_cap_mb", self.first_bucket_cap_mb),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(format!("{flag} must be a positive number of MiB, got {v}"));
            }
        }
        if let Some((i, p)) = self.params.iter().enumerate().find(|(_, p)| p.bytes > MAX_PARAM_BYTES) {
            return Err(format!(
                "parameter {i} ({}) has {} bytes, more than {MAX_PARAM_BYTES}",
                p.name, p.bytes
            ));
        }
        Ok(())
    }

    /// The policy's wire model fits the parameters and sends a sane number of bytes.
    fn check_policy(&self) -> Result<(), String> {
        let per_element = |b: f64| b > 0.0 && b <= 8.0;
        let policy = self.policy.as_ref();
        match policy.and_then(|p| p.wire.as_ref()) {
            Some(&WireModel::AllReduce { bytes_per_element: b }) if !per_element(b) => Err(format!(
                "the policy's wire model sends {b} bytes per gradient element: it must be more than 0 and at most 8"
            )),
            Some(&WireModel::AllGather {
                bytes_per_element: b,
                bytes_per_bucket: c,
                density: d,
            }) if !(b > 0.0 && b <= 16.0 && d > 0.0 && d <= 1.0 && (0.0..=MAX_PARAM_BYTES as f64).contains(&c)) => {
                Err(format!(
                    "the policy's all-gather wire model sends a fraction {d} of the elements, {b} bytes each, and {c} \
                     per bucket: the fraction in (0, 1], more than 0 and at most 16 bytes each, at least 0 per bucket"
                ))
            }
            Some(WireModel::LowRank { factors, .. }) if factors.len() != self.params.len() => Err(format!(
                "the policy's low-rank wire model sizes {} parameters' factors, the profile has {} parameters",
                factors.len(),
                self.params.len()
            )),
            _ => match policy.and_then(|p| p.after_step.as_ref()) {
                Some(a)
                    if !(per_element(a.bytes_per_element) && a.every > 0 && a.fragments > 0 && a.collectives > 0) =>
                {
                    Err(format!(
                        "the policy's after-step wire sends {} bytes per element every {} steps in {} fragments of {} \
                         collectives: more than 0 and at most 8 bytes, every 1 step or more, 1 fragment or more, 1 \
                         collective or more",
                        a.bytes_per_element, a.every, a.fragments, a.collectives
                    ))
                }
                _ => Ok(()),
            },
        }
    }

    /// One rank's entry: its times, its buckets and gathers, the same collectives as rank 0's.
    fn check_rank(&self, i: usize, r: &RankProfile) -> Result<(), String> {
        if r.rank != i {
            return Err(format!("rank entry {i} says rank {}", r.rank));
        }
        if r.grad_ready_s.len() != self.params.len() {
            return Err(format!(
                "rank {i}: {} ready times for {} parameters",
                r.grad_ready_s.len(),
                self.params.len()
            ));
        }
        if let Some((what, t)) = r.times().find(|(_, t)| !(0.0..=MAX_TIME_S).contains(t)) {
            return Err(format!(
                "rank {i}: {what} is {}: a time is negative, not finite or past {MAX_TIME_S} s",
                short(t)
            ));
        }
        if r.backward_end_s < r.backward_start_s || r.optimizer_end_s < r.optimizer_start_s {
            return Err(format!("rank {i}: a span ends before it starts"));
        }
        let mut seen = vec![false; self.params.len()];
        for (k, b) in r.buckets.iter().enumerate() {
            self.check_bucket(b, &mut seen)
                .map_err(|e| format!("rank {i}: bucket {k} {e}"))?;
        }
        if let Some(k) = r
            .control
            .iter()
            .position(|c| c.bytes > MAX_PARAM_BYTES || !(0.0..=MAX_TIME_S).contains(&c.link_s))
        {
            return Err(format!(
                "rank {i}: control collective {k} has {} bytes and {} s on the link",
                r.control[k].bytes,
                short(r.control[k].link_s)
            ));
        }
        if let Some(k) = r.gathers.iter().position(|g| g.finish_s < g.start_s) {
            return Err(format!("rank {i}: gather {k} finishes before it starts"));
        }
        let g0 = &self.ranks[0].gathers;
        if r.gathers.len() != g0.len() || r.gathers.iter().zip(g0).any(|(g, h)| g.unit != h.unit) {
            return Err(format!(
                "rank {i}'s parameter gathers differ from rank 0's (every rank runs the same collectives)"
            ));
        }
        let zero = &self.ranks[0].buckets;
        if !r.buckets.is_empty()
            && !zero.is_empty()
            && (r.buckets.len() != zero.len() || r.buckets.iter().zip(zero).any(|(b, b0)| b.params != b0.params))
        {
            return Err(format!(
                "rank {i}'s buckets differ from rank 0's (every rank runs the same collectives)"
            ));
        }
        Ok(())
    }

    /// One bucket: its parameters exist and are in no other bucket (`seen`), its bytes are
    /// theirs, it finishes after it starts.
    fn check_bucket(&self, b: &BucketProfile, seen: &mut [bool]) -> Result<(), String> {
        if b.params.iter().any(|&p| p >= self.params.len()) {
            return Err(format!("names a parameter past {}", self.params.len()));
        }
        if let Some(&p) = b.params.iter().find(|&&p| std::mem::replace(&mut seen[p], true)) {
            return Err(format!("holds parameter {p}, which is in another bucket"));
        }
        // ZeRO pads a bucket to a multiple of the world size: a few elements per rank
        let bytes: usize = b.params.iter().map(|&p| self.params[p].bytes).sum();
        if b.bytes < bytes || b.bytes - bytes > 16 * self.world_size {
            return Err(format!("says {} bytes, its parameters hold {bytes}", b.bytes));
        }
        if b.finish_s < b.start_s {
            return Err("finishes before it starts".into());
        }
        Ok(())
    }
}

impl RankProfile {
    /// Every time the entry holds, each with what it is (for the range check).
    fn times(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        let spans = [
            ("backward_start_s", self.backward_start_s),
            ("backward_end_s", self.backward_end_s),
            ("optimizer_start_s", self.optimizer_start_s),
            ("optimizer_end_s", self.optimizer_end_s),
            ("step_end_s", self.step_end_s),
        ];
        let ready = self.grad_ready_s.iter().map(|&t| ("grad_ready_s", t));
        let buckets = self.buckets.iter().flat_map(|b| {
            [
                ("a bucket's ready_s", b.ready_s),
                ("a bucket's launch_s", b.launch_s),
                ("a bucket's issued_s", b.issued_s.unwrap_or(b.launch_s)),
                ("a bucket's start_s", b.start_s),
                ("a bucket's finish_s", b.finish_s),
                ("a bucket's link_s", b.link_s.unwrap_or(0.0)),
            ]
        });
        let gathers = self.gathers.iter().flat_map(|g| {
            [
                ("a gather's issued_s", g.issued_s),
                ("a gather's needed_s", g.needed_s.unwrap_or(g.issued_s)),
                ("a gather's start_s", g.start_s),
                ("a gather's finish_s", g.finish_s),
            ]
        });
        let policy = self.policy_s.iter().flat_map(|p| {
            [
                ("the policy's reduce_s", p.reduce_s),
                ("the policy's after_step_s", p.after_step_s),
                ("the policy's after_step_link_s", p.after_step_link_s),
                ("the policy's in_flight_until_s", p.in_flight_until_s.unwrap_or(0.0)),
            ]
        });
        let control = self
            .control
            .iter()
            .map(|c| ("a control collective's finish_s", c.finish_s.unwrap_or(0.0)));
        spans
            .into_iter()
            .chain(ready)
            .chain(buckets)
            .chain(gathers)
            .chain(policy)
            .chain(control)
    }
}
