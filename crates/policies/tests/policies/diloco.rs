//! DiLoCo and streaming DiLoCo: DiLoCo's degenerate case (SGD inside, H = 1, outer lr 1, no
//! outer momentum) is DDP up to f32 rounding; streaming DiLoCo with one fragment and no overlap
//! is DiLoCo bit for bit; the ranks meet after every sync; a streaming sync in flight is
//! finished before the policy state is gathered; and their specs read, write and refuse.

use crate::common::{max_diff, spec, train, RankRun, Setup};

use std::sync::Arc;

use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_policies::{PolicySpec, Registry};

const WIDTHS: [usize; 4] = [16, 32, 32, 4];

const SETUP: Setup = Setup {
    widths: &WIDTHS,
    steps: 24,
    accum: 1,
    micro: 8,
    bucket_cap_mb: 0.01,
    first_bucket_cap_mb: 0.004,
};

fn params_of(runs: &[RankRun]) -> Vec<Vec<Vec<f32>>> {
    runs.iter().map(|r| r.params.clone()).collect()
}

/// The largest magnitude of any parameter of rank 0.
fn largest(run: &RankRun) -> f32 {
    run.params.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()))
}

#[test]
fn diloco_with_sgd_inside_h_1_outer_lr_1_and_no_momentum_is_ddp_within_f32_rounding() {
    for world in [2, 3] {
        let ddp = train(SETUP, world, "plain-sgd", spec("allreduce"));
        let diloco = train(SETUP, world, "plain-sgd", spec("diloco:1:1:0"));
        // every rank holds the same model after each sync
        for r in 1..world {
            assert_eq!(
                diloco[r].params, diloco[0].params,
                "{world} ranks: rank {r} after the last sync"
            );
        }
        // Each step DDP subtracts fl(η·mean g); DiLoCo subtracts the average of
        // fl(θ − fl(θ − η·g_r)), which is η·g_r rounded to the grid of θ (the inner step's
        // rounding), so each step may move a parameter by about one ulp of |θ| more or less
        // than DDP (plus the average's own rounding). Measured: 3.3 ulps of the largest
        // parameter at 2 ranks, 2.3 at 3, after 24 steps; the bound is 16.
        let ulp = largest(&ddp[0]) * f32::EPSILON;
        let d = max_diff(&diloco[0].params, &ddp[0].params);
        assert!(d <= 16.0 * ulp, "{world} ranks: parameters {d} apart, ulp {ulp}");
        for (a, b) in diloco[0].losses.iter().zip(&ddp[0].losses) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{world} ranks: losses {a} and {b}"
            );
        }
        // and it is not DDP by accident: a period of 2 leaves the ranks apart between syncs
        let two = train(SETUP, world, "plain-sgd", spec("diloco:2:1:0"));
        assert!(max_diff(&two[0].params, &ddp[0].params) > 16.0 * ulp, "{world} ranks");
    }
}

#[test]
fn diloco_sends_nothing_between_syncs_and_the_ranks_meet_at_every_sync() {
    // 24 steps, a sync after every 4th: 6 syncs of every parameter, nothing else sent
    let runs = train(SETUP, 2, "sgd", spec("diloco:4"));
    let plain = train(SETUP, 2, "sgd", spec("allreduce"));
    assert_eq!(runs[0].params, runs[1].params, "the ranks meet at the last step's sync");
    let ratio = runs[0].wire_bytes / plain[0].wire_bytes;
    // (a ring's wire bytes round each buffer's chunks: one flat buffer a sync, buckets a step)
    assert!((ratio - 0.25).abs() < 1e-3, "a quarter of all-reduce's bytes: {ratio}");
    // each rank trained on its own shard: the losses differ between syncs
    assert_ne!(runs[0].losses, runs[1].losses);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(mean(&runs[0].losses[20..]) < mean(&runs[0].losses[..4]), "it trains");
}

#[test]
fn a_diloco_sync_is_one_collective_and_a_streaming_one_is_one_a_fragment() {
    // 24 steps of a 3-layer MLP (6 parameter tensors) at H = 4: 6 syncs, each one all-reduce of
    // one flat buffer of every parameter (not one a tensor, each paying the link's latency);
    // counted beside a period longer than the run, which never syncs
    let base = train(SETUP, 2, "sgd", spec("diloco:25"))[0].collectives;
    for (policy, syncs) in [
        ("diloco:4", 6),
        ("streaming-diloco:4:2", 12),
        ("streaming-diloco:4:2:1:bf16", 12),
        // each fragment's int8 and its scale in one all-gather
        ("streaming-diloco:4:2:1:int8", 12),
    ] {
        let runs = train(SETUP, 2, "sgd", spec(policy));
        for (r, run) in runs.iter().enumerate() {
            assert_eq!(run.collectives - base, syncs, "{policy}: rank {r}'s collectives");
        }
    }
}

#[test]
fn streaming_diloco_with_one_fragment_and_no_overlap_is_diloco_bit_for_bit() {
    for (streaming, diloco) in [
        ("streaming-diloco:4:1:0", "diloco:4"),
        ("streaming-diloco:3:1:0:0.5:0.8", "diloco:3:0.5:0.8"),
    ] {
        let a = train(SETUP, 2, "sgd", spec(streaming));
        let b = train(SETUP, 2, "sgd", spec(diloco));
        assert_eq!(params_of(&a), params_of(&b), "{streaming}: every rank's parameters");
        for r in 0..2 {
            assert_eq!(a[r].losses, b[r].losses, "{streaming}: rank {r}'s losses");
        }
    }
    // with fragments and an overlap it is another run, and it trains
    let s = train(SETUP, 2, "sgd", spec("streaming-diloco:4:2"));
    let d = train(SETUP, 2, "sgd", spec("diloco:4"));
    assert_ne!(s[0].params, d[0].params);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(mean(&s[0].losses[20..]) < mean(&s[0].losses[..4]), "it trains");
    // the same bytes as DiLoCo of the same period: each fragment once a period
    assert!(
        (s[0].wire_bytes - d[0].wire_bytes).abs() < 1e-6,
        "{} {}",
        s[0].wire_bytes,
        d[0].wire_bytes
    );
}

/// Two ranks of streaming DiLoCo (H = 4, two fragments, syncs overlapping one step): fragment 1
/// is issued after step 2 and merged after step 3. After step 2 the policy's own state dict is
/// refused (a sync in flight), and the gathered state (which finishes it first) holds the
/// landed average with the step that merges it.
#[test]
fn a_streaming_sync_in_flight_is_finished_before_the_policy_state_is_gathered() {
    let out = brigade_comm::run_on_threads(2, |comm| {
        brigade_tensor::set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let m = crate::common::Mlp::new(&WIDTHS, 42 + rank as u64);
        let policy = "streaming-diloco:4:2"
            .parse::<PolicySpec>()
            .unwrap()
            .build(&Registry::new())
            .unwrap();
        let ddp = DistributedDataParallel::new(&m.store, comm, DdpConfig::default(), policy).unwrap();
        let full = crate::common::optimizer("sgd", m.store.params().to_vec());
        let mut opt = ddp.optimizer(full, &|p| crate::common::optimizer("sgd", p)).unwrap();
        let (x, y) = crate::common::teacher_data(64, WIDTHS[0], 4, 3);
        for s in 0..2 {
            let (xb, yb) = crate::common::rows(&x, &y, (s * 2 + rank) * 8, 8);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
            brigade_autograd::Optimizer::step(&mut opt).unwrap();
        }
        let refused = ddp.policy_state_dict().err().map(|e| e.to_string());
        let gathered = ddp.gather_policy_state().unwrap();
        (refused, gathered)
    });
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    for (rank, (refused, _)) in out.iter().enumerate() {
        let e = refused.as_ref().expect("a sync in flight cannot be saved as it is");
        assert!(
            e.contains("in flight") && e.contains("finish_in_flight"),
            "rank {rank}: {e}"
        );
    }
    let gathered = &out[0].1;
    let merge_at = gathered
        .iter()
        .find(|(k, _)| k == "rank1/pending.1.merge_at")
        .map(|(_, t)| t.item().unwrap());
    assert_eq!(merge_at, Some(3.0), "merged after step 3");
    assert!(gathered.iter().any(|(k, _)| k.starts_with("rank0/pending.1.")));
    assert!(
        !gathered.iter().any(|(k, _)| k.starts_with("rank0/pending.0.")),
        "fragment 0 is not due yet"
    );
}

#[test]
fn streaming_diloco_s_low_bit_outer_gradients_stay_near_full_precision() {
    // H = 4, two fragments, 24 steps: 6 syncs of each fragment. The outer gradient's rounding
    // (bf16: 2^-9 of each element; int8: half of the fragment's largest magnitude over 127) is
    // not fed back, so the runs part by a little each sync. Bound: a share of how far full
    // precision moved the parameters (measured: bf16 1.1%, int8 2.1%).
    let full = train(SETUP, 2, "sgd", spec("streaming-diloco:4:2"));
    let moved = {
        let zero = train(Setup { steps: 0, ..SETUP }, 2, "sgd", spec("streaming-diloco:4:2"));
        max_diff(&full[0].params, &zero[0].params)
    };
    for (low, share) in [("streaming-diloco:4:2:bf16", 0.02), ("streaming-diloco:4:2:int8", 0.05)] {
        let runs = train(SETUP, 2, "sgd", spec(low));
        let d = max_diff(&runs[0].params, &full[0].params);
        assert!(d > 0.0, "{low}: the outer gradient is rounded");
        assert!(
            d <= share * moved,
            "{low}: {d} from full precision, which moved {moved}"
        );
        let last = |r: &RankRun| r.losses[SETUP.steps - 1];
        assert!(
            (last(&runs[0]) - last(&full[0])).abs() <= 0.02 * last(&full[0]),
            "{low}: losses"
        );
    }
}

#[test]
fn diloco_specs_read_write_and_refuse() {
    for (text, canonical) in [
        ("diloco:10", "diloco:10"),
        ("diloco:10:0.7", "diloco:10"),
        ("diloco:10:0.7:0.9", "diloco:10"),
        ("diloco:10:1", "diloco:10:1"),
        ("diloco:1:1:0", "diloco:1:1:0"),
        ("diloco:5:0.5:-0", "diloco:5:0.5:0"),
        ("streaming-diloco:10:2", "streaming-diloco:10:2"),
        ("streaming-diloco:10:2:1", "streaming-diloco:10:2"),
        ("streaming-diloco:10:2:0", "streaming-diloco:10:2:0"),
        ("streaming-diloco:10:2:1:0.5", "streaming-diloco:10:2:1:0.5"),
        ("streaming-diloco:4:1:0:0.5:0.8", "streaming-diloco:4:1:0:0.5:0.8"),
        ("streaming-diloco:10:2:bf16", "streaming-diloco:10:2:bf16"),
        ("streaming-diloco:10:2:1:int8", "streaming-diloco:10:2:int8"),
        ("streaming-diloco:10:2:0:int8", "streaming-diloco:10:2:0:int8"),
        (
            "streaming-diloco:4:1:0:0.5:0.8:bf16",
            "streaming-diloco:4:1:0:0.5:0.8:bf16",
        ),
    ] {
        let spec: PolicySpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(spec.to_string(), canonical, "{text}");
        assert_eq!(spec.build(&Registry::new()).unwrap().name(), canonical, "{text}");
        assert_eq!(canonical.parse::<PolicySpec>().unwrap(), spec);
    }
    for (bad, says) in [
        ("diloco", "period"),
        ("diloco:0", ">= 1"),
        ("diloco:x", ">= 1"),
        ("diloco:4:0", "more than 0"),
        ("diloco:4:nan", "more than 0"),
        ("diloco:4:0.7:1", "under 1"),
        ("diloco:4:0.7:0.9:1", "too many"),
        ("streaming-diloco:4", "fragments"),
        ("streaming-diloco:4:5", "FRAGMENTS must be 1 to H = 4"),
        ("streaming-diloco:4:2:4", "DELAY must be under H = 4"),
        ("streaming-diloco:4:2:x", "DELAY"),
        ("streaming-diloco:4:2:int4", "DELAY"),
        ("streaming-diloco:4:bf16", "FRAGMENTS"),
        ("streaming-diloco:4:2:1:0.7:0.9:bf16:int8", "too many"),
    ] {
        let e = bad
            .parse::<PolicySpec>()
            .err()
            .unwrap_or_else(|| panic!("{bad} parsed"))
            .to_string();
        assert!(e.contains(says) && !e.contains('\n'), "{bad}: {e}");
    }
    // PowerSGD's settings flags give a bare `powersgd` its rank, not a bare `diloco`
    let e = PolicySpec::parse_with_settings("diloco", 4, 10)
        .unwrap_err()
        .to_string();
    assert!(e.contains("period"), "{e}");
}

#[test]
fn streaming_diloco_with_more_fragments_than_parameters_is_one_error() {
    let out = brigade_comm::run_on_threads(1, |comm| {
        let comm = Arc::new(comm);
        let m = crate::common::Mlp::new(&[4, 3], 1); // a weight and a bias
        let policy = "streaming-diloco:6:3"
            .parse::<PolicySpec>()
            .unwrap()
            .build(&Registry::new())
            .unwrap();
        let ddp = DistributedDataParallel::new(&m.store, comm, DdpConfig::default(), policy).unwrap();
        let full = crate::common::optimizer("sgd", m.store.params().to_vec());
        ddp.optimizer(full, &|p| crate::common::optimizer("sgd", p))
            .err()
            .map(|e| e.to_string())
    });
    let e = out.into_iter().next().unwrap().unwrap().expect("refused");
    assert!(e.contains("3 fragments") && e.contains("2 parameters"), "{e}");
}
