//! The bucket-cap autotuner: its choice on hand-built profiles whose answer is known, and a
//! change of cap applied identically on every rank (from the recorded bucket layouts), with the
//! same training as a fixed cap.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use brigade_autograd::{Optimizer, Sgd};
use brigade_comm::{run_on_threads, NetModel, Recorder};
use brigade_ddp::overlap::{
    decide, AutotuneConfig, Autotuner, ParamProfile, RankProfile, StepProfile, PROFILE_VERSION,
};
use brigade_ddp::{assign_buckets, BucketInfo, DdpConfig, DistributedDataParallel};
use brigade_tensor::set_compute_threads;
use common::{data, max_diff, rows, Mlp};

const MIB: usize = 1 << 20;

/// Two identical ranks: p0 (1 MiB) ready when backward ends at 10 ms, p1 (1 MiB) at 1 ms; then
/// 1 ms of optimizer.
fn profile() -> StepProfile {
    let rank = |r| RankProfile {
        rank: r,
        backward_start_s: 0.0,
        backward_end_s: 0.010,
        optimizer_start_s: 0.010,
        optimizer_end_s: 0.011,
        step_end_s: 0.011,
        grad_ready_s: vec![0.010, 0.001],
        buckets: vec![],
        gathers: vec![],
        control: vec![],
        policy_s: None,
    };
    StepProfile {
        version: PROFILE_VERSION,
        world_size: 2,
        bucket_cap_mb: 100.0,
        first_bucket_cap_mb: 100.0,
        activation_checkpointing: 0,
        policy: Some(brigade_ddp::overlap::ProfilePolicy {
            name: "allreduce".into(),
            wire: Some(brigade_ddp::overlap::WireModel::AllReduce { bytes_per_element: 4.0 }),
            after_step: None,
        }),
        run: None,
        params: (0..2)
            .map(|i| ParamProfile {
                name: format!("p{i}"),
                bytes: MIB,
                shape: vec![],
            })
            .collect(),
        ranks: vec![rank(0), rank(1)],
    }
}

/// 1 ms per message and 1 GiB/s: over 2 ranks an all-reduce of S bytes takes 2 ms + S / 2^30 s.
fn cfg(candidates: &[f64], min_gain: f64) -> AutotuneConfig {
    AutotuneConfig {
        every: None,
        candidates_mb: candidates.to_vec(),
        first_bucket_cap_mb: 100.0,
        min_gain,
        link: Some(NetModel {
            latency: Duration::from_millis(1),
            bandwidth_bytes_per_s: (1u64 << 30) as f64,
        }),
    }
}

#[test]
fn the_cap_moves_to_the_predicted_best_only_when_the_gain_beats_the_threshold() {
    // Cap 1 MiB: [p1] runs 1..3.977 ms, [p0] runs 10..12.977 ms: step 11 + 2.977 ms.
    // Cap 100 MiB: one bucket [p1, p0] at 10 ms, 2 + 1.953 ms: step 11 + 3.953 ms.
    // From 100, moving to 1 gains 0.977 ms of 14.953 ms (6.5%).
    let p = [profile()];
    let d = decide(&p, 100.0, &cfg(&[1.0, 100.0], 0.02), 7).unwrap();
    let one = 0.011 + 0.002 + 1.0 / 1024.0;
    let hundred = 0.011 + 0.002 + 2.0 / 1024.0;
    assert!((d.predicted_best_step_s - one).abs() < 1e-12, "{d:?}");
    assert!((d.predicted_from_step_s - hundred).abs() < 1e-12, "{d:?}");
    assert_eq!((d.best_cap_mb, d.cap_mb, d.changed, d.after_step), (1.0, 1.0, true, 7));
    // a 10% threshold keeps 100 MiB, though 1 MiB is still the best candidate
    let d = decide(&p, 100.0, &cfg(&[1.0, 100.0], 0.10), 7).unwrap();
    assert_eq!((d.best_cap_mb, d.cap_mb, d.changed), (1.0, 100.0, false));
    // from the best cap itself nothing changes
    let d = decide(&p, 1.0, &cfg(&[1.0, 100.0], 0.0), 7).unwrap();
    assert_eq!((d.cap_mb, d.changed), (1.0, false));
    // nothing to decide from is an error, not a guess
    assert!(decide(&[], 1.0, &cfg(&[1.0], 0.0), 0).is_err());
}

#[test]
fn the_minimum_gain_is_a_fraction_of_the_current_step_on_either_side_of_zero() {
    // From 1 MiB the only candidate, 100 MiB, is predicted slower by f of the current step;
    // from 100 MiB, 1 MiB is predicted faster by g of it (see the test above for the numbers).
    let p = [profile()];
    let one = 0.011 + 0.002 + 1.0 / 1024.0;
    let hundred = 0.011 + 0.002 + 2.0 / 1024.0;
    let f = (hundred - one) / one;
    let g = (hundred - one) / hundred;
    let at = |from: f64, to: f64, min_gain: f64| decide(&p, from, &cfg(&[to], min_gain), 0).unwrap().cap_mb;
    // a negative -x adopts a slower candidate only when it is slower by less than x
    assert_eq!(at(1.0, 100.0, -f * (1.0 + 1e-9)), 100.0);
    assert_eq!(at(1.0, 100.0, -f * (1.0 - 1e-9)), 1.0);
    assert_eq!(at(1.0, 100.0, 0.0), 1.0);
    assert_eq!(at(1.0, 100.0, -1e9), 100.0);
    // a positive x adopts a faster candidate only when it is faster by more than x
    assert_eq!(at(100.0, 1.0, g * (1.0 - 1e-9)), 1.0);
    assert_eq!(at(100.0, 1.0, g * (1.0 + 1e-9)), 100.0);
}

/// Parameter names of each bucket.
fn layout(b: &[BucketInfo]) -> Vec<Vec<String>> {
    b.iter().map(|b| b.params.clone()).collect()
}

/// Trains the MLP on 2 ranks for 5 steps of SGD from a 25 MiB cap; with `tune`, an autotuner
/// that re-checks every 2 steps and must adopt its only candidate (64 floats per bucket)
/// whatever the recorded steps predict of it (a minimum gain of -1e9: adopted unless
/// predicted a billion times slower than the current cap).
/// Returns per rank: the layout after each step, the decisions' steps, the final parameters.
#[allow(clippy::type_complexity)]
fn train(tune: bool, recorder: &Recorder) -> Vec<(Vec<Vec<Vec<String>>>, Vec<(usize, bool)>, Vec<Vec<f32>>)> {
    let (x, y) = data(2 * 4 * 5, 6, 3, 11);
    let small = 256.0 / MIB as f64;
    let results = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&[6, 16, 16, 3], 4);
        let comm = Arc::new(comm.traced(recorder.clone()));
        let ddp_cfg = DdpConfig {
            bucket_cap_mb: if tune { 25.0 } else { small },
            first_bucket_cap_mb: small,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, comm, ddp_cfg, common::average()).unwrap();
        let mut opt = Sgd::new(m.store.params().to_vec(), 0.1, 0.0, 0.0);
        let mut tuner = Autotuner::new(AutotuneConfig {
            every: Some(2),
            candidates_mb: vec![small],
            first_bucket_cap_mb: small,
            min_gain: -1e9,
            link: None,
        })
        .unwrap();
        let (mut layouts, mut decisions) = (vec![], vec![]);
        for step in 0..5 {
            let t0 = Instant::now();
            let (xb, yb) = rows(&x, &y, step * 8 + rank * 4, 4);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
            let t = Instant::now();
            opt.step().unwrap();
            if tune {
                let mine = RankProfile::from_pass(rank, t0, &ddp.last_pass(), &[], (t, Instant::now()), Instant::now());
                if let Some(d) = tuner.observe(&ddp, step, mine).unwrap() {
                    decisions.push((d.after_step, d.changed));
                }
            }
            layouts.push(layout(&ddp.buckets()));
        }
        (layouts, decisions, m.values())
    });
    results.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn a_new_cap_regroups_every_ranks_buckets_alike_and_trains_as_the_fixed_cap() {
    let recorder = Recorder::new();
    let tuned = train(true, &recorder);
    let fixed = train(false, &Recorder::new());
    // checks after steps 0 (the first), 2 and 4; only the first changes the cap
    for (rank, (_, decisions, _)) in tuned.iter().enumerate() {
        assert_eq!(decisions, &[(0, true), (2, false), (4, false)], "rank {rank}");
        let checks = recorder
            .events()
            .iter()
            .filter(|e| e.rank == rank && e.name == "ddp.autotune.decision")
            .count();
        assert_eq!(checks, 3, "rank {rank}: decisions broadcast");
    }
    let (layouts0, ..) = &tuned[0];
    // 25 MiB holds the whole model after the first bucket; the new cap splits it
    assert!(layouts0[0].len() > 2, "{:?}", layouts0[0]);
    // the new buckets follow the order the buckets already had, grouped under the new cap:
    // widths 6,16,16,3 -> params [w0 16x6, b0 16, w1 16x16, b1 16, w2 3x16, b2 3]
    let names = [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
        "layers.2.weight",
        "layers.2.bias",
    ];
    let bytes = [384, 64, 1024, 64, 192, 12];
    let order: Vec<usize> = layouts0[0]
        .iter()
        .flatten()
        .map(|n| names.iter().position(|m| m == n).unwrap())
        .collect();
    let expected: Vec<Vec<String>> = assign_buckets(&bytes, &order, 256, 256)
        .into_iter()
        .map(|g| g.into_iter().map(|p| names[p].to_string()).collect())
        .collect();
    for (rank, (layouts, _, _)) in tuned.iter().enumerate() {
        for (step, l) in layouts.iter().enumerate() {
            assert_eq!(l, &expected, "rank {rank} after step {step}");
            assert_eq!(l, &layouts0[step], "rank {rank} after step {step}: rank 0's layout");
        }
    }
    // the fixed small cap ends with the same buckets, and the same parameters
    assert_eq!(fixed[0].0[4], expected);
    for rank in 0..2 {
        let diff = max_diff(&tuned[rank].2, &fixed[rank].2);
        assert!(diff <= 1e-6, "rank {rank}: parameters differ by {diff}");
    }
}
