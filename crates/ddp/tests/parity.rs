//! DDP parity: N ranks on shards == one process on the whole batch.

mod common;

use std::sync::Arc;

use brigade_autograd::{AdamW, Optimizer, Sgd};
use brigade_comm::{launch, Communicator};
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_tensor::set_compute_threads;
use common::{data, max_diff, rows, Mlp};

const WIDTHS: [usize; 5] = [12, 32, 32, 24, 5];
const STEPS: usize = 4;

fn make_opt(kind: &str, m: &Mlp) -> Box<dyn Optimizer> {
    match kind {
        "sgd" => Box::new(Sgd::new(m.store.params().to_vec(), 0.1, 0.9, 1e-3)),
        _ => Box::new(AdamW::new(m.store.params().to_vec(), 1e-2)),
    }
}

/// One process, global batch of `world * per_rank` rows per step.
fn single(kind: &str, world: usize, per_rank: usize) -> (Vec<f64>, Vec<Vec<f32>>) {
    let (x, y) = data(world * per_rank * STEPS, WIDTHS[0], WIDTHS[4], 3);
    let m = Mlp::new(&WIDTHS, 42);
    let mut opt = make_opt(kind, &m);
    let mut losses = vec![];
    for s in 0..STEPS {
        let (xb, yb) = rows(&x, &y, s * world * per_rank, world * per_rank);
        m.store.zero_grad().unwrap();
        let loss = m.loss(&xb, &yb);
        losses.push(loss.value().item().unwrap());
        loss.backward().unwrap();
        opt.step().unwrap();
    }
    (losses, m.values())
}

/// `world` ranks, each on its shard; returns each rank's (losses, final params).
fn distributed(kind: &str, world: usize, per_rank: usize, cfg: DdpConfig) -> Vec<(Vec<f64>, Vec<Vec<f32>>)> {
    let (x, y) = data(world * per_rank * STEPS, WIDTHS[0], WIDTHS[4], 3);
    launch(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        // Different seeds per rank: DDP must broadcast rank 0's parameters.
        let m = Mlp::new(&WIDTHS, 42 + rank as u64);
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg.clone()).unwrap();
        let mut opt = make_opt(kind, &m);
        let mut losses = vec![];
        for s in 0..STEPS {
            let (xb, yb) = rows(&x, &y, s * world * per_rank + rank * per_rank, per_rank);
            m.store.zero_grad().unwrap();
            let loss = m.loss(&xb, &yb);
            losses.push(loss.value().item().unwrap());
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        assert!(ddp.buckets_rebuilt());
        (losses, m.values())
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn small_buckets() -> DdpConfig {
    // ~2 KiB caps: several buckets for this model, so ordering and overlap are exercised
    DdpConfig {
        bucket_cap_mb: 0.002,
        first_bucket_cap_mb: 0.001,
        ..DdpConfig::default()
    }
}

#[test]
fn two_and_four_ranks_match_one_process_with_sgd_and_adamw() {
    for kind in ["sgd", "adamw"] {
        for world in [2, 4] {
            let per_rank = 8;
            let (ref_losses, ref_params) = single(kind, world, per_rank);
            let ranks = distributed(kind, world, per_rank, small_buckets());
            for (rank, (_, params)) in ranks.iter().enumerate() {
                let d = max_diff(params, &ref_params);
                assert!(d < 2e-5, "{kind} world {world} rank {rank}: params differ by {d}");
            }
            // the global loss is the mean over ranks of the local means (equal shards)
            for s in 0..STEPS {
                let mean: f64 = ranks.iter().map(|(l, _)| l[s]).sum::<f64>() / world as f64;
                assert!(
                    (mean - ref_losses[s]).abs() < 1e-5,
                    "{kind} world {world} step {s}: {mean} vs {}",
                    ref_losses[s]
                );
            }
            // and training actually moved the parameters away from the start
            let start = Mlp::new(&WIDTHS, 42).values();
            assert!(max_diff(&ranks[0].1, &start) > 1e-3);
        }
    }
}

#[test]
fn no_sync_accumulation_matches_the_larger_batch() {
    // 2 ranks x 2 microbatches of 4 rows == 1 process x 16 rows per step
    let (world, micro, k) = (2, 4, 2);
    let (ref_losses, ref_params) = single("sgd", world, micro * k);
    let (x, y) = data(world * micro * k * STEPS, WIDTHS[0], WIDTHS[4], 3);
    let ranks: Vec<(Vec<f64>, Vec<Vec<f32>>)> = launch(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 42);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small_buckets()).unwrap();
        let mut opt = make_opt("sgd", &m);
        let mut losses = vec![];
        for s in 0..STEPS {
            m.store.zero_grad().unwrap();
            let base = s * world * micro * k + rank * micro * k;
            let mut step_loss = 0.0;
            for j in 0..k {
                let (xb, yb) = rows(&x, &y, base + j * micro, micro);
                // scale by 1/k so the step uses the mean over microbatches
                let mut run = || {
                    let loss = m.loss(&xb, &yb).mul_scalar(1.0 / k as f64).unwrap();
                    step_loss += loss.value().item().unwrap();
                    loss.backward().unwrap();
                };
                if j + 1 < k {
                    ddp.no_sync(&mut run)
                } else {
                    run()
                }
            }
            losses.push(step_loss);
            opt.step().unwrap();
        }
        (losses, m.values())
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    for (rank, (_, params)) in ranks.iter().enumerate() {
        let d = max_diff(params, &ref_params);
        assert!(d < 2e-5, "rank {rank}: params differ by {d}");
    }
    for s in 0..STEPS {
        let mean: f64 = ranks.iter().map(|(l, _)| l[s]).sum::<f64>() / world as f64;
        assert!((mean - ref_losses[s]).abs() < 1e-5);
    }
}

#[test]
fn without_ddp_the_ranks_would_diverge() {
    // Guards the parity tests against passing vacuously: plain local training on each
    // shard does not reach the single-process parameters.
    let (_, ref_params) = single("sgd", 2, 8);
    let (x, y) = data(2 * 8 * STEPS, WIDTHS[0], WIDTHS[4], 3);
    let m = Mlp::new(&WIDTHS, 42);
    let mut opt = make_opt("sgd", &m);
    for s in 0..STEPS {
        let (xb, yb) = rows(&x, &y, s * 16, 8);
        m.store.zero_grad().unwrap();
        m.loss(&xb, &yb).backward().unwrap();
        opt.step().unwrap();
    }
    assert!(max_diff(&m.values(), &ref_params) > 1e-4);
}
