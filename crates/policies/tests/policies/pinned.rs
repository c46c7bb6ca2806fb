//! Results recorded before the reducer-policy contract: every built-in policy, run here
//! through DDP, must train as the code that preceded the contract did, within the rounding
//! another CPU's GEMM brings, and exactly where one run can compare with itself.
//!
//! `pinned.txt` holds, per configuration, rank 0's five losses and four fixed random
//! projections of its final parameters (f32 values, registration order, summed in f64), with
//! how far the parameters moved from their initial values (the 2-norm). They were written
//! under `qemu-x86_64 -cpu Haswell` by the code whose FNV-1a fingerprints of the same losses'
//! and parameters' bits equalled, on that CPU, the ones the pre-contract code had recorded: the
//! values are the pre-contract results, not today's.
//!
//! What is exact, in this run, on any CPU: every rank ends with rank 0's parameters; ZeRO-1
//! and ZeRO-2 give plain all-reduce's losses and parameters bit for bit (the same sums in the
//! same order, then the same optimizer arithmetic on a shard).
//!
//! What is within a tolerance, against the recorded values: the `gemm` crate picks its kernels
//! (AVX-512, AVX2, NEON) and so its summation order from the CPU it runs on, so the same build
//! computes other last bits elsewhere. Each loss must be within [`LOSS_TOL`] of the recorded one
//! (relative), and each projection of the final parameters within [`param_tol`] of the movement
//! (|p·w − p₀·w| ≤ tol·‖p_final − p_init‖₂, w a unit vector). Measured on an AVX-512 CPU (AMD
//! Zen 4) against the recorded AVX2 run: losses within 7.2e-8, projections within 4.4e-7 of the
//! movement; each tolerance sits about ten times above. fp16 and bf16 round each gradient to 11
//! and 8 bits, where a last-bit difference before the cast can flip a rounding, so theirs are
//! wider. A policy whose arithmetic changes moves these by more: casting fp16 or bf16 before
//! dividing by 3 ranks moves a loss by 1.4e-6 and 3.6e-5, PowerSGD without error feedback by
//! 2.9e-5; a ZeRO shard step that differs at all fails the exact comparison with all-reduce.
//!
//! PowerSGD runs its products as tensor matmuls, another summation order than the loops of the
//! pre-contract code, so its recorded values are today's (written with the others) and its
//! tolerance is the f32 policies'.
//!
//! `BRIGADE_WRITE_PINNED=1` in the environment of this test rewrites the file from the code under
//! test: only ever to record results a change meant to move, and under `qemu-x86_64 -cpu Haswell`
//! (`BRIGADE_WRITE_PINNED=1 scripts/test-other-cpu.sh Haswell -- pinned`) so that the values stay
//! those of the AVX2 kernels that the tolerances above were measured against.

use crate::common::{data, max_diff, rows, Mlp};

use std::collections::BTreeMap;
use std::sync::Arc;

use brigade_autograd::{AdamW, Optimizer, Sgd, Var};
use brigade_comm::run_on_threads;
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
        let comm = Arc::new(comm);
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

/// Losses within this of the recorded ones, relative: the f32 GEMM's summation order moves a
/// loss of this MLP by up to 7.2e-8 between AVX2 and AVX-512 kernels.
const LOSS_TOL: f64 = 5e-7;

/// Each projection of the final parameters within this fraction of how far they moved: up to
/// 4.4e-7 between AVX2 and AVX-512 kernels.
fn param_tol(policy: &str) -> f64 {
    match policy {
        // a last-bit difference before the cast can round a gradient to the next 11-bit
        // (fp16) or 8-bit (bf16) value, a step of 2^-11 or 2^-8 of that gradient
        "fp16" => 5e-6,
        "bf16" => 2e-5,
        _ => 2e-6,
    }
}

/// Four fixed unit vectors over `n` parameters (a seeded normal draw, normalised), so that a
/// difference in any parameter shows in every projection with overwhelming probability.
fn directions(n: usize) -> Vec<Vec<f64>> {
    let mut rng = brigade_tensor::Rng::new(0x5eed);
    (0..4)
        .map(|_| {
            let w: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
            let norm = w.iter().map(|x| x * x).sum::<f64>().sqrt();
            w.into_iter().map(|x| x / norm).collect()
        })
        .collect()
}

fn flat(params: &[Vec<f32>]) -> Vec<f64> {
    params.iter().flatten().map(|&x| x as f64).collect()
}

/// What is recorded of one run: its losses, the projections of its final parameters, and how
/// far those moved from rank 0's initial parameters.
#[derive(Debug, Clone, PartialEq)]
struct Record {
    losses: Vec<f64>,
    projections: Vec<f64>,
    moved: f64,
}

impl Record {
    fn of(losses: &[f64], params: &[Vec<f32>]) -> Record {
        let p = flat(params);
        let p0 = flat(&Mlp::new(&WIDTHS, 42).values());
        let moved = p.iter().zip(&p0).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        let projections = directions(p.len())
            .iter()
            .map(|w| w.iter().zip(&p).map(|(w, x)| w * x).sum())
            .collect();
        Record {
            losses: losses.to_vec(),
            projections,
            moved,
        }
    }

    fn line(&self) -> String {
        let num = |v: &[f64]| v.iter().map(|x| format!("{x:.17e}")).collect::<Vec<_>>().join(" ");
        format!("{} {} {:.17e}", num(&self.losses), num(&self.projections), self.moved)
    }

    fn parse(fields: &[&str]) -> Record {
        let v: Vec<f64> = fields.iter().map(|f| f.parse().expect("a number")).collect();
        assert_eq!(
            v.len(),
            STEPS + 4 + 1,
            "a recorded line has {STEPS} losses, 4 projections and the movement"
        );
        Record {
            losses: v[..STEPS].to_vec(),
            projections: v[STEPS..STEPS + 4].to_vec(),
            moved: v[STEPS + 4],
        }
    }

    /// The worst loss difference (relative) and projection difference (of the movement).
    fn distance(&self, recorded: &Record) -> (f64, f64) {
        let loss = self
            .losses
            .iter()
            .zip(&recorded.losses)
            .map(|(a, b)| (a - b).abs() / b.abs())
            .fold(0.0, f64::max);
        let param = self
            .projections
            .iter()
            .zip(&recorded.projections)
            .map(|(a, b)| (a - b).abs() / recorded.moved)
            .fold(0.0, f64::max);
        (loss, param)
    }
}

/// `key -> record` from `pinned.txt`.
fn read_pinned() -> BTreeMap<String, Record> {
    let text = std::fs::read_to_string(PINNED).expect("pinned.txt");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[..4].join(" "), Record::parse(&f[4..]))
        })
        .collect()
}

#[test]
fn every_built_in_policy_trains_as_recorded_before_the_contract_within_another_cpus_rounding() {
    let write = std::env::var_os("BRIGADE_WRITE_PINNED").is_some();
    let pinned = if write { BTreeMap::new() } else { read_pinned() };
    let mut lines = vec![];
    let mut wrong = vec![];
    let mut report = vec![];
    // plain all-reduce's results in this run, to which ZeRO's must be equal bit for bit
    let mut allreduce: BTreeMap<(&str, usize), (Vec<f64>, Vec<Vec<f32>>)> = BTreeMap::new();
    for (policy, kind, world, accum) in configurations() {
        let (losses, params) = train(policy, kind, world, accum);
        for (r, p) in params.iter().enumerate().skip(1) {
            assert_eq!(
                max_diff(p, &params[0]),
                0.0,
                "{policy} {kind} world {world}: rank {r} differs"
            );
        }
        if policy == "allreduce" {
            allreduce.insert((kind, world), (losses.clone(), params[0].clone()));
        } else if policy.starts_with("zero") {
            let (l, p) = &allreduce[&(kind, world)];
            assert_eq!(
                &losses, l,
                "{policy} {kind} world {world}: losses differ from all-reduce's"
            );
            assert_eq!(
                max_diff(&params[0], p),
                0.0,
                "{policy} {kind} world {world}: parameters differ from all-reduce's"
            );
        }
        let k = key(policy, kind, world, accum);
        let got = Record::of(&losses, &params[0]);
        lines.push(format!("{k} {}", got.line()));
        if write {
            continue;
        }
        match pinned.get(&k) {
            Some(want) => {
                let (loss, param) = got.distance(want);
                report.push(format!(
                    "{k}: losses {loss:.1e}, parameters {param:.1e} of the movement"
                ));
                if loss > LOSS_TOL || param > param_tol(policy) {
                    wrong.push(format!(
                        "{k}: losses {loss:.2e} from the recorded ones (tolerance {LOSS_TOL:.0e}), \
                         parameters {param:.2e} of their movement (tolerance {:.0e})",
                        param_tol(policy)
                    ));
                }
            }
            None => wrong.push(format!("{k}: not recorded")),
        }
    }
    if write {
        let header = "# Rank 0's results of each built-in policy: policy optimizer world accum, the five losses,\n\
                      # four projections of the final parameters, how far they moved (2-norm). See pinned.rs\n\
                      # for what the values are and how they are compared. Written by BRIGADE_WRITE_PINNED=1.\n";
        std::fs::write(PINNED, format!("{header}{}\n", lines.join("\n"))).unwrap();
        return;
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        wrong.is_empty(),
        "results moved from the recorded ones:\n{}",
        wrong.join("\n")
    );
}
