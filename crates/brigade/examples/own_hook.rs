//! A reducer policy written outside Brigade's crates: top-k sparsification with error feedback,
//! against the public policy contract (`brigade::ddp::ReducerPolicy`). Trains the same MLP
//! through the library's loop (`brigade::fit`) on 2 thread ranks with plain all-reduce and with
//! top-k, each rank making its own policy, and prints bytes sent and loss side by side.
//!
//! `cargo run --release -p brigade --example own_hook [-- STEPS]`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use brigade::ddp::policy::{Collectives, PerBucket, PolicyBucket, Reduction};
use brigade::ddp::{DdpError, ReducerPolicy};
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::tensor::Tensor;
use brigade::{OptimizerConfig, TrainConfig};

/// Sends each rank's `fraction` largest gradient entries (values, with their indices as a side
/// buffer in the same all-gather), keeps the rest as error to add next time, and averages what
/// the ranks sent. One policy per rank: it holds state (per bucket, so it lives in a
/// `PerBucket`, which drops it when DDP rebuilds its buckets).
struct TopK {
    fraction: f64,
    error: PerBucket<Vec<f32>>,
    bytes: Arc<AtomicUsize>,
}

impl ReducerPolicy for TopK {
    fn name(&self) -> String {
        format!("top-{}%", self.fraction * 100.0)
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Collectives) -> brigade::ddp::Result<Reduction> {
        let world = comm.world_size() as f32;
        let mut g: Vec<f32> = bucket.tensor.to_vec()?;
        let n = g.len();
        let e = self.error.get_or_insert_with(&bucket, || vec![0.0; n]);
        g.iter_mut().zip(e.iter()).for_each(|(g, e)| *g += e); // error feedback
        let k = ((n as f64 * self.fraction).ceil() as usize).clamp(1, n.max(1));
        let mut order: Vec<usize> = (0..n).collect();
        order.select_nth_unstable_by(k - 1, |&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        order.truncate(k);
        let values: Vec<f32> = order.iter().map(|&i| g[i]).collect();
        let index: Vec<u8> = order.iter().flat_map(|&i| (i as u32).to_le_bytes()).collect();
        *e = g; // what is not sent stays as error
        order.iter().for_each(|&i| e[i] = 0.0);
        self.bytes.fetch_add(k * 8, Ordering::Relaxed);
        let (values, index) = (Tensor::from_vec(values, &[k])?, Tensor::from_vec(index, &[4 * k])?);
        let gathered = comm.all_gather_with_side(&values, &index, &bucket.tag());
        Ok(Reduction::Full(gathered.then(move |(v, i)| {
            let (v, i) = (v.to_vec::<f32>()?, i.to_vec::<u8>()?);
            let mut out = vec![0.0f32; n];
            for (val, idx) in v.iter().zip(i.chunks_exact(4)) {
                let idx = u32::from_le_bytes([idx[0], idx[1], idx[2], idx[3]]) as usize;
                let slot = out.get_mut(idx).ok_or_else(|| DdpError::Policy {
                    policy: "top-k".into(),
                    reason: format!("index {idx} of {n}"),
                })?;
                *slot += val / world;
            }
            Ok(Tensor::from_vec(out, &[n])?)
        })))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args().nth(1).map_or(Ok(60), |s| s.parse())?;
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
    // All-reduce: every rank sends each bucket's f32s once a step.
    let plain_bytes = steps * 2 * plain.outcome.buckets.iter().map(|b| b.bytes).sum::<usize>();
    let sent = Arc::new(AtomicUsize::new(0));
    let bytes = sent.clone();
    let cfg = TrainConfig {
        // each rank makes its own policy: the error it keeps is its own
        comm_hook: Arc::new(move |_rank: usize| {
            Box::new(TopK {
                fraction: 0.05,
                error: PerBucket::new(),
                bytes: bytes.clone(),
            }) as Box<dyn ReducerPolicy>
        }),
        ..TrainConfig::new(steps, 32, sgd)
    };
    let (topk, topk_bytes) = (train(&cfg)?.outcome.losses, sent.load(Ordering::Relaxed));
    println!("{:>6} {:>12} {:>12}", "step", "allreduce", "top-5%+EF");
    for s in (0..steps).filter(|s| s % 10 == 0 || s + 1 == steps) {
        println!("{s:>6} {:>12.4} {:>12.4}", plain.outcome.losses[s], topk[s]);
    }
    println!(
        "bytes sent by the ranks: allreduce {plain_bytes}, top-5% {topk_bytes} ({:.1}x fewer)",
        plain_bytes as f64 / topk_bytes.max(1) as f64
    );
    if !(topk.last() < topk.first()) {
        return Err("top-k did not train".into());
    }
    Ok(())
}
