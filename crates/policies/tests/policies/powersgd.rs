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
