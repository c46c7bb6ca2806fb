//! Results pinned before the reducer-policy refactor (issue 21): every built-in policy, run
//! here through DDP, must reproduce the fingerprints recorded in `pinned.txt` by the code that
//! preceded the policy contract (commit noted in the file) — bit for bit: the FNV-1a hash of
//! rank 0's losses (f64 bits) and of its final parameters (f32 bits), and every rank ends with
//! rank 0's parameters.
//!
//! PowerSGD is the exception: its products now run as tensor matmuls (GEMM, another summation
//! order than the loops they replaced), so its pinned last loss is matched within 1e-6
//! (relative) instead of its fingerprints.
//!
//! `BRIGADE_WRITE_PINNED=1 cargo test -p brigade-policies --test policies pinned` rewrites the
//! file from the code under test: only ever on the commit that defines "today's" results.

use crate::common::{data, fnv_losses, fnv_params, max_diff, rows, Mlp};

use std::collections::BTreeMap;
use std::sync::Arc;

use brigade_autograd::{AdamW, Optimizer, Sgd, Var};
use brigade_comm::{run_on_threads, Communicator};
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_policies::{PolicySpec, Registry};
use brigade_tensor::set_compute_threads;

/// 416 + 1056 + 1056 + 792 + 125 parameters: no bucket divides evenly by 4 (ZeRO pads).
const WIDTHS: [usize; 6] = [12, 32, 32, 32, 24, 5];
const STEPS: usize = 5;
const MICRO: usize = 4;
const PINNED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/policies/pinned.txt");

fn optimizer(kind: &str, params: Vec<Var>) -> Box<dyn Optimizer> {
    match kind {
        "sgd" => Box::new(Sgd::new(params, 0.1, 0.9, 1e-3)),
        _ => Box::new(AdamW::new(params, 1e-2)),
    }
}

/// Rank 0's losses and every rank's final parameters, `world` ranks of `accum` microbatches.
fn train(policy: &str, kind: &str, world: usize, accum: usize) -> (Vec<f64>, Vec<Vec<Vec<f32>>>) {
    let (x, y) = data(world * MICRO * accum * STEPS, WIDTHS[0], WIDTHS[5], 3);
    let out = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        // different seeds per rank: rank 0's parameters are broadcast
        let m = Mlp::new(&WIDTHS, 42 + rank as u64);
        let cfg = DdpConfig {
            bucket_cap_mb: 0.004,
            first_bucket_cap_mb: 0.001,
            ..DdpConfig::default()
        };
        let spec: PolicySpec = policy.parse().unwrap();
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg, spec.build(&Registry::new()).unwrap()).unwrap();
        let full = optimizer(kind, m.store.params().to_vec());
        let mut opt = ddp.optimizer(full, &|p| optimizer(kind, p)).unwrap();
        let mut losses = vec![];
        for s in 0..STEPS {
            m.store.zero_grad().unwrap();
            let base = (s * world + rank) * MICRO * accum;
            let mut step_loss = 0.0;
            for j in 0..accum {
                let (xb, yb) = rows(&x, &y, base + j * MICRO, MICRO);
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
        (losses, m.values())
    });
    let mut out = out.into_iter().map(|r| r.unwrap());
    let (losses, p0) = out.next().unwrap();
    let mut params = vec![p0];
    params.extend(out.map(|(_, p)| p));
    (losses, params)
}

/// Every pinned configuration: `(policy, optimizer, world, accum)`.
fn configurations() -> Vec<(&'static str, &'static str, usize, usize)> {
    let mut all = vec![];
    for policy in ["allreduce", "zero1", "zero2"] {
        for kind in ["sgd", "adamw"] {
            for world in [1, 2, 4] {
                all.push((policy, kind, world, 2));
            }
        }
    }
    for policy in ["fp16", "bf16", "powersgd:2@2"] {
        for kind in ["sgd", "adamw"] {
            all.push((policy, kind, 2, 2));
        }
    }
    // 3 ranks: dividing by the world size is not exact in binary
    all.extend([("fp16", "sgd", 3, 2), ("bf16", "sgd", 3, 2)]);
    all
}

fn key(policy: &str, kind: &str, world: usize, accum: usize) -> String {
    format!("{policy} {kind} world{world} accum{accum}")
}

/// `key -> (losses hash, parameters hash, last loss)` from `pinned.txt`.
fn read_pinned() -> BTreeMap<String, (String, String, f64)> {
    let text = std::fs::read_to_string(PINNED).expect("pinned.txt");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 7, "bad pinned line {l}");
            (
                f[..4].join(" "),
                (f[4].to_string(), f[5].to_string(), f[6].parse().unwrap()),
            )
        })
        .collect()
}

#[test]
fn every_built_in_policy_reproduces_the_results_pinned_before_the_refactor() {
    let write = std::env::var_os("BRIGADE_WRITE_PINNED").is_some();
    let pinned = if write { BTreeMap::new() } else { read_pinned() };
    let mut lines = vec![];
    let mut wrong = vec![];
    for (policy, kind, world, accum) in configurations() {
        let (losses, params) = train(policy, kind, world, accum);
        for (r, p) in params.iter().enumerate().skip(1) {
            assert_eq!(
                max_diff(p, &params[0]),
                0.0,
                "{policy} {kind} world {world}: rank {r} differs"
            );
        }
        let k = key(policy, kind, world, accum);
        let got = (
            format!("{:016x}", fnv_losses(&losses)),
            format!("{:016x}", fnv_params(&params[0])),
        );
        lines.push(format!("{k} {} {} {:.9}", got.0, got.1, losses[STEPS - 1]));
        if !write {
            let last = losses[STEPS - 1];
            match pinned.get(&k) {
                Some((_, _, want)) if policy.starts_with("powersgd") => {
                    if (last - want).abs() > 1e-6 * want.abs() {
                        wrong.push(format!("{k}: pinned last loss {want}, got {last:.9}"));
                    }
                }
                Some((l, p, _)) if (l, p) == (&got.0, &got.1) => {}
                Some(want) => wrong.push(format!("{k}: pinned {want:?}, got {got:?} (last loss {last:.9})")),
                None => wrong.push(format!("{k}: not pinned")),
            }
        }
    }
    if write {
        let header = "# Rank 0's results of each built-in policy before the policy contract (issue 21):\n\
                      # policy optimizer world accum, FNV-1a of the losses' f64 bits, of the final parameters'\n\
                      # f32 bits, the last loss. Written by BRIGADE_WRITE_PINNED=1 (see pinned.rs).\n";
        std::fs::write(PINNED, format!("{header}{}\n", lines.join("\n"))).unwrap();
        return;
    }
    assert!(
        wrong.is_empty(),
        "results moved from the pinned ones:\n{}",
        wrong.join("\n")
    );
}
