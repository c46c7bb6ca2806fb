//! ZeRO stages 1 and 2 against plain DDP: the same losses and parameters (to 1e-6), and the
//! per-rank memory the ZeRO paper accounts for, measured.

use crate::common;

use std::sync::Arc;

use brigade_autograd::{AdamW, Optimizer, Sgd, Var};
use brigade_comm::{run_on_threads, Communicator, Recorder, Traced, Track};
use brigade_ddp::zero::ZeroStage;
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_tensor::set_compute_threads;
use common::{data, max_diff, rows, Mlp};

// 416 + 1056 + 792 + 125 parameters: no bucket divides evenly by 4, so shards are padded.
const WIDTHS: [usize; 5] = [12, 32, 32, 24, 5];
const STEPS: usize = 4;

fn build(kind: &str, params: Vec<Var>) -> Box<dyn Optimizer> {
    match kind {
        "sgd" => Box::new(Sgd::new(params, 0.1, 0.9, 1e-3)),
        _ => Box::new(AdamW::new(params, 1e-2)),
    }
}

fn cfg(zero: ZeroStage) -> DdpConfig {
    // ~2 KiB caps: several buckets, one parameter split across shards
    DdpConfig {
        bucket_cap_mb: 0.002,
        first_bucket_cap_mb: 0.001,
        zero,
        ..DdpConfig::default()
    }
}

struct RankRun {
    losses: Vec<f64>,
    params: Vec<Vec<f32>>,
    /// Rank memory after the last step: (parameters, gradients, buckets, optimizer state).
    memory: (usize, usize, usize, usize),
    /// Collectives this rank issued, by op name.
    ops: Vec<String>,
}

/// `world` ranks, `accum` microbatches of 4 rows per step, each rank on its shard.
fn run(kind: &str, world: usize, accum: usize, zero: ZeroStage) -> Vec<RankRun> {
    let micro = 4;
    let (x, y) = data(world * micro * accum * STEPS, WIDTHS[0], WIDTHS[4], 3);
    let recorder = Recorder::new();
    let ranks = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm: Arc<dyn Communicator> = Arc::new(Traced::new(comm, recorder.clone()));
        // different seeds per rank: rank 0's parameters are broadcast
        let m = Mlp::new(&WIDTHS, 42 + rank as u64);
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg(zero)).unwrap();
        let full = build(kind, m.store.params().to_vec());
        let mut opt: Box<dyn Optimizer> = match zero {
            ZeroStage::Off => full,
            // stage 2 also all-gathers in chunks of 100 bytes (6 elements a rank on 4 ranks):
            // many all-gathers per bucket, and chunks that cut parameters
            ZeroStage::One => Box::new(ddp.zero_optimizer(full.as_ref(), &|p| build(kind, p)).unwrap()),
            ZeroStage::Two => Box::new(
                ddp.zero_optimizer(full.as_ref(), &|p| build(kind, p))
                    .unwrap()
                    .with_all_gather_cap(100),
            ),
        };
        let mut losses = vec![];
        for s in 0..STEPS {
            m.store.zero_grad().unwrap();
            let base = s * world * micro * accum + rank * micro * accum;
            let mut step_loss = 0.0;
            for j in 0..accum {
                let (xb, yb) = rows(&x, &y, base + j * micro, micro);
                let loss = m.loss(&xb, &yb).mul_scalar(1.0 / accum as f64).unwrap();
                step_loss += loss.value().item().unwrap();
                if j + 1 < accum {
                    ddp.no_sync(|| loss.backward()).unwrap();
                } else {
                    loss.backward().unwrap();
                }
            }
            losses.push(step_loss);
            opt.step().unwrap();
        }
        let mem = ddp.rank_memory(opt.as_ref()).unwrap();
        (
            losses,
            m.values(),
            (mem.parameters, mem.gradients, mem.buckets, mem.optimizer_state),
        )
    });
    let events = recorder.events();
    ranks
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            let (losses, params, memory) = r.unwrap();
            let ops = events
                .iter()
                .filter(|e| e.rank == rank && e.track == Track::Comm)
                .map(|e| format!("{} {}", e.op, e.name))
                .collect();
            RankRun {
                losses,
                params,
                memory,
                ops,
            }
        })
        .collect()
}

#[test]
fn zero_1_and_2_match_plain_ddp_with_sgd_and_adamw_on_2_and_4_ranks_with_accumulation() {
    for kind in ["sgd", "adamw"] {
        for world in [2, 4] {
            let plain = run(kind, world, 2, ZeroStage::Off);
            for zero in [ZeroStage::One, ZeroStage::Two] {
                let sharded = run(kind, world, 2, zero);
                for (rank, (p, z)) in plain.iter().zip(&sharded).enumerate() {
                    let what = format!("{kind} world {world} {zero:?} rank {rank}");
                    let d = max_diff(&z.params, &p.params);
                    assert!(d <= 1e-6, "{what}: parameters differ from plain DDP by {d}");
                    for (s, (a, b)) in z.losses.iter().zip(&p.losses).enumerate() {
                        assert!((a - b).abs() <= 1e-6, "{what} step {s}: loss {a} vs {b}");
                    }
                    // sharded for real: reduce-scatter + all-gather, never a gradient all-reduce
                    assert!(
                        z.ops.iter().any(|o| o.starts_with("reduce_scatter ")),
                        "{what}: {:?}",
                        z.ops
                    );
                    let gathers = z.ops.iter().filter(|o| o.starts_with("all_gather zero.params")).count();
                    let reduce_scatters = z.ops.iter().filter(|o| o.starts_with("reduce_scatter ")).count();
                    // one all-gather per bucket and step (stage 1), many more in 100-byte chunks
                    match zero {
                        ZeroStage::Two => assert!(gathers > 10 * reduce_scatters, "{what}: {gathers}"),
                        _ => assert_eq!(gathers, reduce_scatters, "{what}"),
                    }
                    assert!(
                        !z.ops.iter().any(|o| o.starts_with("all_reduce ")),
                        "{what}: {:?}",
                        z.ops
                    );
                }
                // every rank ends with the same (whole) parameters
                for r in &sharded[1..] {
                    assert_eq!(max_diff(&r.params, &sharded[0].params), 0.0, "{kind} {zero:?}");
                }
            }
            // and training moved the parameters
            assert!(max_diff(&plain[0].params, &Mlp::new(&WIDTHS, 42).values()) > 1e-3);
        }
    }
}

#[test]
fn memory_per_rank_matches_the_zero_paper_for_adamw() {
    // Ψ parameters in f32 with AdamW: stage 0 holds params 4Ψ + grads 4Ψ + state 8Ψ; stage 1
    // state 8Ψ/N; stage 2 also grads 4Ψ/N. "Within padding": each bucket's shard is rounded up.
    let psi: usize = WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    for world in [2, 4] {
        // the buckets' (padded) lengths as DDP builds them for this model with these caps
        let buckets = run_on_threads(world, |comm| {
            let m = Mlp::new(&WIDTHS, 42);
            let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg(ZeroStage::One)).unwrap();
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
        let rank0 = |zero| run("adamw", world, 1, zero)[0].memory;
        assert_eq!(
            rank0(ZeroStage::Off),
            (4 * psi, 4 * psi, 4 * psi, 8 * psi),
            "world {world} stage 0"
        );
        // stage 1: the buckets (the gradients) stay whole, padded; state only for the shard
        assert_eq!(
            rank0(ZeroStage::One),
            (4 * psi, 4 * padded, 4 * padded, 8 * shard),
            "world {world} stage 1"
        );
        // stage 2: between steps only the gradient shard is left
        assert_eq!(
            rank0(ZeroStage::Two),
            (4 * psi, 4 * shard, 0, 8 * shard),
            "world {world} stage 2"
        );
        // and those are the paper's figures within the padding (< one element per bucket)
        let pad = buckets.len();
        assert!(
            shard >= psi.div_ceil(world) && shard <= psi / world + pad,
            "{shard} vs {psi}/{world}"
        );
    }
}

#[test]
fn zero_2_with_unused_parameters_matches_plain_ddp() {
    // The loss skips the last layer: with find_unused_parameters its parameters are marked
    // ready at the start of every synchronized pass, into buckets that ZeRO-2 had freed.
    let world = 2;
    let (x, y) = data(world * 4 * STEPS, WIDTHS[0], WIDTHS[3], 5);
    let train = |zero: ZeroStage| {
        run_on_threads(world, |comm| {
            set_compute_threads(1);
            let rank = comm.rank();
            let m = Mlp::new(&WIDTHS, 42);
            // bucket 0 holds the unused layer alone (its 125 elements pass a 419-byte cap)
            let cfg = DdpConfig {
                find_unused_parameters: true,
                first_bucket_cap_mb: 0.0004,
                ..cfg(zero)
            };
            let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg).unwrap();
            let full = build("adamw", m.store.params().to_vec());
            let mut opt: Box<dyn Optimizer> = match zero {
                ZeroStage::Off => full,
                _ => Box::new(ddp.zero_optimizer(full.as_ref(), &|p| build("adamw", p)).unwrap()),
            };
            for s in 0..STEPS {
                let (xb, yb) = rows(&x, &y, s * world * 4 + rank * 4, 4);
                m.store.zero_grad().unwrap();
                let mut h = Var::constant(xb);
                for (w, b) in &m.layers[..3] {
                    h = h.linear(w, Some(b)).unwrap().relu().unwrap();
                }
                h.cross_entropy(&yb).unwrap().backward().unwrap();
                opt.step().unwrap();
            }
            if zero != ZeroStage::Off {
                // (plain DDP rebuilds its buckets after the first step; ZeRO never does)
                assert_eq!(ddp.buckets()[0].params, ["layers.3.bias", "layers.3.weight"]);
            }
            m.values()
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let (plain, sharded) = (train(ZeroStage::Off), train(ZeroStage::Two));
    for (rank, (p, z)) in plain.iter().zip(&sharded).enumerate() {
        let d = max_diff(z, p);
        assert!(d <= 1e-6, "rank {rank}: parameters differ from plain DDP by {d}");
    }
    assert!(max_diff(&plain[0], &Mlp::new(&WIDTHS, 42).values()) > 1e-3);
}
