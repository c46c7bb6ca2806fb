//! ZeRO stages 1 and 2 on the policy contract against plain all-reduce: the same losses and
//! parameters bit for bit, sharded for real (reduce-scatter and all-gather, never a gradient
//! all-reduce), the per-rank memory the ZeRO paper accounts for, never more than plain DDP's,
//! and plain DDP itself on one rank.

use crate::common::{data, max_diff, optimizer, rows, spec, train, Mlp, Setup};

use std::sync::Arc;

use brigade_autograd::Var;
use brigade_comm::{run_on_threads, Recorder, Track};
use brigade_ddp::{DdpConfig, DistributedDataParallel, ReducerPolicy};
use brigade_policies::{AllReduce, Zero, ZeroStage};
use brigade_tensor::set_compute_threads;

// 416 + 1056 + 792 + 125 parameters: no bucket divides evenly by 4, so shards are padded.
const WIDTHS: [usize; 5] = [12, 32, 32, 24, 5];

/// ~2 KiB caps: several buckets, one parameter split across shards.
const SETUP: Setup = Setup {
    widths: &WIDTHS,
    steps: 4,
    accum: 2,
    micro: 4,
    bucket_cap_mb: 0.002,
    first_bucket_cap_mb: 0.001,
};

/// One rank's losses, parameters and collectives (`op tag`).
type Traced3 = (Vec<f64>, Vec<Vec<f32>>, Vec<String>);

/// Each rank's run with `policy()`, its collectives traced.
fn traced(kind: &str, world: usize, policy: impl Fn() -> Box<dyn ReducerPolicy> + Sync) -> Vec<Traced3> {
    let recorder = Recorder::new();
    let (x, y) = data(world * SETUP.micro * SETUP.accum * SETUP.steps, WIDTHS[0], WIDTHS[4], 3);
    let ranks = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm.traced(recorder.clone()));
        let m = Mlp::new(&WIDTHS, 42 + rank as u64);
        let cfg = DdpConfig {
            bucket_cap_mb: SETUP.bucket_cap_mb,
            first_bucket_cap_mb: SETUP.first_bucket_cap_mb,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg, policy()).unwrap();
        let full = optimizer(kind, m.store.params().to_vec());
        let mut opt = ddp.optimizer(full, &|p| optimizer(kind, p)).unwrap();
        let mut losses = vec![];
        for s in 0..SETUP.steps {
            m.store.zero_grad().unwrap();
            let base = (s * world + rank) * SETUP.micro * SETUP.accum;
            let mut step_loss = 0.0;
            for j in 0..SETUP.accum {
                let (xb, yb) = rows(&x, &y, base + j * SETUP.micro, SETUP.micro);
                let loss = m.loss(&xb, &yb).mul_scalar(1.0 / SETUP.accum as f64).unwrap();
                step_loss += loss.value().item().unwrap();
                if j + 1 < SETUP.accum {
                    ddp.no_sync(|| loss.backward()).unwrap();
                } else {
                    loss.backward().unwrap();
                }
            }
            losses.push(step_loss);
            brigade_autograd::Optimizer::step(&mut opt).unwrap();
        }
        (losses, m.values())
    });
    let events = recorder.events();
    ranks
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            let (losses, params) = r.unwrap();
            let ops = events
                .iter()
                .filter(|e| e.rank == rank && e.track == Track::Comm)
                .map(|e| format!("{} {}", e.op, e.name))
                .collect();
            (losses, params, ops)
        })
        .collect()
}

#[test]
fn zero_1_and_2_match_plain_ddp_bit_for_bit_sharded_for_real() {
    for kind in ["sgd", "adamw"] {
        for world in [2, 4] {
            let plain = traced(kind, world, || Box::new(AllReduce));
            for stage in [ZeroStage::One, ZeroStage::Two] {
                // stage 2 also all-gathers in chunks of at most 100 bytes: many all-gathers per
                // bucket, and chunks that cut parameters
                let sharded = traced(kind, world, || {
                    let zero = Zero::new(stage).unwrap();
                    Box::new(if stage == ZeroStage::Two {
                        zero.with_all_gather_cap(100)
                    } else {
                        zero
                    })
                });
                for (rank, (p, z)) in plain.iter().zip(&sharded).enumerate() {
                    let what = format!("{kind} world {world} {stage:?} rank {rank}");
                    assert_eq!(max_diff(&z.1, &p.1), 0.0, "{what}: parameters differ from plain DDP");
                    assert_eq!(z.0, p.0, "{what}: losses");
                    let count = |prefix: &str| z.2.iter().filter(|o| o.starts_with(prefix)).count();
                    let (rs, gathers) = (count("reduce_scatter "), count("all_gather zero.params"));
                    assert!(rs > 0, "{what}: {:?}", z.2);
                    match stage {
                        ZeroStage::Two => assert!(gathers > 10 * rs, "{what}: {gathers}"),
                        // one all-gather per bucket and step, into the bucket's own buffer
                        _ => assert_eq!(gathers, rs, "{what}"),
                    }
                    assert_eq!(count("all_reduce "), 0, "{what}: {:?}", z.2);
                }
                for r in &sharded[1..] {
                    assert_eq!(max_diff(&r.1, &sharded[0].1), 0.0, "{kind} {stage:?}");
                }
            }
            assert!(max_diff(&plain[0].1, &Mlp::new(&WIDTHS, 42).values()) > 1e-3);
        }
    }
}

#[test]
fn memory_per_rank_is_the_zero_papers_and_never_more_than_plain_ddps() {
    // Ψ parameters in f32 with AdamW: plain DDP holds params 4Ψ + grads 4Ψ + state 8Ψ; stage 1
    // state 8Ψ/N; stage 2 also grads 4Ψ/N. "Within padding": each bucket's shard is rounded up.
    let psi: usize = WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    let one_step = Setup {
        steps: 1,
        accum: 1,
        ..SETUP
    };
    for world in [2, 4] {
        let buckets = run_on_threads(world, |comm| {
            let m = Mlp::new(&WIDTHS, 42);
            let cfg = DdpConfig {
                bucket_cap_mb: SETUP.bucket_cap_mb,
                first_bucket_cap_mb: SETUP.first_bucket_cap_mb,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg, spec("zero1")(0)).unwrap();
            ddp.buckets().iter().map(|b| b.bytes / 4).collect::<Vec<_>>()
        })
        .into_iter()
        .next()
        .unwrap()
        .unwrap();
        let padded: usize = buckets.iter().sum();
        assert!(buckets.iter().all(|&b| b % world == 0));
        assert!(
            padded >= psi && padded < psi + world * buckets.len(),
            "{padded} vs {psi}"
        );
        // rank 0 owns a whole shard of every bucket (the padding is at the end)
        let shard = padded / world;
        let largest_shard = buckets.iter().max().unwrap() / world;
        for kind in ["adamw", "sgd"] {
            let rank0 = |s: &str| train(one_step, world, kind, spec(s)).remove(0).memory;
            let (plain, z1, z2) = (rank0("allreduce"), rank0("zero1"), rank0("zero2"));
            let state = if kind == "adamw" { 8 } else { 4 };
            let what = format!("{kind} world {world}");
            let fig = |m: brigade_ddp::MemoryReport| (m.parameters, m.gradients, m.buckets, m.optimizer_state);
            assert_eq!(fig(plain), (4 * psi, 4 * psi, 4 * psi, state * psi), "{what} plain");
            // stage 1: the buckets (the gradients) stay whole, padded; state only for the shard
            assert_eq!(
                fig(z1),
                (4 * psi, 4 * padded, 4 * padded, state * shard),
                "{what} zero1"
            );
            // stage 2: between steps only the gradient shard is left
            assert_eq!(fig(z2), (4 * psi, 4 * shard, 0, state * shard), "{what} zero2");
            // scratch: stage 1 gathers into the idle gradient buffer and sends one shard of
            // parameters; stage 2's gathered chunks stay within a shard
            assert!(
                z1.comm_scratch > 0 && z1.comm_scratch <= 4 * largest_shard,
                "{what}: {}",
                z1.comm_scratch
            );
            assert!(
                z2.comm_scratch > 0 && z2.comm_scratch <= 4 * largest_shard,
                "{what}: {}",
                z2.comm_scratch
            );
            assert_eq!(plain.comm_scratch, 0);
            // never more than plain DDP in all
            assert!(
                z1.total() < plain.total(),
                "{what}: zero1 {} vs plain {}",
                z1.total(),
                plain.total()
            );
            assert!(
                z2.total() < z1.total(),
                "{what}: zero2 {} vs zero1 {}",
                z2.total(),
                z1.total()
            );
        }
        // and those are the paper's figures within the padding (< one element per bucket)
        assert!(shard >= psi.div_ceil(world) && shard <= psi / world + buckets.len());
    }
}

#[test]
fn on_one_rank_zero_is_plain_ddp_buckets_memory_and_all() {
    let plain = train(SETUP, 1, "adamw", spec("allreduce")).remove(0);
    for s in ["zero1", "zero2"] {
        let z = train(SETUP, 1, "adamw", spec(s)).remove(0);
        assert_eq!(z.memory, plain.memory, "{s}: memory");
        assert_eq!(z.losses, plain.losses, "{s}: losses");
        assert_eq!(max_diff(&z.params, &plain.params), 0.0, "{s}: parameters");
    }
}

#[test]
fn zero_2_with_unused_parameters_matches_plain_ddp() {
    // The loss skips the last layer: with find_unused_parameters its parameters are marked
    // ready at the start of every synchronized pass, into buckets that ZeRO-2 had freed.
    let world = 2;
    let steps = 4;
    let (x, y) = data(world * 4 * steps, WIDTHS[0], WIDTHS[3], 5);
    let run = |s: &str| {
        run_on_threads(world, |comm| {
            set_compute_threads(1);
            let rank = comm.rank();
            let m = Mlp::new(&WIDTHS, 42);
            // bucket 0 holds the unused layer alone (its 125 elements pass a 419-byte cap)
            let cfg = DdpConfig {
                find_unused_parameters: true,
                bucket_cap_mb: SETUP.bucket_cap_mb,
                first_bucket_cap_mb: 0.0004,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg, spec(s)(rank)).unwrap();
            let full = optimizer("adamw", m.store.params().to_vec());
            let mut opt = ddp.optimizer(full, &|p| optimizer("adamw", p)).unwrap();
            for st in 0..steps {
                let (xb, yb) = rows(&x, &y, (st * world + rank) * 4, 4);
                m.store.zero_grad().unwrap();
                let mut h = Var::constant(xb);
                for (w, b) in &m.layers[..3] {
                    h = h.linear(w, Some(b)).unwrap().relu().unwrap();
                }
                h.cross_entropy(&yb).unwrap().backward().unwrap();
                brigade_autograd::Optimizer::step(&mut opt).unwrap();
            }
            if s != "allreduce" {
                // (plain DDP rebuilds its buckets after the first step; ZeRO never does)
                assert_eq!(ddp.buckets()[0].params, ["layers.3.bias", "layers.3.weight"]);
            }
            m.values()
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let (plain, sharded) = (run("allreduce"), run("zero2"));
    for (rank, (p, z)) in plain.iter().zip(&sharded).enumerate() {
        assert_eq!(max_diff(z, p), 0.0, "rank {rank}: parameters differ from plain DDP");
    }
    assert!(max_diff(&plain[0], &Mlp::new(&WIDTHS, 42).values()) > 1e-3);
}

#[test]
fn the_gradient_norm_of_sharded_gradients_is_summed_over_the_ranks() {
    let world = 2;
    let (x, y) = data(16, WIDTHS[0], WIDTHS[4], 2);
    let norm = |s: &str| {
        run_on_threads(world, |comm| {
            let rank = comm.rank();
            let m = Mlp::new(&WIDTHS, 42);
            let cfg = DdpConfig {
                bucket_cap_mb: SETUP.bucket_cap_mb,
                first_bucket_cap_mb: SETUP.first_bucket_cap_mb,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg, spec(s)(rank)).unwrap();
            let (xb, yb) = rows(&x, &y, rank * 8, 8);
            m.loss(&xb, &yb).backward().unwrap();
            ddp.grad_norm_sq().unwrap()
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let plain = norm("allreduce");
    for s in ["zero1", "zero2"] {
        for (rank, z) in norm(s).into_iter().enumerate() {
            // each shard's partial sum crosses the ranks as f32
            assert!(
                (z - plain[0]).abs() <= 1e-6 * plain[0],
                "{s} rank {rank}: {z} vs {}",
                plain[0]
            );
        }
    }
    assert!(plain[0] > 0.0, "a zero norm cannot tell");
}
