//! A small MLP, data, and a fingerprint of training results for the policy tests: the DDP
//! tests' helpers (the same file), and what only these tests need.

#![allow(dead_code)]

#[path = "../../../ddp/tests/ddp/common/mod.rs"]
mod ddp_common;
pub use ddp_common::*;

use brigade_tensor::{Rng, Tensor};

/// `n` rows of inputs `[n, d]` labelled by a teacher: the index of the largest of the first `c`
/// inputs (learnable, unlike [`data`]'s random labels).
pub fn teacher_data(n: usize, d: usize, c: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = Rng::new(seed);
    let x: Vec<f32> = (0..n * d).map(|_| rng.normal() as f32).collect();
    let y: Vec<i64> = (0..n)
        .map(|i| {
            let row = &x[i * d..i * d + c];
            (0..c).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as i64
        })
        .collect();
    (
        Tensor::from_vec(x, &[n, d]).unwrap(),
        Tensor::from_vec(y, &[n]).unwrap(),
    )
}

/// One rank's run: losses (rank 0's are the global view only when every rank agrees), final
/// parameters, the DDP memory and diagnostics after the last step, and the wire bytes of its
/// steps (DDP's collectives, as the meter counts them).
pub struct RankRun {
    pub losses: Vec<f64>,
    pub params: Vec<Vec<f32>>,
    pub memory: brigade_ddp::MemoryReport,
    pub diagnostics: Vec<String>,
    pub wire_bytes: f64,
    /// Collectives the steps issued.
    pub collectives: u64,
}

/// What a test trains: widths, steps, microbatches, rows per microbatch, caps.
#[derive(Clone, Copy)]
pub struct Setup {
    pub widths: &'static [usize],
    pub steps: usize,
    pub accum: usize,
    pub micro: usize,
    pub bucket_cap_mb: f64,
    pub first_bucket_cap_mb: f64,
}

pub fn optimizer(kind: &str, params: Vec<brigade_autograd::Var>) -> Box<dyn brigade_autograd::Optimizer> {
    match kind {
        "sgd" => Box::new(brigade_autograd::Sgd::new(params, 0.1, 0.9, 1e-3)),
        "plain-sgd" => Box::new(brigade_autograd::Sgd::new(params, 0.1, 0.0, 0.0)),
        _ => Box::new(brigade_autograd::AdamW::new(params, 1e-2)),
    }
}

/// `world` thread ranks, each on its shard, each with `policy(rank)`, the optimizer `kind`
/// through DDP's optimizer; DDP's meter counts what it sends.
pub fn train(
    setup: Setup,
    world: usize,
    kind: &str,
    policy: impl Fn(usize) -> Box<dyn brigade_ddp::ReducerPolicy> + Sync,
) -> Vec<RankRun> {
    use std::sync::Arc;
    let last = setup.widths[setup.widths.len() - 1];
    let (x, y) = teacher_data(
        world * setup.micro * setup.accum * setup.steps,
        setup.widths[0],
        last,
        3,
    );
    brigade_comm::run_on_threads(world, |comm| {
        brigade_tensor::set_compute_threads(1);
        let rank = comm.rank();
        let meter = brigade_comm::CommMeter::new();
        let comm = Arc::new(comm);
        let m = Mlp::new(setup.widths, 42 + rank as u64);
        let cfg = brigade_ddp::DdpConfig {
            bucket_cap_mb: setup.bucket_cap_mb,
            first_bucket_cap_mb: setup.first_bucket_cap_mb,
            meter: meter.clone(),
            ..brigade_ddp::DdpConfig::default()
        };
        let ddp = brigade_ddp::DistributedDataParallel::new(&m.store, comm, cfg, policy(rank)).unwrap();
        let full = optimizer(kind, m.store.params().to_vec());
        let mut opt = ddp.optimizer(full, &|p| optimizer(kind, p)).unwrap();
        // what the steps send (not the model check and parameter broadcast of construction)
        let built = meter.totals();
        let mut losses = vec![];
        for s in 0..setup.steps {
            m.store.zero_grad().unwrap();
            let base = (s * world + rank) * setup.micro * setup.accum;
            let mut step_loss = 0.0;
            for j in 0..setup.accum {
                let (xb, yb) = rows(&x, &y, base + j * setup.micro, setup.micro);
                let loss = m.loss(&xb, &yb).mul_scalar(1.0 / setup.accum as f64).unwrap();
                step_loss += loss.value().item().unwrap();
                if j + 1 < setup.accum {
                    ddp.no_sync(|| loss.backward()).unwrap();
                } else {
                    loss.backward().unwrap();
                }
            }
            losses.push(step_loss);
            brigade_autograd::Optimizer::step(&mut opt).unwrap();
        }
        RankRun {
            losses,
            params: m.values(),
            memory: ddp.rank_memory(&opt).unwrap(),
            diagnostics: ddp.policy_diagnostics().into_iter().map(|d| d.message).collect(),
            wire_bytes: (meter.totals() - built).wire_bytes,
            collectives: (meter.totals() - built).collectives,
        }
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// A built-in policy by spec, one per rank.
pub fn spec(s: &str) -> impl Fn(usize) -> Box<dyn brigade_ddp::ReducerPolicy> + Sync + '_ {
    move |_| {
        s.parse::<brigade_policies::PolicySpec>()
            .unwrap()
            .build(&brigade_policies::Registry::new())
            .unwrap()
    }
}
