//! Top-k with error feedback and EF-SignSGD: at ratio 1 top-k is the all-reduce bit for bit
//! through DDP (its sparse all-gather summed in rank order); below it, what a rank did not send
//! stays in its residual; EF-SignSGD sends each rank's scaled signs and keeps the rest.

use crate::common::{spec, train, Setup};
use crate::direct::{bucket, on_ranks, randn, reduce};

use brigade_ddp::ReducerPolicy;
use brigade_policies::{EfSign, TopK};

const WIDTHS: [usize; 4] = [16, 48, 32, 6];

fn setup(steps: usize) -> Setup {
    Setup {
        widths: &WIDTHS,
        steps,
        accum: 1,
        micro: 8,
        bucket_cap_mb: 0.004,
        first_bucket_cap_mb: 0.002,
    }
}

#[test]
fn topk_at_ratio_one_is_the_all_reduce_bit_for_bit_at_two_and_three_ranks() {
    for world in [2, 3] {
        let all = train(setup(4), world, "sgd", spec("allreduce"));
        let top = train(setup(4), world, "sgd", spec("topk:1"));
        for (a, t) in all.iter().zip(&top) {
            assert_eq!(a.losses, t.losses, "world {world}: losses");
            let bits = |p: &[Vec<f32>]| -> Vec<Vec<u32>> {
                p.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect()
            };
            assert_eq!(bits(&a.params), bits(&t.params), "world {world}: parameters");
        }
        // the sparse path sent every entry with its index: 12 bytes an element, not 4
        assert!(
            top[0].wire_bytes > 2.0 * all[0].wire_bytes,
            "{} {}",
            top[0].wire_bytes,
            all[0].wire_bytes
        );
    }
}

#[test]
fn topk_below_ratio_one_sends_k_entries_and_its_residual_keeps_the_rest() {
    const N: usize = 40;
    const STEPS: usize = 5;
    let out = on_ranks(1, |_, comm| {
        let mut top = TopK::new(0.1).unwrap();
        let (mut sent_sum, mut grad_sum) = (vec![0.0f64; N], vec![0.0f64; N]);
        for s in 0..STEPS {
            let g = randn(N, 7 + s as u64);
            let sent = reduce(&mut top, bucket(0, g.clone(), &[&[8, 4], &[8]], true), &comm).unwrap();
            assert_eq!(
                sent.iter().filter(|x| **x != 0.0).count(),
                4,
                "step {s}: ceil(0.1 x 40) entries"
            );
            for i in 0..N {
                sent_sum[i] += sent[i] as f64;
                grad_sum[i] += g[i] as f64;
            }
        }
        let state = top.state_dict().unwrap();
        let residual: Vec<f64> = state
            .iter()
            .flat_map(|(_, t)| t.to_vec::<f32>().unwrap())
            .map(|x| x as f64)
            .collect();
        (sent_sum, grad_sum, residual)
    });
    let (sent, grads, residual) = &out[0];
    assert_eq!(residual.len(), N);
    assert!(
        residual.iter().any(|r| r.abs() > 0.1),
        "the residual holds what was not sent"
    );
    for i in 0..N {
        // what was sent and what is kept add up to every gradient, up to f32 rounding
        assert!(
            (sent[i] + residual[i] - grads[i]).abs() < 1e-5,
            "{i}: {} + {} != {}",
            sent[i],
            residual[i],
            grads[i]
        );
    }
}

/// `p`'s EF-SignSGD message: its mean magnitude times the sign (+1 at 0).
fn scaled_signs(p: &[f64]) -> Vec<f64> {
    let scale = p.iter().map(|x| x.abs()).sum::<f64>() / p.len() as f64;
    p.iter().map(|&x| if x >= 0.0 { scale } else { -scale }).collect()
}

#[test]
fn efsign_averages_every_rank_s_scaled_signs_and_keeps_the_rest_for_the_next_step() {
    const N: usize = 21; // not a whole number of bytes of bits
    let out = on_ranks(2, |rank, comm| {
        let mut ef = EfSign::default();
        let steps: Vec<Vec<f32>> = (0..2).map(|s| randn(N, 100 + 10 * rank as u64 + s)).collect();
        let got: Vec<Vec<f32>> = steps
            .iter()
            .map(|g| reduce(&mut ef, bucket(0, g.clone(), &[&[3, 7]], true), &comm).unwrap())
            .collect();
        (steps, got)
    });
    // every rank's p = g + residual, step by step, computed here in f64
    let mut residual = [vec![0.0f64; N], vec![0.0f64; N]];
    for s in 0..2 {
        let mut mean = [0.0f64; N];
        for (r, (steps, _)) in out.iter().enumerate() {
            let p: Vec<f64> = steps[s].iter().zip(&residual[r]).map(|(g, e)| *g as f64 + e).collect();
            let c = scaled_signs(&p);
            for i in 0..N {
                mean[i] += c[i] / 2.0;
                residual[r][i] = p[i] - c[i];
            }
        }
        for (r, (_, got)) in out.iter().enumerate() {
            for i in 0..N {
                assert!(
                    (got[s][i] as f64 - mean[i]).abs() < 1e-5,
                    "step {s} rank {r} [{i}]: {} vs {}",
                    got[s][i],
                    mean[i]
                );
            }
        }
    }
}

#[test]
fn topk_and_efsign_train_through_ddp_and_send_fewer_bytes_than_the_all_reduce() {
    let all = train(setup(6), 2, "sgd", spec("allreduce"));
    for s in ["topk:0.05", "efsign"] {
        let run = train(setup(6), 2, "sgd", spec(s));
        let (first, last) = (run[0].losses[0], *run[0].losses.last().unwrap());
        assert!(last.is_finite() && last < first, "{s}: {first} -> {last}");
        assert!(
            run[0].wire_bytes < all[0].wire_bytes / 4.0,
            "{s}: {} vs {}",
            run[0].wire_bytes,
            all[0].wire_bytes
        );
    }
}

#[test]
fn a_topk_ratio_outside_zero_to_one_is_one_clear_error() {
    for bad in ["topk", "topk:0", "topk:1.5", "topk:x", "topk:nan"] {
        let e = bad.parse::<brigade_policies::PolicySpec>().unwrap_err().to_string();
        assert!(e.contains("topk") && e.contains("ratio"), "{bad}: {e}");
    }
    assert_eq!(
        "topk:0.010"
            .parse::<brigade_policies::PolicySpec>()
            .unwrap()
            .to_string(),
        "topk:0.01"
    );
}
