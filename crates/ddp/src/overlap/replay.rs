//! Replaying a recorded step's communication under another bucket cap, link or world size,
//! with the collectives of the reducer policy that recorded it ([`WireModel`]).

use brigade_comm::{NetModel, RingOp};
use serde::Serialize;

use super::{BucketProfile, RankProfile, RingPrice, StepProfile, WireModel};
use crate::policy::GatherPhase;
use crate::{assign_buckets, DdpError};

/// How a collective of `S` bytes over `n` ranks is costed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LinkCost {
    /// The ring collectives over links of latency α and bandwidth B, as the simulated network
    /// sleeps them ([`brigade_comm::cost`]).
    Ring(NetModel),
    /// The same formula with α and B fitted (least squares) to the durations of the buckets the
    /// profile recorded, so the replay answers for the link the run really had.
    Measured,
}

/// The order in which parameters fill buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BucketOrder {
    /// Rank 0's recorded ready order: what DDP uses once it has rebuilt its buckets after the
    /// first iteration.
    #[default]
    Ready,
    /// Reverse registration order: DDP's first iteration, or a run with rebuilding off.
    Reverse,
}

impl BucketOrder {
    /// The order `profile`'s run filled its buckets in: reverse registration order when its
    /// buckets were never regrouped (a policy whose layout forbids it, ZeRO; or a first
    /// iteration), else the ready order DDP rebuilds them in. Both agree when the gradients
    /// became ready in reverse registration order.
    pub fn recorded(profile: &StepProfile) -> BucketOrder {
        let Some(rank) = profile.ranks.first() else {
            return BucketOrder::Ready;
        };
        let recorded = rank.buckets.iter().flat_map(|b| b.params.iter().copied());
        if recorded.eq((0..profile.params.len()).rev()) {
            BucketOrder::Reverse
        } else {
            BucketOrder::Ready
        }
    }
}

/// What to replay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayConfig {
    /// Cap of every bucket but the first, in MiB.
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, in MiB.
    pub first_bucket_cap_mb: f64,
    /// How collectives are costed.
    pub link: LinkCost,
    /// Ranks to cost the collectives for (default: the recorded world size). The compute is the
    /// recorded ranks' (a larger group is assumed to compute like them).
    pub world_size: Option<usize>,
    /// Bucket order.
    pub order: BucketOrder,
}

/// One bucket of the replayed step. Times in seconds from the step's start.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayBucket {
    /// Its parameters (registration indices), in bucket order.
    pub params: Vec<usize>,
    /// Bytes of its gradients.
    pub bytes: usize,
    /// Bytes each rank sends for it under the policy's collectives (ring algorithms).
    pub wire_bytes: f64,
    /// When its last gradient is ready on the last rank to have it.
    pub ready_s: f64,
    /// When the last rank issued it (strict bucket order: never before the previous bucket).
    pub launch_s: f64,
    /// When it starts on the link: every rank has issued it, the backend has brought it to the
    /// link (the launch overhead fitted from the profile) and the link is free.
    pub start_s: f64,
    /// When it finishes on every rank: its collectives left the link, then the policy's compute
    /// after them (which does not hold the link: the next bucket's collective runs beside it).
    pub finish_s: f64,
    /// The part of its transfer after backward's compute ended (what the step waits for).
    pub exposed_s: f64,
}

/// One parameter gather of the replayed step (ZeRO-3). Times in seconds from the step's start,
/// on rank 0's clock.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayGather {
    /// The unit gathered.
    pub unit: String,
    /// The pass it serves.
    pub phase: GatherPhase,
    /// Bytes of the gathered buffer (padded to the replayed world).
    pub bytes: usize,
    /// When the last rank issued it.
    pub issued_s: f64,
    /// When it starts on the link.
    pub start_s: f64,
    /// When it finishes.
    pub finish_s: f64,
    /// What the compute waited for it (mean over the ranks).
    pub waited_s: f64,
}

/// The replayed step under one configuration. Times in seconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayResult {
    /// The reducer policy replayed (the profile's).
    pub policy: String,
    /// The bucket cap replayed, in MiB.
    pub bucket_cap_mb: f64,
    /// The first bucket's cap replayed, in MiB.
    pub first_bucket_cap_mb: f64,
    /// Ranks the collectives were costed for.
    pub world_size: usize,
    /// The buckets in launch order.
    pub buckets: Vec<ReplayBucket>,
    /// The step without communication: backward's compute, then what followed the buckets as
    /// recorded (the loss agreement, the optimizer), on the slowest rank.
    pub compute_step_s: f64,
    /// The predicted step: the optimizer waits for the last bucket (slowest rank).
    pub predicted_step_s: f64,
    /// Sum of the buckets' times on the comm stream (their collectives and the policy's own
    /// compute between them).
    pub comm_s: f64,
    /// The part of `comm_s` that is the policy's own compute between its collectives, as
    /// recorded (rank 0's per byte of bucket; a low-rank policy's, the slowest rank's recorded
    /// for each bucket on a priced link; 0 for a profile that did not record it).
    pub policy_compute_s: f64,
    /// What a step waits, on average, for the policy's after-step collectives, priced on the
    /// replayed link and world: each fragment's less the compute it runs behind, a step's share
    /// of them (0 for a policy that sends nothing after the step).
    pub after_step_comm_s: f64,
    /// The step's own collectives after its buckets ([`RankProfile::control`]: the ranks'
    /// agreement on the loss), priced on the replayed link and world, mean over the ranks: part
    /// of `predicted_step_s`, in no bucket.
    pub agreement_comm_s: f64,
    /// Communication left after the last rank's backward compute ended.
    pub exposed_comm_s: f64,
    /// The exposed communication if every byte could leave the moment its gradient was ready
    /// (no buckets, no latency, no launch): no cap can do better; a bound on `exposed_comm_s`,
    /// not on the step.
    pub lower_bound_exposed_s: f64,
    /// The launch overhead the replay charged (see [`LaunchOverhead`]).
    pub launch_overhead: LaunchOverhead,
    /// The parameter gathers in issue order (ZeRO-3; empty for the other policies).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gathers: Vec<ReplayGather>,
    /// What the compute waited for its parameter gathers in the step (mean over the ranks; 0
    /// without gathers): the gather time prefetch did not hide.
    pub exposed_gather_s: f64,
    /// Why the recorded step was priced under another model than the policy's steady one (a
    /// PowerSGD step before its start step, priced as the plain all-reduce it ran); `None`
    /// when it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wire_note: Option<String>,
}

/// What it costs the backend to bring a collective onto the link once the last rank has issued
/// it (and the backend has brought the previous one: it runs them in order). In the thread
/// backend this is the comm threads' wake-up and queue (the simulated link starts a slot when
/// the last rank's comm thread takes the collective up); on a real network, the launch and the
/// late ranks' scheduling. Both compete with backward for the cores, so the
/// cost is fitted apart for collectives brought while backward still computed on some rank and
/// for those brought after: from the recorded buckets that started on an idle link, the time
/// from when the last rank issued them (or the previous bucket started, if later) to their
/// start; least squares, both terms ≥ 0. A regime with no such bucket borrows the other's;
/// zero when neither has one.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LaunchOverhead {
    /// Brought while backward still computes.
    pub during_backward: LaunchCost,
    /// Brought after backward's compute ended on every rank.
    pub after_backward: LaunchCost,
}

/// One regime of [`LaunchOverhead`]: `fixed_s + bytes · per_byte_s`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LaunchCost {
    /// Seconds per collective.
    pub fixed_s: f64,
    /// Seconds per byte.
    pub per_byte_s: f64,
}

impl LaunchOverhead {
    /// Fits the overhead to the recorded buckets of every profile in `profiles` at once (the
    /// backend's cost is the machine's, not the cap's: profiles recorded under small caps
    /// measure it during backward, under large caps after). Profiles that do not validate or
    /// recorded one rank are skipped.
    pub fn fit(profiles: &[&StepProfile]) -> LaunchOverhead {
        let mut samples = Samples::default();
        for p in profiles.iter().filter(|p| p.world_size > 1 && p.validate().is_ok()) {
            let offsets = p.clock_offsets();
            overhead_samples(p, &offsets, p.backward_end_at(&offsets), &mut samples);
        }
        fit_overhead(&samples)
    }

    /// The cost of bringing `bytes` to the link from `at`, backward's compute ending at
    /// `backward_end`.
    fn of(&self, bytes: usize, at: f64, backward_end: f64) -> f64 {
        let c = if at < backward_end - BACKWARD_END_S {
            self.during_backward
        } else {
            self.after_backward
        };
        c.fixed_s + bytes as f64 * c.per_byte_s
    }
}

/// A recorded bucket that starts more than this after the previous one finished found the link
/// idle: its start measures the launch overhead (the recorded finish can run late by a wake-up).
const IDLE_LINK_S: f64 = 250e-6;

/// The comm stream's queue as the replay moves it: the backend brings each collective to the
/// link, in order, a launch overhead after the last rank issued it (no overhead on one rank:
/// nothing is sent), and the link takes it once the previous one has left.
struct LinkQueue<'a> {
    /// When the backend brought the last collective to the link.
    brought: f64,
    /// When the link is free of the last collective.
    free: f64,
    overhead: Option<&'a LaunchOverhead>,
}

impl LinkQueue<'_> {
    /// When a collective of `bytes` that every rank had issued by `issued` starts and finishes
    /// on the link, taking it `link_s`; backward's compute ends at `backward_end`.
    fn take(&mut self, issued: f64, bytes: usize, link_s: f64, backward_end: f64) -> (f64, f64) {
        let from = issued.max(self.brought);
        self.brought = from + self.overhead.map_or(0.0, |o| o.of(bytes, from, backward_end));
        let start = self.brought.max(self.free);
        self.free = start + link_s;
        (start, self.free)
    }
}

/// A collective brought this close to backward's end counts as brought after it: the last
/// bucket is issued the moment the last gradient is ready, a few microseconds before backward's
/// compute is over.
const BACKWARD_END_S: f64 = 500e-6;

/// The launches measured in `profile`'s recorded collectives (rank 0's buckets and parameter
/// gathers), every rank's times on rank 0's clock (`offsets`, see
/// [`StepProfile::clock_offsets`]), backward ending at `backward_end`.
fn overhead_samples(profile: &StepProfile, offsets: &[f64], backward_end: f64, samples: &mut Samples) {
    let ranks = &profile.ranks;
    let mut issued = vec![f64::NEG_INFINITY; ranks.len()];
    let (during, after) = (&mut samples.0, &mut samples.1);
    // (start, finish, when the last rank issued it, bytes, whether a gather) of each collective
    let mut ops: Vec<(f64, f64, f64, usize, bool)> = vec![];
    for (k, b) in ranks[0].buckets.iter().enumerate() {
        // Each rank issues bucket k once its gradients are ready, bucket k−1 is issued and the
        // policy's `reduce` has computed what it sends.
        let mut last_issue = f64::NEG_INFINITY;
        for (r, rank) in ranks.iter().enumerate() {
            let ready = b
                .params
                .iter()
                .map(|&p| rank.grad_ready_s[p] - offsets[r])
                .fold(f64::NEG_INFINITY, f64::max);
            let reduce = rank.buckets.get(k).map_or(0.0, BucketProfile::reduce_s);
            issued[r] = issued[r].max(ready) + reduce;
            last_issue = last_issue.max(issued[r]);
        }
        ops.push((b.start_s, b.finish_s, last_issue, b.bytes, false));
    }
    for (k, g) in ranks[0].gathers.iter().enumerate() {
        let last_issue = ranks
            .iter()
            .zip(offsets)
            .filter_map(|(r, o)| r.gathers.get(k).map(|g| g.issued_s - o))
            .fold(f64::NEG_INFINITY, f64::max);
        ops.push((g.start_s, g.finish_s, last_issue, g.bytes, true));
    }
    ops.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut busy_until = f64::NEG_INFINITY;
    for (i, &(start, finish, last_issue, bytes, gather)) in ops.iter().enumerate() {
        let busy = busy_until;
        busy_until = busy_until.max(finish);
        // the link was busy until it started: the wait was the link's, not the launch's (a
        // gather is issued by the compute the moment it needs it, often just after the previous
        // one finished: it waited for the link only if it was issued before that)
        if i > 0 && start <= busy + IDLE_LINK_S && (!gather || last_issue < busy) {
            continue;
        }
        // the backend brings collectives in order: not before the previous one started
        let since = match i.checked_sub(1) {
            Some(j) => last_issue.max(ops[j].0),
            None => last_issue,
        };
        if since.is_finite() && start > since {
            let pts = if since < backward_end - BACKWARD_END_S {
                &mut *during
            } else {
                &mut *after
            };
            pts.push((bytes as f64, start - since));
        }
    }
}

/// (bytes, seconds) of the launches measured during backward, and after it.
type Samples = (Vec<(f64, f64)>, Vec<(f64, f64)>);

fn fit_overhead((during, after): &Samples) -> LaunchOverhead {
    let fit = |pts: &[(f64, f64)]| {
        (!pts.is_empty()).then(|| {
            let (fixed_s, per_byte_s) = fit_line(pts);
            LaunchCost { fixed_s, per_byte_s }
        })
    };
    match (fit(during), fit(after)) {
        (Some(d), Some(a)) => LaunchOverhead {
            during_backward: d,
            after_backward: a,
        },
        (Some(c), None) | (None, Some(c)) => LaunchOverhead {
            during_backward: c,
            after_backward: c,
        },
        (None, None) => LaunchOverhead::default(),
    }
}

/// Latency (s) and seconds per byte of the ring's links: `(α, 1/B)`.
fn link_params(profile: &StepProfile, link: LinkCost) -> Result<(f64, f64), String> {
    match link {
        LinkCost::Ring(m) => {
            if !(m.bandwidth_bytes_per_s > 0.0 && m.bandwidth_bytes_per_s.is_finite()) {
                return Err(format!(
                    "link bandwidth must be positive and finite, got {} B/s",
                    m.bandwidth_bytes_per_s
                ));
            }
            Ok((m.latency.as_secs_f64(), 1.0 / m.bandwidth_bytes_per_s))
        }
        LinkCost::Measured => {
            if profile.world_size < 2 {
                return Err("a profile of one rank recorded no communication: there is no link to measure".into());
            }
            let mut pts = vec![];
            if !link_samples(profile, &mut pts)? {
                return Err(NO_LINK_SAMPLES.into());
            }
            Ok(fit_link(&pts))
        }
    }
}

/// Why a profile measures no link: nothing it recorded crossed one.
const NO_LINK_SAMPLES: &str =
    "the profile recorded no buckets, parameter gathers or after-step collectives that crossed the link: there \
     is no link to measure";

/// The link every profile of `profiles` measured, fitted to all their recorded collectives at
/// once ([`LinkCost::Measured`] fits one profile's): a policy that communicates every few steps
/// (DiLoCo) records its collectives only in the steps that sync. `None` when none recorded any
/// of its policy's collectives on the link (the step's own, a few bytes each, measure the
/// latency, not a link the policy's collectives can be priced on).
pub fn measured_link(profiles: &[&StepProfile]) -> Result<Option<NetModel>, DdpError> {
    let mut pts = vec![];
    let mut any = false;
    for p in profiles.iter().filter(|p| p.world_size > 1) {
        p.validate()?;
        any |= link_samples(p, &mut pts).map_err(DdpError::Replay)?;
    }
    if !any {
        return Ok(None);
    }
    let (alpha, per_byte) = fit_link(&pts);
    Ok(Some(NetModel {
        latency: std::time::Duration::from_secs_f64(alpha),
        // a link fitted to no measurable byte time carries bytes for free
        bandwidth_bytes_per_s: if per_byte > 0.0 { 1.0 / per_byte } else { f64::MAX },
    }))
}

/// What `profile`'s recorded collectives took on the link, each as `(messages, link bytes,
/// seconds)` priced as the ring prices them at the recorded world size: each bucket's
/// collectives as its policy's wire model issues them (several per bucket for PowerSGD, with
/// a latency each), scaled to the bytes the bucket recorded sending; ZeRO-3's parameter
/// gathers; the step's own collectives that a simulated link timed (a few bytes each: what
/// separates the latency from the bytes when the rest is one large collective, a DiLoCo
/// sync); and the after-step collectives of a step that synced (rank 0's). Whether any of the
/// policy's collectives (not the step's own alone) were among them.
fn link_samples(profile: &StepProfile, pts: &mut Vec<(f64, f64, f64)>) -> Result<bool, String> {
    let from = pts.len();
    let n0 = profile.world_size;
    let (_, wire, _) = wire_model(profile)?;
    let param_bytes: Vec<usize> = profile.params.iter().map(|p| p.bytes).collect();
    let rank0 = &profile.ranks[0];
    // A bucket issued while the one before still held the comm stream (its continuation: the
    // policy's compute after its collectives) may have waited for it to finish: its recorded
    // collective time is then not the link's. Left out, unless that leaves no bucket.
    let waited: Vec<bool> = (0..rank0.buckets.len())
        .map(|k| {
            let (b, before) = (&rank0.buckets[k], k.checked_sub(1).map(|j| &rank0.buckets[j]));
            // it started after the previous bucket's collectives left the link, before its
            // continuation ended (one that started earlier found the link free: the previous
            // bucket's recorded finish ran a little late, as a ZeRO bucket's landing does)
            b.link_s.is_some()
                && before.is_some_and(|before| {
                    let left_link = before.finish_s - before.policy_compute_s();
                    b.start_s < before.finish_s && b.start_s >= left_link
                })
        })
        .collect();
    let all_waited = waited.iter().all(|&w| w);
    for (b, _) in rank0.buckets.iter().zip(&waited).filter(|(_, &w)| all_waited || !w) {
        let price = wire.bucket_price(&b.params, &param_bytes, n0);
        if price.messages == 0.0 {
            continue;
        }
        let scale = match b.wire_bytes {
            Some(w) if price.wire_bytes > 0.0 => w / price.wire_bytes,
            _ => 1.0,
        };
        // what its collectives held the comm stream, when recorded
        let secs = b
            .link_s
            .unwrap_or((b.finish_s - b.start_s - b.policy_compute_s()).max(0.0));
        pts.push((price.messages, price.link_bytes * scale, secs));
    }
    for g in &rank0.gathers {
        let price = RingPrice::of(RingOp::AllGather, g.bytes as f64 / n0 as f64, n0);
        pts.push((price.messages, price.link_bytes, (g.finish_s - g.start_s).max(0.0)));
    }
    let after = profile.policy.as_ref().and_then(|p| p.after_step.as_ref());
    let after_link = rank0.policy_s.map_or(0.0, |p| p.after_step_link_s);
    // a collective that runs behind the next steps had not all run when its `after_step` returned
    if let Some(a) = after.filter(|a| after_link > 0.0 && a.overlap_steps == 0) {
        let price = a.price(&param_bytes, n0);
        pts.push((price.messages, price.link_bytes, after_link));
    }
    let policy = pts.len() > from;
    // the step's own collectives (the ranks' agreement on the loss), as the simulated link
    // priced them (0 on a link that was not simulated: their time is not recorded apart)
    for c in rank0.control.iter().filter(|c| c.link_s > 0.0) {
        let price = RingPrice::of(c.op.ring(), c.bytes as f64, n0);
        pts.push((price.messages, price.link_bytes, c.link_s));
    }
    Ok(policy)
}

/// Least squares `seconds = α·messages + β·link bytes` with `α, β ≥ 0` over `pts` of
/// `(messages, link bytes, seconds)`: the latency (s) and seconds per byte of the ring's links.
/// Buckets of one kind of collective at one world size share one count of messages: α is then
/// the intercept of `y = a + b·x`, per message.
fn fit_link(pts: &[(f64, f64, f64)]) -> (f64, f64) {
    let (smm, sml, sll) = pts.iter().fold((0.0, 0.0, 0.0), |(a, b, c), p| {
        (a + p.0 * p.0, b + p.0 * p.1, c + p.1 * p.1)
    });
    let (smy, sly) = pts.iter().fold((0.0, 0.0), |(a, b), p| (a + p.0 * p.2, b + p.1 * p.2));
    let det = smm * sll - sml * sml;
    if det > 1e-9 * smm * sll {
        let alpha = (smy * sll - sly * sml) / det;
        let beta = (sly * smm - smy * sml) / det;
        if alpha >= 0.0 && beta >= 0.0 {
            return (alpha, beta);
        }
    }
    // one of the two alone, whichever leaves the smaller squared error
    let sse = |alpha: f64, beta: f64| {
        pts.iter()
            .map(|p| (p.2 - alpha * p.0 - beta * p.1).powi(2))
            .sum::<f64>()
    };
    let alpha_only = if smm > 0.0 { (smy / smm).max(0.0) } else { 0.0 };
    let beta_only = if sll > 0.0 { (sly / sll).max(0.0) } else { 0.0 };
    if sse(alpha_only, 0.0) < sse(0.0, beta_only) {
        (alpha_only, 0.0)
    } else {
        (0.0, beta_only)
    }
}

/// Least-squares `y = a + b·x` with `a, b ≥ 0` (through the origin when the sizes do not vary
/// or the intercept comes out negative).
fn fit_line(pts: &[(f64, f64)]) -> (f64, f64) {
    let n = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx > 0.0 {
        let b = sxy / sxx;
        let a = my - b * mx;
        if a >= 0.0 && b >= 0.0 {
            return (a, b);
        }
    }
    let xx: f64 = pts.iter().map(|p| p.0 * p.0).sum();
    let xy: f64 = pts.iter().map(|p| p.0 * p.1).sum();
    if xx > 0.0 {
        (0.0, (xy / xx).max(0.0))
    } else {
        (my.max(0.0), 0.0)
    }
}

/// Replays `profile`'s communication under `cfg` (see the module docs), with the launch
/// overhead fitted to this profile alone.
pub fn replay(profile: &StepProfile, cfg: &ReplayConfig) -> Result<ReplayResult, DdpError> {
    replay_with(profile, cfg, LaunchOverhead::fit(&[profile]))
}

/// [`replay`] with a launch overhead fitted beforehand, as from every profile of a sweep
/// ([`LaunchOverhead::fit`]).
pub fn replay_with(
    profile: &StepProfile,
    cfg: &ReplayConfig,
    overhead: LaunchOverhead,
) -> Result<ReplayResult, DdpError> {
    profile.validate()?;
    replay_checked(profile, cfg, overhead).map_err(DdpError::Replay)
}

fn replay_checked(profile: &StepProfile, cfg: &ReplayConfig, overhead: LaunchOverhead) -> Result<ReplayResult, String> {
    let n = checked_world(profile, cfg)?;
    let (alpha, per_byte) = link_params(profile, cfg.link)?;
    let (policy, wire, wire_note) = wire_model(profile)?;
    let param_bytes: Vec<usize> = profile.params.iter().map(|p| p.bytes).collect();
    let costs = Costs {
        profile,
        n,
        alpha,
        per_byte,
        wire,
        compute_per_byte: profile.ranks.iter().map(compute_per_byte).collect(),
        param_bytes,
        fitted_link: matches!(cfg.link, LinkCost::Measured),
    };
    // ZeRO-3: its buckets are its units, whatever the caps, and its parameter gathers move the
    // compute (`Clock`).
    let gathered = matches!(costs.wire, WireModel::Zero3 { .. });
    let mut clock = Clock::new(profile, gathered);
    let groups = bucket_groups(profile, cfg, gathered);
    let mut comm = CommRun {
        launched: vec![f64::NEG_INFINITY; profile.ranks.len()],
        link: LinkQueue {
            brought: f64::NEG_INFINITY,
            free: f64::NEG_INFINITY,
            overhead: if n < 2 { None } else { Some(&overhead) },
        },
        buckets: Vec::with_capacity(groups.len()),
        computed: f64::NEG_INFINITY,
        gathers: Vec::with_capacity(clock.n_gathers),
        waited: vec![0.0; profile.ranks.len()],
    };
    for op in comm_order(profile, groups.len(), &clock, gathered) {
        match op {
            Op::Bucket(j) => comm.bucket(groups[j].clone(), &costs, &clock),
            Op::Gather(k) => comm.gather(k, &costs, &mut clock),
        }
    }
    let backward_end = clock.backward_end();
    for b in &mut comm.buckets {
        b.exposed_s = (b.finish_s - b.start_s.max(backward_end)).max(0.0);
    }
    let last_finish = comm.buckets.last().map_or(f64::NEG_INFINITY, |b| b.finish_s);
    let control = |r: &RankProfile| control_delta(r, &costs, cfg.link);
    let (compute_step, predicted_step) = steps(profile, &clock, last_finish, &control);
    let after_step_comm = after_step_comm(profile, &costs);
    let predicted_step = predicted_step + after_step_comm;
    let drained = fluid_drain(&costs, &clock);
    Ok(ReplayResult {
        policy,
        bucket_cap_mb: cfg.bucket_cap_mb,
        first_bucket_cap_mb: cfg.first_bucket_cap_mb,
        world_size: n,
        comm_s: comm.buckets.iter().map(|b| b.finish_s - b.start_s).sum(),
        policy_compute_s: comm.buckets.iter().map(|b| costs.compute(&b.params, b.bytes)).sum(),
        after_step_comm_s: after_step_comm,
        agreement_comm_s: mean(
            profile
                .ranks
                .iter()
                .map(|r| (r.control.iter().map(|c| c.link_s).sum::<f64>() + control(r)).max(0.0))
                .collect(),
        ),
        buckets: comm.buckets,
        compute_step_s: compute_step,
        predicted_step_s: predicted_step,
        exposed_comm_s: (last_finish - backward_end).max(0.0),
        lower_bound_exposed_s: if n < 2 { 0.0 } else { (drained - backward_end).max(0.0) },
        launch_overhead: if n < 2 { LaunchOverhead::default() } else { overhead },
        gathers: comm.gathers,
        exposed_gather_s: mean(comm.waited),
        wire_note,
    })
}

/// The world size to replay, after checking the caps: one line naming what is wrong.
fn checked_world(profile: &StepProfile, cfg: &ReplayConfig) -> Result<usize, String> {
    for (flag, v) in [
        ("bucket cap", cfg.bucket_cap_mb),
        ("first bucket cap", cfg.first_bucket_cap_mb),
    ] {
        if !(v > 0.0 && v.is_finite()) {
            return Err(format!("the {flag} must be a positive number of MiB, got {v}"));
        }
    }
    let n = cfg.world_size.unwrap_or(profile.world_size);
    if n == 0 {
        return Err("world size must be at least 1".into());
    }
    Ok(n)
}

/// How the replayed collectives are costed: the policy's wire model on a ring of `n` ranks with
/// links of latency `alpha` and `per_byte` seconds a byte, and the policy's own compute on the
/// comm stream as recorded ([`Costs::compute`]). That compute runs in the collectives'
/// continuations (decompressing, converting back, checking), off the link: the replay charges
/// it after the bucket's collectives, beside the next bucket's. (The compute before the
/// collectives, inside the policy's `reduce`, is part of what the launch overhead measures.)
struct Costs<'a> {
    profile: &'a StepProfile,
    n: usize,
    alpha: f64,
    per_byte: f64,
    wire: WireModel,
    /// Each rank's recorded compute on the comm stream, per byte of bucket.
    compute_per_byte: Vec<f64>,
    /// Whether the link is fitted to rank 0's recorded collectives ([`LinkCost::Measured`]).
    fitted_link: bool,
    /// Each parameter's gradient bytes.
    param_bytes: Vec<usize>,
}

impl Costs<'_> {
    /// The policy's own compute for the bucket of parameters `group` (`bytes`), none on one
    /// rank (nothing is reduced). A low-rank policy (PowerSGD) computes between its
    /// collectives (orthogonalising P, `Q = Mᵀ·P`) and each of them starts once the last rank
    /// has issued it: the bucket takes the slowest rank's compute, each rank's as recorded for
    /// a recorded bucket of the same parameters (its matrices' compute, whatever their bytes),
    /// less that rank's wait for the last rank to issue the bucket's first collective (the
    /// replay starts the bucket there already), else at that rank's recorded rate per byte. On
    /// the link fitted to rank 0's collectives, whose recorded times hold its waits for the
    /// slower ranks, rank 0's compute alone. The other policies compute in their collectives'
    /// continuations, beside the link: rank 0's recorded rate per byte.
    fn compute(&self, group: &[usize], bytes: usize) -> f64 {
        if self.n < 2 {
            return 0.0;
        }
        if !matches!(self.wire, WireModel::LowRank { .. }) {
            return bytes as f64 * self.compute_per_byte[0];
        }
        let ranks = if self.fitted_link { 1 } else { self.profile.ranks.len() };
        let offsets = self.profile.clock_offsets();
        self.profile.ranks[..ranks]
            .iter()
            .zip(&self.compute_per_byte)
            .zip(&offsets)
            .map(|((r, per_byte), &o)| match r.buckets.iter().find(|b| b.params == group) {
                Some(b) => (b.policy_compute_s() - self.issue_wait(b, o, &offsets)).max(0.0),
                None => bytes as f64 * per_byte,
            })
            .fold(0.0, f64::max)
    }

    /// What a rank's recorded bucket `b` waited, after it had issued it, for the last rank to
    /// issue it (their recorded issues on rank 0's clock; `own_offset` is the rank's, `offsets`
    /// every rank's): a collective starts only once every rank issued it, and the rank's compute
    /// after its issue ([`BucketProfile::policy_compute_s`], for a bucket whose recorded start
    /// is an earlier chain's) holds that wait.
    fn issue_wait(&self, b: &BucketProfile, own_offset: f64, offsets: &[f64]) -> f64 {
        let own = b.launch_s + b.reduce_s() - own_offset;
        let last = self
            .profile
            .ranks
            .iter()
            .zip(offsets)
            .filter_map(|(r, o)| r.buckets.iter().find(|x| x.params == b.params).map(|x| x.launch_s + x.reduce_s() - o))
            .fold(own, f64::max);
        (last - own.max(b.start_s - own_offset)).max(0.0)
    }

    /// Rank `r`'s compute inside the policy's `reduce` for the bucket of parameters `group`,
    /// before its collectives: as recorded for a recorded bucket of the same parameters, else
    /// at the rank's recorded rate per byte (0 when not recorded, or on one rank).
    fn reduce(&self, r: usize, group: &[usize]) -> f64 {
        let recorded = &self.profile.ranks[r].buckets;
        if self.n < 2 {
            return 0.0;
        }
        if let Some(b) = recorded.iter().find(|b| b.params == group) {
            return b.reduce_s();
        }
        let bytes: usize = recorded.iter().map(|b| b.bytes).sum();
        let secs: f64 = recorded.iter().map(BucketProfile::reduce_s).sum();
        let group_bytes: usize = group.iter().map(|&p| self.param_bytes[p]).sum();
        if bytes == 0 {
            0.0
        } else {
            secs * group_bytes as f64 / bytes as f64
        }
    }

    /// A bucket's time on the link (its collectives) and its wire bytes.
    fn bucket(&self, group: &[usize]) -> (f64, f64) {
        if self.n < 2 {
            return (0.0, 0.0);
        }
        let price = self.wire.bucket_price(group, &self.param_bytes, self.n);
        (price.seconds(self.alpha, self.per_byte), price.wire_bytes)
    }

    /// The link time of a parameter gather of `bytes` (every rank's shard).
    fn gather(&self, bytes: usize) -> f64 {
        RingPrice::of(RingOp::AllGather, (bytes / self.n.max(1)) as f64, self.n).seconds(self.alpha, self.per_byte)
    }
}

/// The policy's compute between its buckets' collectives, per byte of bucket: what `rank`'s
/// recorded buckets spent on the comm stream beyond their collectives and their wait for the
/// bucket before's compute (0 before version 2).
fn compute_per_byte(rank: &RankProfile) -> f64 {
    let buckets = &rank.buckets;
    let bytes: usize = buckets.iter().map(|b| b.bytes).sum();
    if bytes == 0 {
        return 0.0;
    }
    let before = |k: usize| k.checked_sub(1).map(|j| &buckets[j]);
    let secs: f64 = buckets
        .iter()
        .enumerate()
        .map(|(k, b)| b.policy_compute_after(before(k)))
        .sum();
    secs / bytes as f64
}

/// The policy's after-step collectives on the replayed link and world: what a step waits for
/// them, on average ([`crate::policy::AfterStepWire::step_share`]), each running behind the
/// compute of the step after it up to that step's first collective on the comm stream (its
/// first bucket's launch, or the wait for its buckets when the policy sends none: the ranks'
/// agreement follows), the mean over the ranks.
fn after_step_comm(profile: &StepProfile, costs: &Costs) -> f64 {
    let Some(a) = profile.policy.as_ref().and_then(|p| p.after_step.as_ref()) else {
        return 0.0;
    };
    let on_link = !matches!(costs.wire, WireModel::Local);
    let head = mean(
        profile
            .ranks
            .iter()
            .map(|r| {
                let first = r
                    .buckets
                    .first()
                    .filter(|_| on_link)
                    .map_or(f64::INFINITY, |b| b.launch_s);
                first.min(r.waited_until())
            })
            .collect(),
    );
    a.step_share(&costs.param_bytes, costs.n, costs.alpha, costs.per_byte, head)
}

/// Every rank's recorded times on rank 0's clock, moved by what the replayed parameter gathers
/// (ZeRO-3) made the compute wait more or less than the recorded ones: a unit's compute waits
/// for its gather, so each rank's compute after a gather moves by the difference.
struct Clock<'a> {
    ranks: &'a [RankProfile],
    offsets: Vec<f64>,
    /// Each rank's recorded gathers (none unless the policy gathers parameters).
    recorded: Vec<Vec<RecordedGather>>,
    /// Replayed minus recorded wait, per rank and gather, once replayed.
    delta: Vec<Vec<f64>>,
    n_gathers: usize,
}

impl<'a> Clock<'a> {
    fn new(profile: &'a StepProfile, gathered: bool) -> Clock<'a> {
        let ranks = &profile.ranks[..];
        let offsets = profile.clock_offsets();
        let n_gathers = if gathered { ranks[0].gathers.len() } else { 0 };
        let recorded = ranks
            .iter()
            .zip(&offsets)
            .map(|(r, o)| {
                r.gathers[..n_gathers]
                    .iter()
                    .map(|g| RecordedGather::new(g, *o))
                    .collect()
            })
            .collect();
        Clock {
            ranks,
            offsets,
            recorded,
            delta: vec![vec![0.0; n_gathers]; ranks.len()],
            n_gathers,
        }
    }

    /// Rank `r`'s time `t` (on rank 0's clock) moved by the waits of the gathers before it.
    fn moved(&self, r: usize, t: f64) -> f64 {
        let shift: f64 = self.recorded[r]
            .iter()
            .zip(&self.delta[r])
            .filter(|(g, _)| g.resumed <= t)
            .map(|(_, d)| d)
            .sum();
        t + shift
    }

    /// When parameter `p`'s gradient is ready on rank `r`.
    fn ready_at(&self, r: usize, p: usize) -> f64 {
        self.moved(r, self.ranks[r].grad_ready_s[p] - self.offsets[r])
    }

    /// When parameter `p`'s gradient is ready on the last rank to have it.
    fn ready_everywhere(&self, p: usize) -> f64 {
        (0..self.ranks.len())
            .map(|r| self.ready_at(r, p))
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// When backward's compute ends on the last rank.
    fn backward_end(&self) -> f64 {
        (0..self.ranks.len())
            .map(|r| self.moved(r, self.ranks[r].backward_end_s - self.offsets[r]))
            .fold(f64::NEG_INFINITY, f64::max)
    }
}

/// The buckets to replay, each its parameters in bucket order: the recorded units under ZeRO-3
/// (`gathered`), else the parameters in `cfg`'s order assigned under its caps.
fn bucket_groups(profile: &StepProfile, cfg: &ReplayConfig, gathered: bool) -> Vec<Vec<usize>> {
    let rank0 = &profile.ranks[0];
    if gathered {
        return rank0.buckets.iter().map(|b| b.params.clone()).collect();
    }
    let n_params = profile.params.len();
    let order: Vec<usize> = match cfg.order {
        BucketOrder::Reverse => (0..n_params).rev().collect(),
        BucketOrder::Ready => {
            let mut o: Vec<usize> = (0..n_params).rev().collect();
            // stable: ties keep reverse registration order, as the reducer hears them
            o.sort_by(|&a, &b| rank0.grad_ready_s[a].total_cmp(&rank0.grad_ready_s[b]));
            o
        }
    };
    let bytes: Vec<usize> = profile.params.iter().map(|p| p.bytes).collect();
    let mib = |m: f64| (m * 1024.0 * 1024.0).max(1.0) as usize;
    assign_buckets(&bytes, &order, mib(cfg.first_bucket_cap_mb), mib(cfg.bucket_cap_mb))
}

/// The collectives in the order the comm stream ran them: the buckets, and the gathers merged in
/// by when rank 0 issued them.
fn comm_order(profile: &StepProfile, n_buckets: usize, clock: &Clock, gathered: bool) -> Vec<Op> {
    let mut ops: Vec<(f64, Op)> = (0..n_buckets)
        .map(|j| {
            let at = if gathered {
                profile.ranks[0].buckets[j].launch_s
            } else {
                0.0
            };
            (at, Op::Bucket(j))
        })
        .chain((0..clock.n_gathers).map(|k| (clock.recorded[0][k].issued, Op::Gather(k))))
        .collect();
    ops.sort_by(|a, b| a.0.total_cmp(&b.0));
    ops.into_iter().map(|(_, op)| op).collect()
}

/// The replayed comm stream: each rank launches in strict bucket order; the link queue takes
/// each collective once the last rank issued it.
struct CommRun<'a> {
    /// When each rank launched its last bucket.
    launched: Vec<f64>,
    link: LinkQueue<'a>,
    buckets: Vec<ReplayBucket>,
    /// When the policy's compute after the last bucket's collectives ended: it runs in the
    /// collectives' continuations, one bucket after another, beside the link (the next bucket's
    /// collective takes the link meanwhile).
    computed: f64,
    gathers: Vec<ReplayGather>,
    /// What each rank's compute waited for its parameter gathers.
    waited: Vec<f64>,
}

impl CommRun<'_> {
    /// Replays the bucket of parameters `group`.
    fn bucket(&mut self, group: Vec<usize>, costs: &Costs, clock: &Clock) {
        let mut ready_max = f64::NEG_INFINITY;
        let mut launch_max = f64::NEG_INFINITY;
        for (r, launched) in self.launched.iter_mut().enumerate() {
            let ready = group
                .iter()
                .map(|&p| clock.ready_at(r, p))
                .fold(f64::NEG_INFINITY, f64::max);
            *launched = launched.max(ready) + costs.reduce(r, &group);
            ready_max = ready_max.max(ready);
            launch_max = launch_max.max(*launched);
        }
        let b_bytes: usize = group.iter().map(|&p| costs.profile.params[p].bytes).sum();
        let (link_s, wire_bytes) = costs.bucket(&group);
        // a low-rank policy (PowerSGD) issues a bucket's collectives once the previous bucket's
        // reduction, its compute between and after its collectives included, is done
        let issued = match costs.wire {
            WireModel::LowRank { .. } => launch_max.max(self.computed),
            _ => launch_max,
        };
        let (start, left) = self.link.take(issued, b_bytes, link_s, clock.backward_end());
        let finish = left.max(self.computed) + costs.compute(&group, b_bytes);
        self.computed = finish;
        self.buckets.push(ReplayBucket {
            params: group,
            bytes: b_bytes,
            wire_bytes,
            ready_s: ready_max,
            launch_s: launch_max,
            start_s: start,
            finish_s: finish,
            exposed_s: 0.0,
        });
    }

    /// Replays rank 0's parameter gather `k`, and moves every rank's compute after it by what
    /// it now waits.
    fn gather(&mut self, k: usize, costs: &Costs, clock: &mut Clock) {
        let ranks = clock.ranks;
        let g = &ranks[0].gathers[k];
        let issued = (0..ranks.len())
            .map(|r| clock.moved(r, clock.recorded[r][k].issued))
            .fold(f64::NEG_INFINITY, f64::max);
        // every rank's shard, padded to the replayed world
        let n = costs.n;
        let g_bytes = (g.bytes / 4).div_ceil(n) * n * 4;
        let (start, finish) = self
            .link
            .take(issued, g_bytes, costs.gather(g_bytes), clock.backward_end());
        let mut sum = 0.0;
        for r in 0..ranks.len() {
            let Some(needed) = clock.recorded[r][k].needed else {
                continue;
            };
            let wait = (finish - clock.moved(r, needed)).max(0.0);
            clock.delta[r][k] = wait - clock.recorded[r][k].waited;
            self.waited[r] += wait;
            sum += wait;
        }
        self.gathers.push(ReplayGather {
            unit: g.unit.clone(),
            phase: g.phase,
            bytes: g_bytes,
            issued_s: issued,
            start_s: start,
            finish_s: finish,
            waited_s: sum / ranks.len() as f64,
        });
    }
}

/// What a rank's step collectives of its own ([`RankProfile::control`]: the ranks' agreement on
/// the loss) take on the replayed link beyond what they held the recorded one: their ring price
/// on the replayed link and world less their recorded link time. Nothing on the measured link
/// (the recorded span is that link's).
fn control_delta(r: &RankProfile, costs: &Costs, link: LinkCost) -> f64 {
    if matches!(link, LinkCost::Measured) {
        return 0.0;
    }
    r.control
        .iter()
        .map(|c| RingPrice::of(c.op.ring(), c.bytes as f64, costs.n).seconds(costs.alpha, costs.per_byte) - c.link_s)
        .sum()
}

/// The step without communication and the predicted step before the policy's after-step
/// collectives, the last bucket finishing at `last_finish`; `control` is what a rank's own
/// step collectives take beyond their recorded link time ([`control_delta`]).
fn steps(profile: &StepProfile, clock: &Clock, last_finish: f64, control: &dyn Fn(&RankProfile) -> f64) -> (f64, f64) {
    let ranks = &profile.ranks;
    // What follows the buckets is taken as recorded: the gap between the recorded end of the
    // last bucket (or of backward) and the optimizer (the ranks' agreement on the loss, whose
    // collective is priced apart, and a wait behind an earlier step's sync, whose priced share
    // is charged apart), the optimizer with the policy's after-step compute, and the rest of
    // the step; the after-step collectives it recorded are replaced by their priced share.
    // `waited`: what of the gap the rank waited for the others, which the replay charges itself.
    let held = held_by_earlier_syncs(ranks);
    let after_backward = |r: &RankProfile, waited: f64| {
        let recorded_link = r.policy_s.map_or(0.0, |p| p.after_step_link_s);
        let control_link: f64 = r.control.iter().map(|c| c.link_s).sum();
        (r.optimizer_start_s - r.waited_until() - held - control_link - waited).max(0.0)
            + (r.optimizer_end_s - r.optimizer_start_s - recorded_link).max(0.0)
            + (r.step_end_s - r.optimizer_end_s).max(0.0)
    };
    // Each rank's step on its own clock; the group's step is their mean: the ranks meet at
    // every step's last bucket, so in the long run each rank's steps take the same time, and the
    // mean over the ranks of one recorded step estimates it best.
    // Without communication the compute waits for no gather either.
    let compute_step = mean(
        ranks
            .iter()
            .enumerate()
            .map(|(r, p)| {
                p.backward_end_s - clock.recorded[r].iter().map(|g| g.waited).sum::<f64>() + after_backward(p, 0.0)
            })
            .collect(),
    );
    // On clocks set by the agreement ([`StepProfile::agreed_clocks`]) each rank's gap holds its
    // wait there for the last rank to arrive (on a chained policy or on buckets that moved
    // nothing the ranks leave their buckets apart): the replay charges the wait for the last
    // rank's predicted end instead. On clocks set by the buckets' starts the ranks left their
    // last bucket together, and each rank goes on from its own end.
    let agreed = profile.agreed_clocks();
    let arrived = ranks
        .iter()
        .zip(&clock.offsets)
        .map(|(p, o)| p.waited_until() - o)
        .fold(f64::NEG_INFINITY, f64::max);
    let last_end = clock.backward_end().max(last_finish);
    let predicted_step = mean(
        ranks
            .iter()
            .enumerate()
            .zip(&clock.offsets)
            .map(|((r, p), o)| {
                let control_s = p.control.iter().map(|c| c.link_s).sum::<f64>() + control(p);
                let through = if agreed {
                    last_end + o + after_backward(p, arrived - (p.waited_until() - o))
                } else {
                    let end = clock.moved(r, p.backward_end_s - o) + o;
                    end.max(last_finish + o) + after_backward(p, 0.0)
                };
                through + control_s.max(0.0)
            })
            .collect(),
    );
    (compute_step, predicted_step)
}

/// What the recorded step waited after backward for the after-step collectives of earlier
/// steps (a sync overlapped with the steps after it) to leave the comm stream, which the replay
/// charges as their priced share instead: the least such wait over the ranks (they left the
/// stream together; a rank that waited longer had reached the agreement earlier, and would have
/// waited for the last rank as in any step). 0 when a rank recorded none.
fn held_by_earlier_syncs(ranks: &[RankProfile]) -> f64 {
    ranks
        .iter()
        .map(|r| match r.policy_s.and_then(|p| p.in_flight_until_s) {
            Some(left) => (left.min(r.optimizer_start_s) - r.waited_until()).max(0.0),
            None => 0.0,
        })
        .reduce(f64::min)
        .unwrap_or(0.0)
}

/// When the last byte would have left for the lower bound: a fluid link that carries each
/// parameter's link bytes from the moment its gradient is ready, at the bandwidth alone (no
/// latency, no launch, no policy compute), each parameter at its floor
/// ([`WireModel::link_bytes_floor`]: what a bucket pays once, such as ZeRO's padding to a
/// multiple of the ranks, is left out; a bucket of one parameter would pay it per parameter).
fn fluid_drain(costs: &Costs, clock: &Clock) -> f64 {
    let n_params = costs.profile.params.len();
    let ready_all: Vec<f64> = (0..n_params).map(|p| clock.ready_everywhere(p)).collect();
    let fluid_rate = if costs.n < 2 { 0.0 } else { costs.per_byte };
    let sent_of = |p: usize| costs.wire.link_bytes_floor(&[p], &costs.param_bytes, costs.n);
    let mut by_ready: Vec<usize> = (0..n_params).collect();
    by_ready.sort_by(|&a, &b| ready_all[a].total_cmp(&ready_all[b]));
    by_ready
        .iter()
        .fold(f64::NEG_INFINITY, |t, &p| t.max(ready_all[p]) + sent_of(p) * fluid_rate)
}

fn mean(v: Vec<f64>) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// A collective of the replayed step, as the comm stream runs them.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// The bucket of that index.
    Bucket(usize),
    /// The parameter gather of that index (rank 0's list).
    Gather(usize),
}

/// One rank's recorded gather on rank 0's clock.
struct RecordedGather {
    issued: f64,
    /// When the compute needed it (`None`: an unused prefetch).
    needed: Option<f64>,
    /// When the compute went on (it had the parameters); never for an unused prefetch.
    resumed: f64,
    /// What the compute waited for it.
    waited: f64,
}

impl RecordedGather {
    fn new(g: &super::GatherProfile, offset: f64) -> RecordedGather {
        let needed = g.needed_s.map(|t| t - offset);
        RecordedGather {
            issued: g.issued_s - offset,
            needed,
            resumed: needed.map_or(f64::INFINITY, |t| t.max(g.finish_s - offset)),
            waited: g.waited_s(),
        }
    }
}

/// The policy a profile was recorded under, how its collectives are costed, and a note when the
/// recorded step ran under another model than the policy's steady one; one line when it names
/// none (a profile recorded before policies were: its reader names the default policy,
/// [`StepProfile::policy`]) or is a user policy that declared no model. PowerSGD all-reduces
/// its gradients uncompressed before its start step: a step recorded then (its buckets sent
/// the plain all-reduce's bytes) is priced as what it was.
fn wire_model(profile: &StepProfile) -> Result<(String, WireModel, Option<String>), String> {
    match &profile.policy {
        None => Err(
            "the profile names no reducer policy (it was recorded before policies were): give it the policy it \
             ran under (the default's) before replaying it"
                .into(),
        ),
        Some(p) => match &p.wire {
            Some(w @ WireModel::LowRank { start_iter, .. }) if recorded_uncompressed(profile, w) => Ok((
                p.name.clone(),
                WireModel::AllReduce { bytes_per_element: 4.0 },
                Some(format!(
                    "the profile's step ran before {}'s start step ({start_iter}): its buckets sent the plain \
                     all-reduce's bytes, and it is priced as a plain all-reduce (profile a step from {start_iter} on \
                     for the compressed one)",
                    p.name
                )),
            )),
            Some(w) => Ok((p.name.clone(), w.clone(), None)),
            None => Err(format!(
                "the profile was recorded under policy '{}', which declares no wire model (ReducerPolicy::wire_model): \
                 the overlap model cannot cost its collectives; replay a profile of a policy that declares one",
                p.name
            )),
        },
    }
}

/// Why `profile` is priced under another model than its policy's steady one, as a replay of it
/// notes it ([`ReplayResult::wire_note`]); `None` when it is not (or cannot be replayed).
pub fn wire_note(profile: &StepProfile) -> Option<String> {
    wire_model(profile).ok().and_then(|(_, _, note)| note)
}

/// Whether `profile`'s buckets recorded sending what a plain f32 all-reduce sends rather than
/// what the low-rank model `wire` sends (a PowerSGD step before its start step).
fn recorded_uncompressed(profile: &StepProfile, wire: &WireModel) -> bool {
    let n = profile.world_size;
    let param_bytes: Vec<usize> = profile.params.iter().map(|p| p.bytes).collect();
    let (mut sent, mut plain, mut low_rank) = (0.0, 0.0, 0.0);
    for b in &profile.ranks[0].buckets {
        let Some(w) = b.wire_bytes else {
            return false;
        };
        sent += w;
        plain += WireModel::AllReduce { bytes_per_element: 4.0 }
            .bucket_price(&b.params, &param_bytes, n)
            .wire_bytes;
        low_rank += wire.bucket_price(&b.params, &param_bytes, n).wire_bytes;
    }
    plain > low_rank && (sent - plain).abs() < (sent - low_rank).abs()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A step of an f32 all-reduce on 2 ranks (one 1 MiB parameter, 10 ms of backward, the
    /// bucket 1 ms on the link) whose ranks then agreed on the loss: `control` is each rank's
    /// recorded step collectives.
    fn step(control: serde_json::Value) -> StepProfile {
        let rank = |r: usize| {
            serde_json::json!({
                "rank": r, "backward_start_s": 0.0, "backward_end_s": 0.010,
                "optimizer_start_s": 0.0115, "optimizer_end_s": 0.012, "step_end_s": 0.012,
                "grad_ready_s": [0.010],
                "buckets": [ { "params": [0], "bytes": 1 << 20, "wire_bytes": 1048576.0, "ready_s": 0.010,
                               "launch_s": 0.010, "start_s": 0.010, "finish_s": 0.011, "link_s": 0.001 } ],
                "control": control.clone()
            })
        };
        serde_json::from_value(serde_json::json!({
            "version": 2, "world_size": 2, "bucket_cap_mb": 25.0, "first_bucket_cap_mb": 1.0,
            "policy": { "name": "allreduce", "wire": { "kind": "all_reduce", "bytes_per_element": 4.0 } },
            "params": [ { "name": "w", "bytes": 1 << 20, "shape": [512, 512] } ],
            "ranks": [rank(0), rank(1)]
        }))
        .unwrap()
    }

    fn predicted(p: &StepProfile, model: NetModel, world: usize) -> f64 {
        let cfg = ReplayConfig {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 1.0,
            link: LinkCost::Ring(model),
            world_size: Some(world),
            order: BucketOrder::Ready,
        };
        replay_with(p, &cfg, LaunchOverhead::default())
            .unwrap()
            .predicted_step_s
    }

    fn link(latency_us: u64) -> NetModel {
        NetModel {
            latency: Duration::from_micros(latency_us),
            bandwidth_bytes_per_s: 0.25e9 / 8.0,
        }
    }

    #[test]
    fn the_steps_agreement_on_the_loss_waits_the_replayed_links_latencies() {
        // recorded on no simulated link: the agreement's 12 bytes held none
        let none = step(serde_json::json!([]));
        let agreed = step(serde_json::json!([{ "op": "all_reduce", "bytes": 12, "link_s": 0.0 }]));
        let (l, n) = (link(100), 4);
        let want = RingPrice::of(RingOp::AllReduce, 12.0, n).seconds(100e-6, 8.0 / 0.25e9);
        let got = predicted(&agreed, l, n) - predicted(&none, l, n);
        // six messages of 100 us on four ranks, and 18 bytes at 0.25 Gb/s
        assert!(
            (got - want).abs() < 1e-9,
            "the agreement added {got} s, the ring prices it {want} s"
        );
        assert!(want > 6.0 * 100e-6);
    }

    #[test]
    fn an_agreement_recorded_on_the_replayed_link_is_not_charged_twice() {
        // recorded on the simulated link it is replayed on: its span already holds the link
        let l = link(100);
        let on_link = l.time(RingOp::AllReduce, 12, 2).as_secs_f64();
        let none = step(serde_json::json!([]));
        let agreed = step(serde_json::json!([{ "op": "all_reduce", "bytes": 12, "link_s": on_link }]));
        let got = predicted(&agreed, l, 2) - predicted(&none, l, 2);
        assert!(
            got.abs() < 1e-9,
            "replayed on its own link the agreement moved the step by {got} s"
        );
    }
}
