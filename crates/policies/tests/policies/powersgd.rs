//! PowerSGD through DDP: a run that never compressed says so, and its buffers are counted.

use crate::common::{spec, train, Setup};

const WIDTHS: [usize; 4] = [16, 64, 64, 4];

fn setup(steps: usize, widths: &'static [usize]) -> Setup {
    Setup {
        widths,
        steps,
        accum: 1,
        micro: 8,
        bucket_cap_mb: 0.01,
        first_bucket_cap_mb: 0.004,
    }
}

#[test]
fn a_powersgd_run_that_never_compressed_says_so_and_why() {
    // 3 steps before the default start iteration 10
    let short = train(setup(3, &WIDTHS), 2, "sgd", spec("powersgd:2"));
    for r in &short {
        assert_eq!(r.diagnostics.len(), 1, "{:?}", r.diagnostics);
        let d = &r.diagnostics[0];
        assert!(
            d.contains("never compressed") && d.contains("start iteration 10") && d.contains("3 iteration"),
            "{d}"
        );
    }
    // a model whose matrices are all too small to shrink: nothing to compress, said so
    const TINY: [usize; 3] = [4, 4, 4];
    let tiny = train(setup(4, &TINY), 2, "sgd", spec("powersgd:2@1"));
    let d = &tiny[0].diagnostics[0];
    assert!(
        d.contains("compressed no tensor") && d.contains("min compression rate"),
        "{d}"
    );
    // a run that compressed says nothing
    let ok = train(setup(3, &WIDTHS), 2, "sgd", spec("powersgd:2@1"));
    assert!(ok[0].diagnostics.is_empty(), "{:?}", ok[0].diagnostics);
    // and the other policies have nothing to say
    assert!(train(setup(2, &WIDTHS), 2, "sgd", spec("fp16"))[0]
        .diagnostics
        .is_empty());
}

#[test]
fn powersgds_error_feedback_and_factors_are_counted_in_rank_memory() {
    // Once compressing, every parameter keeps its error feedback (f32, 4 bytes an element), and
    // each compressed matrix n x m its Q (m x r): here [64, 16] and [64, 64] at r = 2 ([4, 64]
    // shrinks too little: (4 + 64)·2·2 >= 4·64).
    let psi: usize = WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    let q = (16 + 64) * 2;
    let run = train(setup(3, &WIDTHS), 2, "sgd", spec("powersgd:2@1"));
    assert_eq!(run[0].memory.policy_state, 4 * (psi + q));
    let plain = train(setup(3, &WIDTHS), 2, "sgd", spec("allreduce"));
    assert_eq!(plain[0].memory.policy_state, 0);
    assert_eq!(run[0].memory.total(), plain[0].memory.total() + 4 * (psi + q));
}

#[test]
fn powersgds_wire_model_sizes_the_factors_of_each_matrix_that_compresses() {
    use brigade_ddp::policy::WireModel;
    let policy = spec("powersgd:4@10")(0);
    // [512, 256] compresses at rank 4 ((512 + 256)·4·2 < 512·256): P 512 x 4, Q 256 x 4; a bias
    // and a [3, 2] matrix that shrinks less than the rate 2 ((3 + 2)·2·2 ≥ 6) are sent whole
    let shapes = vec![vec![512, 256], vec![256], vec![3, 2]];
    assert_eq!(
        policy.wire_model(&shapes, 2),
        Some(WireModel::LowRank {
            start_iter: 10,
            factors: vec![Some((512 * 4, 256 * 4)), None, None],
        })
    );
}

/// One rank's collectives (`op`, bytes) and its result of each step.
type TracedRank = (Vec<(String, usize)>, Vec<Vec<f32>>);

/// Each rank's collectives and results for one bucket of `shapes` reduced by `cfg`'s PowerSGD
/// on 2 thread ranks, traced, `steps` times.
fn traced_steps(cfg: brigade_policies::PowerSgdConfig, shapes: &[&[usize]], steps: usize) -> Vec<TracedRank> {
    use crate::direct::{bucket, randn, reduce};
    use brigade_comm::{run_on_threads_with_timeout, Recorder, Track};
    use brigade_ddp::group::HostGroup;
    use std::sync::Arc;
    use std::time::Duration;
    let len: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let recorder = Recorder::new();
    let outs = run_on_threads_with_timeout(2, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let group: brigade_ddp::Group = Arc::new(HostGroup::new(Arc::new(comm.traced(recorder.clone()))));
        let mut p = brigade_policies::PowerSgd::new(cfg).unwrap();
        (0..steps)
            .map(|s| {
                reduce(
                    &mut p,
                    bucket(0, randn(len, (10 * s + rank) as u64), shapes, true),
                    &group,
                )
                .unwrap()
            })
            .collect::<Vec<_>>()
    });
    let events = recorder.events();
    outs.into_iter()
        .enumerate()
        .map(|(rank, out)| {
            let ops = events
                .iter()
                .filter(|e| e.rank == rank && e.track == Track::Comm)
                .map(|e| (e.op.clone(), e.bytes))
                .collect();
            (ops, out.unwrap())
        })
        .collect()
}

#[test]
fn a_compressed_bucket_is_two_all_reduces_the_plain_tensors_riding_with_the_ps() {
    let cfg = brigade_policies::PowerSgdConfig {
        rank: 2,
        start_iter: 1,
        ..Default::default()
    };
    let ar = |bytes: usize| ("all_reduce".to_string(), bytes);
    // a bias [7] and a [3, 2] matrix that shrinks too little are sent whole (13 elements); a
    // [12, 10] matrix at rank 2 as P 12 x 2 and Q 10 x 2. Step 0 (before the start) is one
    // plain all-reduce of the bucket; step 1 the plain tensors with the P's, then the Q's.
    let mixed = traced_steps(cfg, &[&[7], &[12, 10], &[3, 2]], 2);
    for (ops, _) in &mixed {
        assert_eq!(ops, &[ar(4 * 133), ar(4 * (13 + 24)), ar(4 * 20)]);
    }
    assert_eq!(mixed[0].1, mixed[1].1, "every rank ends with the same result");
    // a bucket of matrices only: P, then Q
    let matrices = traced_steps(cfg, &[&[12, 10], &[8, 16]], 2);
    for (ops, _) in &matrices {
        assert_eq!(ops, &[ar(4 * 248), ar(4 * (24 + 16)), ar(4 * (20 + 32))]);
    }
    // a bucket with nothing to compress: one all-reduce of the plain tensors, every step
    let plain = traced_steps(cfg, &[&[7], &[3, 2]], 2);
    let (g0, g1) = (crate::direct::randn(13, 10), crate::direct::randn(13, 11));
    let avg: Vec<f32> = g0.iter().zip(&g1).map(|(a, b)| (a + b) / 2.0).collect();
    for (ops, out) in &plain {
        assert_eq!(ops, &[ar(4 * 13), ar(4 * 13)]);
        assert_eq!(out[1], avg, "step 1 is the exact average");
    }
}

#[test]
fn powersgds_wire_model_prices_a_compressed_bucket_as_two_all_reduces() {
    use brigade_comm::RingOp;
    let policy = spec("powersgd:4@10")(0);
    // [512, 256] as P 512 x 4 and Q 256 x 4; the bias [256] and the [3, 2] matrix whole
    let shapes = vec![vec![512, 256], vec![256], vec![3, 2]];
    let bytes: Vec<usize> = shapes.iter().map(|s| 4 * s.iter().product::<usize>()).collect();
    let wire = policy.wire_model(&shapes, 2).unwrap();
    let plain = 4.0 * (256.0 + 6.0);
    assert_eq!(
        wire.bucket_ops(&[0, 1, 2], &bytes, 2),
        vec![
            (RingOp::AllReduce, plain + 4.0 * 512.0 * 4.0),
            (RingOp::AllReduce, 4.0 * 256.0 * 4.0)
        ]
    );
    // two latencies of the ring a collective: 2(n - 1) messages each
    assert_eq!(wire.bucket_price(&[0, 1, 2], &bytes, 3).messages, 2.0 * 4.0);
    // nothing to compress: the plain all-reduce alone
    assert_eq!(wire.bucket_ops(&[1, 2], &bytes, 2), vec![(RingOp::AllReduce, plain)]);
}
