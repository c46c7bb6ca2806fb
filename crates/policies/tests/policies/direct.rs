//! Built-in policies driven directly over the thread backend (no DDP): each against a
//! reference computed here.

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{run_on_threads_with_timeout, ReduceOp};
use brigade_ddp::group::HostGroup;
use brigade_ddp::policy::{BucketParam, Group, PolicyBucket, Reduction};
use brigade_ddp::ReducerPolicy;
use brigade_policies::{AllReduce, Compress, HalfType, PowerSgd, PowerSgdConfig};
use brigade_tensor::{Rng, Tensor};
use half::{bf16, f16};

const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f(rank, collectives)` on `world` thread ranks and returns each rank's result.
pub fn on_ranks<R: Send>(world: usize, f: impl Fn(usize, Group) -> R + Sync) -> Vec<R> {
    run_on_threads_with_timeout(world, TIMEOUT, |comm| {
        let rank = comm.rank();
        let comm = Arc::new(comm);
        f(rank, Arc::new(HostGroup::new(comm)))
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.normal() as f32).collect()
}

/// A bucket of `buffer` holding parameters of `shapes`, in order.
pub fn bucket(index: usize, buffer: Vec<f32>, shapes: &[&[usize]], is_last: bool) -> PolicyBucket {
    let mut offset = 0;
    let params = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let p = BucketParam {
                index: i,
                name: format!("p{i}"),
                offset,
                shape: s.to_vec(),
            };
            offset += p.len();
            p
        })
        .collect();
    assert_eq!(offset, buffer.len());
    let n = buffer.len();
    PolicyBucket {
        index,
        tensor: Tensor::from_vec(buffer, &[n]).unwrap(),
        params,
        grad_numel: n,
        is_last,
        generation: 0,
    }
}

/// Reduces `bucket` with `policy` and waits: the bucket's new contents.
pub fn reduce(policy: &mut dyn ReducerPolicy, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Vec<f32>> {
    match policy.reduce(bucket, comm)? {
        Reduction::Full(w) => Ok(w.wait()?.to_vec()?),
        Reduction::Shard { .. } => panic!("a full reduction was expected"),
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn the_all_reduce_policy_is_the_averaging_all_reduce_bit_for_bit() {
    let out = on_ranks(3, |rank, comm| {
        let g = randn(1000, rank as u64);
        let policy = reduce(&mut AllReduce, bucket(0, g.clone(), &[&[1000]], true), &comm).unwrap();
        (policy, g)
    });
    // the reference: f32 sums in rank order, divided by the world size (what the thread
    // backend's Avg does)
    let want: Vec<f32> = (0..1000)
        .map(|i| out.iter().map(|(_, g)| g[i]).sum::<f32>() / 3.0)
        .collect();
    for (got, _) in &out {
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn fp16_and_bf16_equal_divide_round_sum_widen() {
    let world = 3;
    let grads: Vec<Vec<f32>> = (0..world)
        .map(|r| randn(777, 10 + r as u64).iter().map(|x| x * 3.0).collect())
        .collect();
    for half in [HalfType::F16, HalfType::BF16] {
        let out = on_ranks(world, |rank, comm| {
            reduce(
                &mut Compress::new(half),
                bucket(1, grads[rank].clone(), &[&[777]], false),
                &comm,
            )
            .unwrap()
        });
        // reference: each rank rounds g/world to 16 bits; the sum runs in f32 in rank order and is
        // rounded to 16 bits once; the result is widened
        let round = |x: f32| match half {
            HalfType::F16 => f16::from_f32(x).to_f32(),
            HalfType::BF16 => bf16::from_f32(x).to_f32(),
        };
        let want: Vec<f32> = (0..777)
            .map(|i| round((0..world).map(|r| round(grads[r][i] / world as f32)).sum::<f32>()))
            .collect();
        for (r, got) in out.iter().enumerate() {
            assert_eq!(got, &want, "{half:?} rank {r}");
        }
        let exact: Vec<f32> = (0..777)
            .map(|i| grads.iter().map(|g| g[i]).sum::<f32>() / world as f32)
            .collect();
        let tol = if half == HalfType::F16 { 1e-2 } else { 6e-2 };
        assert!(max_abs_diff(&out[0], &exact) < tol, "{half:?}");
    }
}

#[test]
fn an_fp16_overflow_is_reported_as_such_naming_the_bucket_and_the_largest_gradient() {
    // rank 1 holds a gradient of 2e5: its share (1e5 on 2 ranks) is past fp16's 65504
    let out = on_ranks(2, |rank, comm| {
        let mut g = randn(64, rank as u64);
        if rank == 1 {
            g[17] = 2.0e5;
        }
        reduce(&mut Compress::new(HalfType::F16), bucket(3, g, &[&[8, 8]], true), &comm)
            .unwrap_err()
            .to_string()
    });
    for e in out {
        assert!(e.contains("overflow in bucket 3") && e.contains("2.0000e5"), "{e}");
        assert!(e.contains("bf16") && e.contains("learning rate does not help"), "{e}");
    }
    // bf16 has f32's range: the same gradients go through
    let ok = on_ranks(2, |rank, comm| {
        let mut g = randn(64, rank as u64);
        if rank == 1 {
            g[17] = 2.0e5;
        }
        reduce(
            &mut Compress::new(HalfType::BF16),
            bucket(3, g, &[&[8, 8]], true),
            &comm,
        )
        .unwrap()
    });
    assert!((ok[0][17] - 1.0e5).abs() < 1e3, "{}", ok[0][17]);
    // a gradient that is already NaN is not an overflow: it passes on for the run's own checks
    let nan = on_ranks(2, |rank, comm| {
        let mut g = randn(64, rank as u64);
        if rank == 0 {
            g[3] = f32::NAN;
        }
        reduce(&mut Compress::new(HalfType::F16), bucket(0, g, &[&[64]], true), &comm).unwrap()
    });
    assert!(nan[0][3].is_nan() && nan[1][3].is_nan());
}

/// PowerSGD with compression from the first iteration (no per-step state).
fn stateless(rank: usize) -> PowerSgd {
    PowerSgd::new(PowerSgdConfig {
        rank,
        start_iter: 0,
        use_error_feedback: false,
        warm_start: false,
        min_compression_rate: 1.0,
        seed: 7,
    })
    .unwrap()
}

/// A (n × m) matrix of rank `k`: a sum of `k` outer products.
fn low_rank(n: usize, m: usize, k: usize, seed: u64) -> Vec<f32> {
    let (u, v) = (randn(n * k, seed), randn(m * k, seed + 100));
    (0..n * m)
        .map(|ij| (0..k).map(|t| u[(ij / m) * k + t] * v[(ij % m) * k + t]).sum())
        .collect()
}

#[test]
fn powersgd_reconstructs_a_matrix_of_rank_at_most_r() {
    // Every rank holds the same rank-2 matrix: one power iteration with r = 2 spans its column
    // space, so P·Qᵀ is the matrix itself (the average of identical gradients).
    let g = low_rank(32, 24, 2, 1);
    let out = on_ranks(2, |_, comm| {
        reduce(&mut stateless(2), bucket(0, g.clone(), &[&[32, 24]], true), &comm).unwrap()
    });
    let scale = g.iter().fold(0.0f32, |a, x| a.max(x.abs()));
    for got in &out {
        assert!(
            max_abs_diff(got, &g) <= 1e-4 * scale,
            "off by {}",
            max_abs_diff(got, &g)
        );
    }
    // a rank-1 approximation of it is not exact (the test can tell)
    let one = on_ranks(2, |_, comm| {
        reduce(&mut stateless(1), bucket(0, g.clone(), &[&[32, 24]], true), &comm).unwrap()
    });
    assert!(max_abs_diff(&one[0], &g) > 1e-2 * scale);
}

#[test]
fn powersgd_sends_1d_and_incompressible_tensors_uncompressed() {
    // bias [7] (1-D) and a 3 × 2 matrix ((3 + 2)·1·2 ≥ 3·2: rate 2 does not compress it): both
    // come back as the exact average
    let cfg = PowerSgdConfig {
        start_iter: 0,
        use_error_feedback: false,
        warm_start: false,
        ..Default::default()
    };
    let grads: Vec<Vec<f32>> = (0..2).map(|r| randn(13, 40 + r)).collect();
    let out = on_ranks(2, |rank, comm| {
        let mut p = PowerSgd::new(cfg).unwrap();
        reduce(&mut p, bucket(0, grads[rank].clone(), &[&[7], &[3, 2]], true), &comm).unwrap()
    });
    let avg: Vec<f32> = (0..13).map(|i| (grads[0][i] + grads[1][i]) / 2.0).collect();
    assert_eq!(out[0], avg);
    assert_eq!(out[1], avg);
}

#[test]
fn powersgd_on_two_ranks_equals_one_rank_when_they_hold_the_same_gradient() {
    // P = Σ_r M·Q_r: if the ranks drew different Q, two ranks holding M would not give what one
    // rank holding M gives.
    let g = randn(20 * 30, 3);
    let two = on_ranks(2, |_, comm| {
        reduce(&mut stateless(3), bucket(0, g.clone(), &[&[20, 30]], true), &comm).unwrap()
    });
    let one = on_ranks(1, |_, comm| {
        reduce(&mut stateless(3), bucket(0, g.clone(), &[&[20, 30]], true), &comm).unwrap()
    });
    assert!(
        max_abs_diff(&two[0], &one[0]) < 1e-4,
        "{}",
        max_abs_diff(&two[0], &one[0])
    );
    assert_eq!(two[0], two[1]);
}

#[test]
fn powersgd_runs_plain_all_reduce_before_its_start_iteration() {
    let cfg = PowerSgdConfig {
        rank: 1,
        start_iter: 2,
        ..Default::default()
    };
    let grads: Vec<Vec<f32>> = (0..2).map(|r| randn(64, 50 + r)).collect();
    let out = on_ranks(2, |rank, comm| {
        let mut p = PowerSgd::new(cfg).unwrap();
        (0..3)
            .map(|_| reduce(&mut p, bucket(0, grads[rank].clone(), &[&[8, 8]], true), &comm).unwrap())
            .collect::<Vec<_>>()
    });
    let avg: Vec<f32> = (0..64).map(|i| (grads[0][i] + grads[1][i]) / 2.0).collect();
    assert_eq!(out[0][0], avg, "iteration 0 is plain");
    assert_eq!(out[0][1], avg, "iteration 1 is plain");
    assert!(max_abs_diff(&out[0][2], &avg) > 1e-3, "iteration 2 is compressed");
}

#[test]
fn error_feedback_keeps_the_error_bounded_and_the_mean_converges() {
    // A fixed full-rank gradient, rank-1 compression: with error feedback what is dropped is sent
    // later, so the running mean of the outputs converges to the gradient; without it the mean
    // stays a rank-1 approximation.
    let g = randn(16 * 16, 9);
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let run = |ef: bool| {
        let cfg = PowerSgdConfig {
            rank: 1,
            start_iter: 2,
            use_error_feedback: ef,
            warm_start: true,
            min_compression_rate: 1.0,
            seed: 0,
        };
        on_ranks(1, |_, comm| {
            let mut p = PowerSgd::new(cfg).unwrap();
            let (mut sum, mut worst_error, steps) = (vec![0.0f32; g.len()], 0.0f32, 400);
            for _ in 0..steps {
                let out = reduce(&mut p, bucket(0, g.clone(), &[&[16, 16]], true), &comm).unwrap();
                sum.iter_mut().zip(&out).for_each(|(s, o)| *s += o);
                worst_error = worst_error.max(p.error(0).map_or(0.0, |e| norm(&e)));
            }
            let mean: Vec<f32> = sum.iter().map(|s| s / steps as f32).collect();
            (
                norm(&mean.iter().zip(&g).map(|(a, b)| a - b).collect::<Vec<_>>()) / norm(&g),
                worst_error / norm(&g),
            )
        })
        .remove(0)
    };
    let (with_ef, bounded) = run(true);
    assert!(with_ef < 0.05, "mean is {with_ef} off with error feedback");
    assert!(bounded < 20.0, "error grew to {bounded} x |g|");
    let (without, _) = run(false);
    assert!(
        without > 0.3,
        "without error feedback the mean is only {without} off: the test cannot tell"
    );
}

#[test]
fn powersgd_keeps_every_ranks_collectives_in_the_same_order_across_buckets() {
    // Three buckets handed over back to back: each issues up to two collectives, chained after
    // the previous bucket's, so no rank interleaves them differently (the backend would report a
    // mismatch).
    let out = on_ranks(2, |rank, comm| {
        let mut p = stateless(2);
        let works: Vec<_> = (0..3)
            .map(|b| {
                let g = randn(7 + 12 * 10, (rank * 10 + b) as u64);
                match p.reduce(bucket(b, g, &[&[7], &[12, 10]], b == 2), &comm).unwrap() {
                    Reduction::Full(w) => w,
                    Reduction::Shard { .. } => unreachable!(),
                }
            })
            .collect();
        works
            .into_iter()
            .map(|w| w.wait().unwrap().to_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(out[0], out[1]);
}

#[test]
fn bad_powersgd_settings_are_refused_with_the_reason() {
    let e = PowerSgd::new(PowerSgdConfig {
        rank: 0,
        ..Default::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("at least 1"), "{e}");
    let e = PowerSgd::new(PowerSgdConfig {
        min_compression_rate: 0.5,
        ..Default::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains(">= 1"), "{e}");
    // a start at 0 or 1 is fine: the state is kept per parameter, DDP's rebuild cannot strand it
    assert!(PowerSgd::new(PowerSgdConfig {
        start_iter: 1,
        ..Default::default()
    })
    .is_ok());
}

#[test]
fn integer_payloads_are_refused_by_reductions_with_the_rule() {
    let out = on_ranks(2, |_, comm| {
        let q = Tensor::from_vec(vec![1i8, 2, 3, 4], &[4]).unwrap();
        comm.all_reduce(&q, ReduceOp::Sum, "q").wait().unwrap_err().to_string()
    });
    for e in out {
        assert!(e.contains("all_gather_with_side") && e.contains("f32"), "{e}");
    }
}
