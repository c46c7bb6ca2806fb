//! `brigade sweep --repeat R`: the caps interleaved round-robin, median and spread per cap, the
//! overlap model's prediction beside each measurement, and a verdict per cap against its own
//! lower bound.
//!
//! Each run of a cap is one [`Sample`]; [`run_rounds`] runs round after round, every cap once
//! per round, so the machine's drift over minutes touches every cap alike. [`summarize`] turns
//! one cap's samples into a [`SweepRow`]: medians (spread = max − min over the rounds), the
//! predicted step time and exposed communication (the median over every recorded profile of the
//! sweep, whatever cap recorded it, replayed under this cap: [`brigade_ddp::overlap::replay`]),
//! the cap's lower bound (exposed comm if every byte left the moment it was ready, from this
//! cap's own profiles) and how far the measured exposed comm lies above it.

use brigade_ddp::overlap::{replay, replay_with, BucketOrder, LaunchOverhead, LinkCost, ReplayConfig, StepProfile};
use serde::Serialize;

use crate::report::summary::median_min;

/// How far above its lower bound a cap's exposed communication may lie and still be called at
/// the bound: 2 ms, or 15% of the bound when that is more (the overlap model's accuracy target).
pub const AT_BOUND_MS: f64 = 2.0;
/// See [`AT_BOUND_MS`].
pub const AT_BOUND_FRACTION: f64 = 0.15;

/// What one run of one cap measured.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Buckets the run ended with.
    pub buckets: usize,
    /// Median step time after warmup, rank 0, in ms.
    pub step_ms: f64,
    /// Median step time of the compute-only run just before it, in ms.
    pub compute_only_ms: f64,
    /// Sum of the recorded step's bucket times on the link, in ms.
    pub comm_ms: f64,
    /// The recorded step's last bucket on the link, in ms.
    pub last_bucket_ms: f64,
    /// The recorded step's profile (every rank), if recorded.
    pub profile: Option<StepProfile>,
}

impl Sample {
    /// What the recorded step waited for its buckets after backward's compute ended, in ms
    /// ([`StepProfile::waited_s`]).
    pub fn waited_ms(&self) -> Option<f64> {
        Some(1e3 * self.profile.as_ref()?.waited_s()?)
    }
}

/// Runs `repeat` rounds of every cap in order (round-robin: `c0 c1 c2 c0 c1 c2 ...`) through
/// `run(round, cap)`, and returns each cap's samples in round order. A run that returns
/// `None` (it was stopped) ends the rounds there: the samples so far are returned.
pub fn run_rounds<S, E>(
    caps: &[f64],
    repeat: usize,
    mut run: impl FnMut(usize, f64) -> Result<Option<S>, E>,
) -> Result<Vec<Vec<S>>, E> {
    let mut per_cap: Vec<Vec<S>> = caps.iter().map(|_| Vec::with_capacity(repeat)).collect();
    for round in 0..repeat {
        for (i, &cap) in caps.iter().enumerate() {
            match run(round, cap)? {
                Some(sample) => per_cap[i].push(sample),
                None => return Ok(per_cap),
            }
        }
    }
    Ok(per_cap)
}

/// One cap of the sweep: medians over its runs, spreads (max − min), the prediction and the
/// verdict. Times in ms; `None` where nothing could be measured or predicted (a world of one
/// rank has no link).
#[derive(Debug, Clone, Serialize)]
pub struct SweepRow {
    pub bucket_mb: f64,
    /// Runs of this cap (`--repeat`).
    pub runs: usize,
    pub buckets: usize,
    pub step_ms: f64,
    pub step_spread_ms: f64,
    pub compute_only_ms: f64,
    pub compute_only_spread_ms: f64,
    pub comm_ms: f64,
    pub last_bucket_ms: f64,
    /// Median over runs of (step − its compute-only baseline).
    pub exposed_comm_ms: f64,
    pub exposed_spread_ms: f64,
    /// Median over runs of what the recorded step waited for its buckets after backward.
    pub waited_ms: Option<f64>,
    /// The model's wait for the buckets after backward for this cap (median over every
    /// profile of the sweep): the counterpart of `waited_ms`.
    pub predicted_wait_ms: Option<f64>,
    /// The model's step time for this cap (median over every profile of the sweep).
    pub predicted_step_ms: Option<f64>,
    /// The model's exposed comm for this cap: its predicted step minus the measured
    /// compute-only step, the baseline `exposed_comm_ms` subtracts too. Communication costs a
    /// step more than its wait (the reduction and the comm threads take cores from backward);
    /// the recorded compute holds that, so the step is what the model predicts whole.
    pub predicted_exposed_ms: Option<f64>,
    /// Exposed comm no cap can beat, from this cap's own profiles.
    pub lower_bound_ms: Option<f64>,
    /// Measured exposed comm minus the lower bound.
    pub excess_over_bound_ms: Option<f64>,
    pub hidden_share: f64,
    /// `at bound` (within [`AT_BOUND_MS`] or [`AT_BOUND_FRACTION`] of it), `above bound`, or
    /// `no bound` (nothing to compare with).
    pub verdict: String,
}

fn median_spread(v: &[f64]) -> (f64, f64) {
    let (median, min) = median_min(v);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (median, if v.is_empty() { f64::NAN } else { max - min })
}

fn median_of(v: Vec<f64>) -> Option<f64> {
    (!v.is_empty()).then(|| median_min(&v).0)
}

/// Summarizes one cap's samples; `all_profiles` are every run's profiles (every cap), replayed
/// under this cap on `link` with the launch `overhead` fitted to all of them
/// ([`LaunchOverhead::fit`]).
pub fn summarize(
    cap: f64,
    first_bucket_mb: f64,
    samples: &[Sample],
    all_profiles: &[&StepProfile],
    overhead: LaunchOverhead,
    link: LinkCost,
) -> SweepRow {
    let col = |f: fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<f64>>();
    let (step_ms, step_spread_ms) = median_spread(&col(|s| s.step_ms));
    let (compute_only_ms, compute_only_spread_ms) = median_spread(&col(|s| s.compute_only_ms));
    let (exposed, exposed_spread_ms) = median_spread(&col(|s| (s.step_ms - s.compute_only_ms).max(0.0)));
    let comm_ms = median_min(&col(|s| s.comm_ms)).0;
    let cfg = ReplayConfig {
        bucket_cap_mb: cap,
        first_bucket_cap_mb: first_bucket_mb.min(cap),
        link,
        world_size: None,
        order: BucketOrder::Ready,
    };
    let replays: Vec<_> = all_profiles
        .iter()
        .filter_map(|p| replay_with(p, &cfg, overhead).ok())
        .collect();
    let predicted_step_ms = median_of(replays.iter().map(|r| 1e3 * r.predicted_step_s).collect());
    let own: Vec<f64> = samples
        .iter()
        .filter_map(|s| replay(s.profile.as_ref()?, &cfg).ok())
        .map(|r| 1e3 * r.lower_bound_exposed_s)
        .collect();
    let lower_bound_ms = median_of(own);
    let excess = lower_bound_ms.map(|lb| exposed - lb);
    let verdict = match (lower_bound_ms, excess) {
        (Some(lb), Some(x)) if x <= AT_BOUND_MS.max(AT_BOUND_FRACTION * lb) => "at bound",
        (Some(_), Some(_)) => "above bound",
        _ => "no bound",
    };
    SweepRow {
        bucket_mb: cap,
        runs: samples.len(),
        buckets: samples.last().map_or(0, |s| s.buckets),
        step_ms,
        step_spread_ms,
        compute_only_ms,
        compute_only_spread_ms,
        comm_ms,
        last_bucket_ms: median_min(&col(|s| s.last_bucket_ms)).0,
        exposed_comm_ms: exposed,
        exposed_spread_ms,
        waited_ms: median_of(samples.iter().filter_map(Sample::waited_ms).collect()),
        predicted_wait_ms: median_of(replays.iter().map(|r| 1e3 * r.exposed_comm_s).collect()),
        predicted_step_ms,
        predicted_exposed_ms: predicted_step_ms.map(|p| (p - compute_only_ms).max(0.0)),
        lower_bound_ms,
        excess_over_bound_ms: excess,
        hidden_share: if comm_ms > 0.0 {
            (1.0 - exposed / comm_ms).clamp(0.0, 1.0)
        } else {
            1.0
        },
        verdict: verdict.into(),
    }
}

/// The columns of `sweep.csv`, in order (the first two as before `--repeat`).
pub const CSV_COLUMNS: [&str; 19] = [
    "bucket_mb",
    "buckets",
    "runs",
    "step_ms",
    "step_spread_ms",
    "compute_only_ms",
    "compute_only_spread_ms",
    "comm_ms",
    "last_bucket_ms",
    "exposed_comm_ms",
    "exposed_spread_ms",
    "waited_ms",
    "predicted_wait_ms",
    "predicted_step_ms",
    "predicted_exposed_ms",
    "lower_bound_ms",
    "excess_over_bound_ms",
    "hidden_share",
    "verdict",
];

/// `sweep.csv`: one header line ([`CSV_COLUMNS`]) and one line per cap; an empty cell where
/// nothing was measured or predicted.
pub fn to_csv(rows: &[SweepRow]) -> String {
    let mut csv = CSV_COLUMNS.join(",");
    csv.push('\n');
    let opt = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_default();
    for r in rows {
        let cells = [
            r.bucket_mb.to_string(),
            r.buckets.to_string(),
            r.runs.to_string(),
            format!("{:.3}", r.step_ms),
            format!("{:.3}", r.step_spread_ms),
            format!("{:.3}", r.compute_only_ms),
            format!("{:.3}", r.compute_only_spread_ms),
            format!("{:.3}", r.comm_ms),
            format!("{:.3}", r.last_bucket_ms),
            format!("{:.3}", r.exposed_comm_ms),
            format!("{:.3}", r.exposed_spread_ms),
            opt(r.waited_ms),
            opt(r.predicted_wait_ms),
            opt(r.predicted_step_ms),
            opt(r.predicted_exposed_ms),
            opt(r.lower_bound_ms),
            opt(r.excess_over_bound_ms),
            format!("{:.4}", r.hidden_share),
            r.verdict.clone(),
        ];
        csv.push_str(&cells.join(","));
        csv.push('\n');
    }
    csv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_visit_every_cap_once_per_round_in_order() {
        let mut calls = vec![];
        let per_cap = run_rounds(&[0.25, 1.0, 25.0], 3, |round, cap| {
            calls.push((round, cap));
            Ok::<_, ()>(Some(calls.len()))
        })
        .unwrap();
        assert_eq!(
            calls,
            [
                (0, 0.25),
                (0, 1.0),
                (0, 25.0),
                (1, 0.25),
                (1, 1.0),
                (1, 25.0),
                (2, 0.25),
                (2, 1.0),
                (2, 25.0)
            ]
        );
        // each cap's samples in round order: cap 1.0 ran 2nd, 5th and 8th
        assert_eq!(per_cap, [vec![1, 4, 7], vec![2, 5, 8], vec![3, 6, 9]]);
        // a failing run stops the sweep there
        let mut n = 0;
        let failed = run_rounds(&[1.0, 2.0], 2, |_, _| {
            n += 1;
            if n == 3 {
                Err("third")
            } else {
                Ok(Some(()))
            }
        });
        assert_eq!(failed.unwrap_err(), "third");
        assert_eq!(n, 3);
        // a stopped run ends the rounds with the samples before it
        let mut n = 0;
        let stopped = run_rounds(&[1.0, 2.0], 2, |_, _| {
            n += 1;
            Ok::<_, ()>((n < 4).then_some(n))
        });
        assert_eq!(stopped.unwrap(), [vec![1, 3], vec![2]]);
    }

    fn sample(step_ms: f64, compute_only_ms: f64) -> Sample {
        Sample {
            buckets: 2,
            step_ms,
            compute_only_ms,
            comm_ms: 10.0,
            last_bucket_ms: 1.0,
            profile: None,
        }
    }

    #[test]
    fn the_wait_is_read_on_one_clock() {
        // Rank 0 started its step 20 ms before rank 1: its stamps are 20 ms larger. On one
        // clock rank 0 ends backward at 10 ms, rank 1 at 12 ms, and the bucket finishes at
        // 13 ms: 1 ms waited (not the 3 ms the raw stamps would say).
        use brigade_ddp::overlap::{BucketProfile, ParamProfile, RankProfile, PROFILE_VERSION};
        let rank = |r: usize, by: f64, end: f64| RankProfile {
            rank: r,
            backward_start_s: by,
            backward_end_s: end + by,
            optimizer_start_s: 0.013 + by,
            optimizer_end_s: 0.014 + by,
            step_end_s: 0.014 + by,
            grad_ready_s: vec![0.009 + by],
            buckets: vec![BucketProfile {
                params: vec![0],
                bytes: 4,
                wire_bytes: None,
                ready_s: 0.009 + by,
                launch_s: 0.009 + by,
                issued_s: None,
                start_s: 0.010 + by,
                finish_s: 0.013 + by,
                link_s: None,
            }],
            gathers: vec![],
            control: vec![],
            policy_s: None,
        };
        let s = Sample {
            profile: Some(StepProfile {
                version: PROFILE_VERSION,
                world_size: 2,
                bucket_cap_mb: 1.0,
                first_bucket_cap_mb: 1.0,
                activation_checkpointing: 0,
                policy: None,
                run: None,
                params: vec![ParamProfile {
                    name: "w".into(),
                    bytes: 4,
                    shape: vec![],
                }],
                ranks: vec![rank(0, 0.020, 0.010), rank(1, 0.0, 0.012)],
            }),
            ..sample(20.0, 10.0)
        };
        assert!((s.waited_ms().unwrap() - 1.0).abs() < 1e-9, "{:?}", s.waited_ms());
    }

    #[test]
    fn a_rows_prediction_is_the_models_replay_and_its_wait_never_below_its_own_bound() {
        // A step recorded once (crates/cli/tests/fixtures/record_profiles.sh), the only run of
        // the 0.05 MiB cap: its row's wait, step and bound are the replay's of that profile
        // under the cap, on its measured link with the overhead fitted to it; the measured
        // compute-only step (10 ms) is what the predicted exposed comm subtracts.
        let p: StepProfile = serde_json::from_str(include_str!("../../tests/fixtures/profile_allreduce.json")).unwrap();
        let s = Sample {
            profile: Some(p.clone()),
            ..sample(20.0, 10.0)
        };
        let row = summarize(0.05, 0.05, &[s], &[&p], LaunchOverhead::fit(&[&p]), LinkCost::Measured);
        let cfg = ReplayConfig {
            bucket_cap_mb: 0.05,
            first_bucket_cap_mb: 0.05,
            link: LinkCost::Measured,
            world_size: None,
            order: BucketOrder::Ready,
        };
        let r = replay(&p, &cfg).unwrap();
        assert_eq!(row.predicted_wait_ms, Some(1e3 * r.exposed_comm_s));
        assert_eq!(row.predicted_step_ms, Some(1e3 * r.predicted_step_s));
        assert_eq!(row.lower_bound_ms, Some(1e3 * r.lower_bound_exposed_s));
        assert_eq!(
            row.predicted_exposed_ms,
            Some((1e3 * r.predicted_step_s - 10.0).max(0.0))
        );
        // the wait the model predicts for a cap is never below the bound of the same step
        assert!(row.predicted_wait_ms >= row.lower_bound_ms, "{row:?}");
        assert!(r.exposed_comm_s > 0.0, "a step that waited for its buckets: {r:?}");
    }

    #[test]
    fn a_row_holds_medians_and_spreads_and_the_csv_names_every_column() {
        // exposed per run: 5, 1, 9 -> median 5, spread 8; steps 30, 31, 35 -> median 31, spread 5
        let samples = [sample(30.0, 25.0), sample(31.0, 30.0), sample(35.0, 26.0)];
        let row = summarize(5.0, 1.0, &samples, &[], LaunchOverhead::default(), LinkCost::Measured);
        assert_eq!((row.runs, row.step_ms, row.step_spread_ms), (3, 31.0, 5.0));
        assert_eq!((row.exposed_comm_ms, row.exposed_spread_ms), (5.0, 8.0));
        assert_eq!(row.compute_only_ms, 26.0);
        assert_eq!(row.predicted_step_ms, None);
        assert_eq!(row.verdict, "no bound");
        let csv = to_csv(&[row.clone(), row]);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].split(',').collect::<Vec<_>>(), CSV_COLUMNS);
        for l in &lines[1..] {
            let cells: Vec<&str> = l.split(',').collect();
            assert_eq!(cells.len(), CSV_COLUMNS.len(), "{l}");
            let at = |c: &str| cells[CSV_COLUMNS.iter().position(|&n| n == c).unwrap()];
            assert_eq!(at("bucket_mb"), "5");
            assert_eq!(at("step_spread_ms"), "5.000");
            assert_eq!(at("predicted_exposed_ms"), "");
            assert_eq!(at("verdict"), "no bound");
        }
    }
}
