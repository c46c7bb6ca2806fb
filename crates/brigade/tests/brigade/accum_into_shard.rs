//! Accumulation into the gradient shard (`DataConfig::accum_into_shard`) under ZeRO-2 and
//! ZeRO-3 at two ranks: the trained parameters within rounding of `no_sync` accumulation, a
//! whole-run peak lower by at least the full gradients it no longer holds across the
//! microbatches, and the combinations it does not make sense in refused before any step; with
//! clipping and in bf16 and fp16 within their rounding of `no_sync`; a resume bit for bit.

use std::sync::Arc;

use brigade::config::CheckpointConfig;
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Gpt, GptConfig, Model};
use brigade::policies::PolicySpec;
use brigade::tensor::DType;
use brigade::{fit, Error, MixedPrecision, OptimizerConfig, RunReport, TrainConfig};

use crate::common::{self, resuming};

/// Sixteen equal blocks beside the embedding and the head: each unit is a small part of the model.
fn gpt() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 32,
        n_layers: 16,
        n_heads: 2,
        d_ff: 128,
        context: 8,
        dtype: DType::F32,
        dropout: 0.0,
    }
}

fn config(policy: PolicySpec, accum: usize, into_shard: bool) -> TrainConfig {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let mut c = TrainConfig::new(3, 2, sgd);
    c.model.name = "gpt".into();
    c.data.accum = accum;
    c.data.accum_into_shard = into_shard;
    c.runtime.compute_threads = Some(1);
    let d = c.distributed.get_or_insert_default();
    d.policy = Arc::new(policy);
    // ZeRO-2's buckets by DDP's caps: about one block each (ZeRO-3's are the units)
    (d.ddp.bucket_cap_mb, d.ddp.first_bucket_cap_mb) = (CAP_MB, CAP_MB);
    c
}

/// The bucket cap, in MiB: a bucket closes at the first parameter that takes it past this.
const CAP_MB: f64 = 0.04;

fn run(cfg: &TrainConfig) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(2),
        cfg,
        |_| Dataset::builtin_text(8, 0).map_err(Error::from),
        |_| Ok(Box::new(Gpt::new(gpt(), 7)?) as Box<dyn Model>),
    )
}

#[test]
fn accumulating_into_the_shard_trains_as_no_sync_does_within_rounding() {
    // The two ways add the same four f32 gradients per element (2 microbatches x 2 ranks) in
    // another order: (a1 + a2) + (b1 + b2) against (a1 + b1) + (a2 + b2), which differ by at
    // most a few units in the last place of the sum of magnitudes (2^-23 relative, about
    // 1.2e-7). SGD at lr 0.1 moves a parameter by lr times the gradient, so each of the 3 steps
    // adds at most about 0.1 x 4 x 1.2e-7 x |g| (|g| < 1 here) to the difference, and the steps
    // after carry it on through the model: 1e-6 of a parameter's size (plus 1e-6 absolute) is
    // a margin of more than ten over that, and far below what a lost or doubled microbatch
    // moves (lr x |g| / 2, about 1e-3 here).
    for policy in [PolicySpec::Zero2, PolicySpec::Zero3] {
        let default = run(&config(policy.clone(), 2, false)).unwrap();
        let shard = run(&config(policy.clone(), 2, true)).unwrap();
        for (a, b) in shard.outcome.losses().iter().zip(default.outcome.losses()) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{policy}: loss {a} vs {b}");
        }
        assert_eq!(shard.outcome.params.len(), default.outcome.params.len());
        for ((n, a), (_, b)) in shard.outcome.params.iter().zip(&default.outcome.params) {
            let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-6 + 1e-6 * y.abs(), "{policy} {n}: {x} vs {y}");
            }
        }
    }
}

#[test]
fn accumulating_into_the_shard_lowers_the_runs_peak_by_the_full_gradients() {
    // Parameters (f32): the embedding 256 x 32 + 8 x 32, sixteen blocks of 2 norms (2 x 32 each), qkv 32 x 96 + 96, the projection 32 x 32 + 32, the
    // feed-forward 32 x 128 + 128 and 128 x 32 + 32, and the head (its norm and 32 x 256, no bias).
    let block = 4 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32);
    let embed = 256 * 32 + 8 * 32;
    let head = 2 * 32 + 32 * 256;
    let psi = embed + 16 * block + head;
    // A bucket: ZeRO-3's are the units; ZeRO-2's close at the first parameter past the cap
    // (the largest parameter: the embedding's or the head's 256 x 32).
    let cap = (CAP_MB * 1024.0 * 1024.0) as usize / 4;
    let unit = block.max(embed).max(head).max(cap + 256 * 32);
    // `no_sync` holds every bucket's full gradients (psi) from the first microbatch's backward
    // on. Into the shard, the full buffers alive are a few buckets (the one filling, the one
    // reduced, the one before it, landed as the next is launched: three at most), and the rank
    // keeps its gradient shard (psi / 2, and a bucket's half while it adds in) across the
    // microbatches, which `no_sync` drops in the first backward: the peak is lower by at
    // least 4 x (psi - psi / 2 - 3 unit - unit / 2) bytes.
    let saving = 4 * (psi - psi / 2 - 3 * unit - unit / 2);
    // a model where it matters: more than a tenth of the full gradients
    assert!(10 * saving > 4 * psi, "{saving} bytes");
    for policy in [PolicySpec::Zero2, PolicySpec::Zero3] {
        let peak = |into_shard| {
            let r = run(&config(policy.clone(), 4, into_shard)).unwrap();
            r.outcome.memory.unwrap().peak
        };
        let (default, shard) = (peak(false), peak(true));
        assert!(
            shard + saving <= default,
            "{policy}: the peak into the shard is {shard} bytes, with no_sync {default}: less than {saving} lower"
        );
    }
}

#[test]
fn accumulating_into_the_shard_without_a_gradient_shard_or_microbatches_is_refused() {
    for (policy, accum, want) in [
        (PolicySpec::Zero1, 2, "ZeRO stage 2 or 3"),
        (PolicySpec::AllReduce, 2, "ZeRO stage 2 or 3"),
        (PolicySpec::Zero2, 1, "2 or more microbatches"),
        (PolicySpec::Zero3, 1, "2 or more microbatches"),
    ] {
        let Err(err) = run(&config(policy.clone(), accum, true)) else {
            panic!("{policy} accum {accum}: trained");
        };
        let err = err.to_string();
        assert!(
            err.contains(want) && !err.contains('\n'),
            "{policy} accum {accum}: {err}"
        );
    }
}

/// `||a - b|| / ||b - start||` over every parameter: how far apart two runs ended, against how
/// far the second moved.
fn apart_over_moved(a: &RunReport, b: &RunReport) -> f64 {
    let start = Gpt::new(gpt(), 7).unwrap();
    let (mut apart, mut moved) = (0.0, 0.0);
    assert_eq!(a.outcome.params.len(), b.outcome.params.len());
    let starts = start.params().params();
    for (((n, a), (_, b)), p0) in a.outcome.params.iter().zip(&b.outcome.params).zip(starts) {
        let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
        let p0 = p0.value().to_f64_vec().unwrap();
        assert_eq!((a.len(), b.len()), (p0.len(), p0.len()), "{n}");
        for ((x, y), z) in a.iter().zip(&b).zip(&p0) {
            apart += (x - y) * (x - y);
            moved += (y - z) * (y - z);
        }
    }
    (apart / moved).sqrt()
}

#[test]
fn accumulating_into_the_shard_clips_and_runs_in_bf16_and_fp16_as_no_sync_does_within_rounding() {
    // f32 with clipping: the norm is summed over the shards in another order and the clipped
    // step scales by it, so the runs part by f32 rounding of the movement (1e-6 of it here);
    // bf16 and fp16: the sums of the 2 x 2 gradients round to 8 and 11 bits in another order,
    // about 2^-8 and 2^-11 of a step. A microbatch lost or counted twice moves the parameters by
    // a third or more of their movement: 1e-3 and 2e-2 of it are margins both ways.
    type Set = fn(&mut TrainConfig);
    let cases: [(&str, Set, f64); 3] = [
        ("f32 clipped", |c| c.recipe.clip_grad_norm = Some(0.05), 1e-3),
        (
            "bf16",
            |c| c.recipe.precision = MixedPrecision::uniform(DType::BF16),
            2e-2,
        ),
        (
            "fp16",
            |c| c.recipe.precision = MixedPrecision::uniform(DType::F16),
            2e-2,
        ),
    ];
    for policy in [PolicySpec::Zero2, PolicySpec::Zero3] {
        for (what, set, tolerance) in cases {
            let trained = |into_shard| {
                let mut c = config(policy.clone(), 2, into_shard);
                set(&mut c);
                run(&c).unwrap_or_else(|e| panic!("{policy} {what}: {e}"))
            };
            let (default, shard) = (trained(false), trained(true));
            for (a, b) in shard.outcome.losses().iter().zip(default.outcome.losses()) {
                assert!((a - b).abs() <= tolerance * b.abs(), "{policy} {what}: loss {a} vs {b}");
            }
            if what == "f32 clipped" {
                for (a, b) in shard.outcome.grad_norms().iter().zip(default.outcome.grad_norms()) {
                    let (a, b) = (a.unwrap(), b.unwrap());
                    assert!(
                        b > 0.05 && (a - b).abs() <= 1e-5 * b,
                        "{policy}: clipped norm {a} vs {b}"
                    );
                }
            }
            let ratio = apart_over_moved(&shard, &default);
            assert!(ratio <= tolerance, "{policy} {what}: {ratio} of the movement apart");
        }
    }
}

#[test]
fn accumulating_into_the_shard_resumes_bit_for_bit() {
    let dir = common::tmp("accum_into_shard", "resume");
    for policy in [PolicySpec::Zero2, PolicySpec::Zero3] {
        let path = dir.join(format!("{policy}.safetensors"));
        let steps = |n: usize| {
            let mut c = config(policy.clone(), 2, true);
            c.recipe.steps = n;
            c
        };
        let straight = run(&steps(4)).unwrap();
        let mut half = steps(2);
        half.runtime.checkpoint = CheckpointConfig {
            path: Some(path.clone()),
            ..CheckpointConfig::default()
        };
        run(&half).unwrap();
        let resumed = run(&resuming(steps(4), &path)).unwrap();
        assert_eq!(resumed.outcome.losses(), straight.outcome.losses()[2..], "{policy}");
        for ((n, a), (_, b)) in resumed.outcome.params.iter().zip(&straight.outcome.params) {
            assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap(), "{policy} {n}");
        }
    }
}
