//! Local SGD as a user's reducer policy, written against the public contract
//! (`brigade::ddp::ReducerPolicy`) alone: plain averaging all-reduce for the first K steps;
//! after that no gradient crosses the ranks (each steps on its own), and every H steps the
//! models are averaged (in `after_step`, which runs after each optimizer step). Its step count
//! is its state; between averagings each rank's parameters and momentum are its own, which it
//! declares (`replicas`), so that a checkpoint keeps every rank's and a resume continues each
//! exactly. Trains an MLP on 2 thread ranks through `brigade::fit` and prints loss and wire
//! bytes against all-reduce.
//!
//! `cargo run --release -p brigade --example local_sgd [-- STEPS [K H]]`

use std::sync::Arc;

use brigade::comm::ReduceOp;
use brigade::ddp::policy::{Group, PolicyBucket, Reduction, StepContext};
use brigade::ddp::{DdpError, KeepsState, RankState, ReducerPolicy, Replicas};
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::tensor::Tensor;
use brigade::{OptimizerConfig, RunReport, TrainConfig};

/// All-reduce for `k` steps, then each rank alone, the models averaged every `h` steps.
pub(crate) struct LocalSgd {
    k: u64,
    h: u64,
    steps: u64,
}

impl LocalSgd {
    /// All-reduce for `k` steps, then the models averaged every `h` steps.
    pub(crate) fn new(k: u64, h: u64) -> LocalSgd {
        LocalSgd { k, h, steps: 0 }
    }
}

impl ReducerPolicy for LocalSgd {
    fn name(&self) -> String {
        format!("local-sgd:{}@{}", self.h, self.k)
    }

    fn keeps_state(&self) -> KeepsState {
        KeepsState::InStateDict // its step count
    }

    fn replicas(&self) -> Replicas {
        // after the first K steps each rank steps on its own gradients: its parameters differ
        // until the next averaging, its momentum also after it
        Replicas::Diverge(RankState::ALL)
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        if self.steps < self.k {
            let avg = comm.all_reduce(&bucket.tensor, ReduceOp::Avg, &bucket.tag());
            return Ok(Reduction::Full(avg));
        }
        // the rank's own gradients, untouched
        Ok(Reduction::Full(comm.ready(bucket.tensor)))
    }

    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
    fn after_step(&mut self, step: &StepContext<'_>, comm: &Group) -> brigade::ddp::Result<()> {
        self.steps += 1;
        if self.steps > self.k && (self.steps - self.k) % self.h == 0 {
            // every rank averages after the same step (all-reduce in place)
            for (i, p) in step.params.iter().enumerate() {
                comm.all_reduce(&p.value(), ReduceOp::Avg, &format!("local-sgd.param{i}"))
                    .wait()?;
            }
        }
        Ok(())
    }

    fn state_dict(&self) -> brigade::ddp::Result<Vec<(String, Tensor)>> {
        Ok(vec![("steps".into(), Tensor::from_vec(vec![self.steps as i64], &[1])?)])
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade::ddp::Result<()> {
        let steps = state.iter().find(|(k, _)| k == "steps").map(|(_, t)| t);
        self.steps = steps
            .ok_or_else(|| DdpError::PolicyState("local SGD: no 'steps' in its state".into()))?
            .item()? as u64;
        Ok(())
    }
}

fn wire_bytes(r: &RunReport) -> f64 {
    r.outcome.sent().iter().map(|s| s.wire_bytes).sum()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |i: usize, default: u64| std::env::args().nth(i).map_or(Ok(default), |s| s.parse());
    let (steps, k, h) = (arg(1, 60)? as usize, arg(2, 4)?, arg(3, 5)?);
    if steps < 10 || h == 0 {
        return Err("local_sgd needs STEPS >= 10 and H >= 1".into());
    }
    let sgd = OptimizerConfig::Sgd {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let train = |cfg: &TrainConfig| {
        brigade::fit(
            &LaunchConfig::threads(2),
            cfg,
            |_| Ok(Dataset::teacher(4096, 32, 4, 1)?),
            |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![32, 128, 128, 4]), 0)?)),
        )
    };
    let plain = train(&TrainConfig::new(steps, 32, sgd))?;
    let cfg = {
        let mut c = TrainConfig::new(steps, 32, sgd);
        // each rank makes its own policy
        c.distributed.get_or_insert_default().policy = Arc::new(move |_rank: usize| LocalSgd::new(k, h));
        c
    };
    let local = train(&cfg)?;
    let (a, b) = (&plain.outcome.losses(), &local.outcome.losses());
    println!("{:>6} {:>12} {:>14}", "step", "allreduce", format!("local K={k} H={h}"));
    for s in (0..steps).filter(|s| s % 10 == 0 || s + 1 == steps) {
        println!("{s:>6} {:>12.4} {:>14.4}", a[s], b[s]);
    }
    let (plain_wire, local_wire) = (wire_bytes(&plain), wire_bytes(&local));
    println!(
        "wire bytes per rank: allreduce {plain_wire:.0}, local SGD {local_wire:.0} ({:.3} of all-reduce's)",
        local_wire / plain_wire
    );
    if a[..=k as usize] != b[..=k as usize] {
        return Err("local SGD's first K steps are not plain all-reduce's".into());
    }
    if mean(&b[steps - 5..]) >= mean(&b[..5]) {
        return Err("local SGD did not train".into());
    }
    Ok(())
}
