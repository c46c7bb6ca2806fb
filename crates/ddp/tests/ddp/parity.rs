//! DDP parity: N ranks on shards == one process on the whole batch.

use crate::common;

use std::sync::Arc;

use brigade_autograd::{AdamW, Optimizer, Sgd};
use brigade_comm::{run_on_threads, run_on_threads_with_timeout, Recorder, Track};
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
    run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        // Different seeds per rank: DDP must broadcast rank 0's parameters.
        let m = Mlp::new(&WIDTHS, 42 + rank as u64);
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg.clone(), common::average()).unwrap();
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
fn two_four_and_eight_ranks_match_one_process_with_sgd_and_adamw() {
    for kind in ["sgd", "adamw"] {
        for world in [2, 4, 8] {
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
    let recorder = Recorder::new();
    let ranks: Vec<(Vec<f64>, Vec<Vec<f32>>, usize)> = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 42);
        let comm = Arc::new(comm.traced(recorder.clone()));
        let ddp = DistributedDataParallel::new(&m.store, comm, small_buckets(), common::average()).unwrap();
        let mut opt = make_opt("sgd", &m);
        let mut losses = vec![];
        // one all-reduce per bucket per step: the synchronized backward's, never the no_sync ones
        let mut expected_all_reduces = 0;
        for s in 0..STEPS {
            expected_all_reduces += ddp.buckets().len();
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
        (losses, m.values(), expected_all_reduces)
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    for (rank, (_, params, _)) in ranks.iter().enumerate() {
        let d = max_diff(params, &ref_params);
        assert!(d < 2e-5, "rank {rank}: params differ by {d}");
    }
    for s in 0..STEPS {
        let mean: f64 = ranks.iter().map(|(l, ..)| l[s]).sum::<f64>() / world as f64;
        assert!((mean - ref_losses[s]).abs() < 1e-5);
    }
    // Averaging every microbatch would give the same parameters (the average is linear):
    // only the number of collectives tells that no_sync communicated nothing.
    let events = recorder.events();
    for (rank, (.., expected)) in ranks.iter().enumerate() {
        let all_reduces = events
            .iter()
            .filter(|e| e.rank == rank && e.track == Track::Comm && e.op == "all_reduce")
            .count();
        assert_eq!(
            all_reduces, *expected,
            "rank {rank}: all-reduces issued over {STEPS} steps of {k} microbatches"
        );
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

/// Trains `m` for `STEPS` steps of `per_rank` rows (rank `rank`'s shard of `world`) with
/// `kind`; returns the losses.
fn train(m: &Mlp, kind: &str, world: usize, rank: usize, per_rank: usize) -> Vec<f64> {
    let (x, y) = data(world * per_rank * STEPS, WIDTHS[0], WIDTHS[4], 3);
    let mut opt = make_opt(kind, m);
    (0..STEPS)
        .map(|s| {
            let (xb, yb) = rows(&x, &y, s * world * per_rank + rank * per_rank, per_rank);
            m.store.zero_grad().unwrap();
            let loss = m.loss(&xb, &yb);
            loss.backward().unwrap();
            opt.step().unwrap();
            loss.value().item().unwrap()
        })
        .collect()
}

fn bits(values: &[Vec<f32>]) -> Vec<Vec<u32>> {
    values.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect()
}

#[test]
fn world_size_one_is_bit_identical_to_no_ddp() {
    for kind in ["sgd", "adamw"] {
        let plain = Mlp::new(&WIDTHS, 42);
        let plain_losses = train(&plain, kind, 1, 0, 8);
        let ranks = run_on_threads(1, |comm| {
            set_compute_threads(1);
            let m = Mlp::new(&WIDTHS, 42);
            let _ddp =
                DistributedDataParallel::new(&m.store, Arc::new(comm), small_buckets(), common::average()).unwrap();
            let losses = train(&m, kind, 1, 0, 8);
            (losses, m.values())
        });
        let (losses, values) = ranks.into_iter().next().unwrap().unwrap();
        assert_eq!(
            losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            plain_losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            "{kind}"
        );
        assert_eq!(
            bits(&values),
            bits(&plain.values()),
            "{kind}: parameters differ from training without DDP"
        );
    }
}

#[test]
fn a_slow_but_live_rank_within_the_timeout_succeeds() {
    // Rank 1 is 1 s late to every step; the group's timeout is 6 s: nobody may give up.
    let timeout = std::time::Duration::from_secs(6);
    let late = std::time::Duration::from_secs(1);
    let ranks = run_on_threads_with_timeout(2, timeout, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 42);
        let _ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small_buckets(), common::average()).unwrap();
        let (x, y) = data(2 * 8 * STEPS, WIDTHS[0], WIDTHS[4], 3);
        let mut opt = make_opt("sgd", &m);
        for s in 0..2 {
            if rank == 1 {
                std::thread::sleep(late);
            }
            let (xb, yb) = rows(&x, &y, s * 16 + rank * 8, 8);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb)
                .backward()
                .map_err(|e| format!("rank {rank} step {s}: {e}"))?;
            opt.step().unwrap();
        }
        Ok::<_, String>(m.values())
    });
    let two_step_ref = {
        let m = Mlp::new(&WIDTHS, 42);
        let (x, y) = data(2 * 8 * STEPS, WIDTHS[0], WIDTHS[4], 3);
        let mut opt = make_opt("sgd", &m);
        for s in 0..2 {
            let (xb, yb) = rows(&x, &y, s * 16, 16);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
            opt.step().unwrap();
        }
        m.values()
    };
    for (rank, r) in ranks.into_iter().enumerate() {
        let values = r.unwrap().unwrap_or_else(|e| panic!("{e}"));
        let d = max_diff(&values, &two_step_ref);
        assert!(d < 2e-5, "rank {rank}: params differ by {d}");
    }
}

#[test]
fn frozen_parameters_are_left_out_of_the_buckets_and_keep_their_values() {
    // Fine-tuning: the first layer is frozen on every rank before wrapping.
    let freeze = |m: &Mlp| {
        for name in ["layers.0.weight", "layers.0.bias"] {
            m.store.get(name).unwrap().set_requires_grad(false).unwrap();
        }
    };
    let (world, per_rank) = (2, 8);
    let reference = Mlp::new(&WIDTHS, 42);
    freeze(&reference);
    train(&reference, "sgd", 1, 0, world * per_rank);
    let recorder = Recorder::new();
    let ranks = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        // different seeds: the frozen values too come from rank 0
        let m = Mlp::new(&WIDTHS, 42 + rank as u64);
        freeze(&m);
        let comm = Arc::new(comm.traced(recorder.clone()));
        let ddp = DistributedDataParallel::new(&m.store, comm, small_buckets(), common::average()).unwrap();
        train(&m, "sgd", world, rank, per_rank);
        let bucketed: Vec<String> = ddp.buckets().into_iter().flat_map(|b| b.params).collect();
        (
            m.values(),
            bucketed,
            m.store.get("layers.0.weight").unwrap().grad().is_none(),
        )
    });
    let initial = Mlp::new(&WIDTHS, 42).values();
    let trainable_bytes: usize = reference
        .store
        .params()
        .iter()
        .filter(|p| p.requires_grad())
        .map(|p| p.value().numel() * 4)
        .sum();
    let events = recorder.events();
    for (rank, r) in ranks.into_iter().enumerate() {
        let (values, bucketed, no_grad) = r.unwrap();
        let d = max_diff(&values, &reference.values());
        assert!(d < 2e-5, "rank {rank}: params differ from one process by {d}");
        assert_eq!(
            bits(&values[..2]),
            bits(&initial[..2]),
            "rank {rank}: the frozen layer moved"
        );
        assert!(no_grad, "rank {rank}: a frozen parameter got a gradient");
        assert!(
            !bucketed.iter().any(|n| n.starts_with("layers.0.")),
            "rank {rank}: frozen parameters in buckets: {bucketed:?}"
        );
        assert_eq!(
            bucketed.len(),
            6,
            "rank {rank}: every trainable parameter is bucketed: {bucketed:?}"
        );
        let reduced: usize = events
            .iter()
            .filter(|e| e.rank == rank && e.op == "all_reduce")
            .map(|e| e.bytes)
            .sum();
        assert_eq!(reduced, STEPS * trainable_bytes, "rank {rank}: bytes all-reduced");
    }
}

#[test]
fn a_zero_size_parameter_trains_like_the_rest() {
    // An empty parameter (PyTorch allows them: a layer of width 0, a pruned head) takes part in
    // the loss and so in the buckets; the all-reduce of its empty slice must be harmless.
    let with_empty = |seed: u64| {
        let mut m = Mlp::new(&WIDTHS, seed);
        let empty = m
            .store
            .add("empty", brigade_tensor::Tensor::zeros(&[0], brigade_tensor::DType::F32))
            .unwrap();
        (m, empty)
    };
    let loss = |m: &Mlp, empty: &brigade_autograd::Var, xb: &brigade_tensor::Tensor, yb: &brigade_tensor::Tensor| {
        m.loss(xb, yb).add(&empty.sum_all().unwrap()).unwrap()
    };
    let (x, y) = data(2 * 8 * STEPS, WIDTHS[0], WIDTHS[4], 3);
    let (reference, ref_empty) = with_empty(42);
    let mut opt = make_opt("sgd", &reference);
    for s in 0..STEPS {
        let (xb, yb) = rows(&x, &y, s * 16, 16);
        reference.store.zero_grad().unwrap();
        loss(&reference, &ref_empty, &xb, &yb).backward().unwrap();
        opt.step().unwrap();
    }
    // tiny buckets, so that the empty parameter's bucket is launched early, mid-backward
    let cfg = DdpConfig {
        bucket_cap_mb: 1e-6,
        first_bucket_cap_mb: 1e-6,
        ..DdpConfig::default()
    };
    let ranks = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let (m, empty) = with_empty(42 + rank as u64);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg.clone(), common::average()).unwrap();
        let mut opt = make_opt("sgd", &m);
        for s in 0..STEPS {
            let (xb, yb) = rows(&x, &y, s * 16 + rank * 8, 8);
            m.store.zero_grad().unwrap();
            loss(&m, &empty, &xb, &yb).backward().unwrap();
            opt.step().unwrap();
        }
        let bucketed = ddp.buckets().iter().any(|b| b.params.contains(&"empty".to_string()));
        (m.values(), empty.grad().map(|g| g.numel()), bucketed)
    });
    for (rank, r) in ranks.into_iter().enumerate() {
        let (values, grad_numel, bucketed) = r.unwrap();
        let d = max_diff(&values, &reference.values());
        assert!(d < 2e-5, "rank {rank}: params differ by {d}");
        assert_eq!(
            grad_numel,
            Some(0),
            "rank {rank}: the empty parameter has an empty gradient"
        );
        assert!(bucketed, "rank {rank}: the empty parameter is in a bucket");
    }
}

/// A model that uses one weight twice (tied layers): `x -> a -> w -> w -> b`.
struct Tied {
    store: brigade_autograd::ParamStore,
}

impl Tied {
    fn new(seed: u64) -> Tied {
        use brigade_tensor::{DType, Rng, Tensor};
        let mut rng = Rng::new(seed);
        let mut store = brigade_autograd::ParamStore::new();
        for (name, shape) in [("a", [16, WIDTHS[0]]), ("w", [16, 16]), ("b", [WIDTHS[4], 16])] {
            store
                .add(name, Tensor::rand_uniform(&shape, -0.3, 0.3, DType::F32, &mut rng))
                .unwrap();
        }
        Tied { store }
    }

    fn loss(&self, x: &brigade_tensor::Tensor, y: &brigade_tensor::Tensor) -> brigade_autograd::Var {
        let p = |n: &str| self.store.get(n).unwrap().clone();
        let h = brigade_autograd::Var::constant(x.clone())
            .linear(&p("a"), None)
            .unwrap()
            .relu()
            .unwrap();
        let h = h.linear(&p("w"), None).unwrap().relu().unwrap();
        let h = h.linear(&p("w"), None).unwrap().relu().unwrap();
        h.linear(&p("b"), None).unwrap().cross_entropy(y).unwrap()
    }

    fn values(&self) -> Vec<Vec<f32>> {
        self.store
            .params()
            .iter()
            .map(|p| p.value().to_vec::<f32>().unwrap())
            .collect()
    }
}

/// Counts gradient-ready announcements per parameter name.
#[derive(Default)]
struct Announcements(std::sync::Mutex<Vec<String>>);

impl brigade_autograd::GradSubscriber for Announcements {
    fn grad_ready(&self, r: brigade_autograd::GradReady<'_>) -> Result<(), brigade_autograd::SubscriberError> {
        self.0.lock().unwrap().push(r.name.to_string());
        Ok(())
    }
}

#[test]
fn a_tied_parameter_gets_one_summed_gradient_announced_and_reduced_once() {
    let (x, y) = data(2 * 8 * STEPS, WIDTHS[0], WIDTHS[4], 3);
    let reference = Tied::new(42);
    let mut opt = Sgd::new(reference.store.params().to_vec(), 0.1, 0.9, 0.0);
    for s in 0..STEPS {
        let (xb, yb) = rows(&x, &y, s * 16, 16);
        reference.store.zero_grad().unwrap();
        reference.loss(&xb, &yb).backward().unwrap();
        opt.step().unwrap();
    }
    let recorder = Recorder::new();
    let ranks = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Tied::new(42 + rank as u64);
        let comm = Arc::new(comm.traced(recorder.clone()));
        // one bucket per parameter: w's bucket must be launched once, after both uses
        let cfg = DdpConfig {
            bucket_cap_mb: 1e-6,
            first_bucket_cap_mb: 1e-6,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg, common::average()).unwrap();
        let heard = Arc::new(Announcements::default());
        m.store.bus().subscribe(heard.clone());
        let mut opt = Sgd::new(m.store.params().to_vec(), 0.1, 0.9, 0.0);
        for s in 0..STEPS {
            let (xb, yb) = rows(&x, &y, s * 16 + rank * 8, 8);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
            opt.step().unwrap();
        }
        let heard = heard.0.lock().unwrap().clone();
        (m.values(), heard, ddp.buckets().len())
    });
    let events = recorder.events();
    for (rank, r) in ranks.into_iter().enumerate() {
        let (values, heard, buckets) = r.unwrap();
        let d = max_diff(&values, &reference.values());
        assert!(d < 2e-5, "rank {rank}: params differ by {d}");
        assert_eq!(
            heard.iter().filter(|n| *n == "w").count(),
            STEPS,
            "rank {rank}: w announced once per backward: {heard:?}"
        );
        assert_eq!(buckets, 3);
        let all_reduces = events.iter().filter(|e| e.rank == rank && e.op == "all_reduce").count();
        assert_eq!(
            all_reduces,
            STEPS * buckets,
            "rank {rank}: one all-reduce per bucket per step"
        );
    }
}
