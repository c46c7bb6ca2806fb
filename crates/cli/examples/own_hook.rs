//! A reducer policy written outside Brigade's crates: top-k sparsification with error feedback,
//! against the public hook contract (`brigade::ddp::hooks::CommHook`). Trains the same MLP on
//! 2 thread ranks with plain all-reduce and with top-k, printing bytes sent and loss side by side.
//!
//! `cargo run --release -p brigade --example own_hook [-- STEPS]`

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brigade::autograd::{Optimizer, Sgd};
use brigade::comm::{Buffer, CommError, Communicator, Work};
use brigade::ddp::hooks::{AllReduceHook, CommHook, GradBucket};
use brigade::ddp::{DdpConfig, DistributedDataParallel};
use brigade::launch::{launch, Backend, LaunchConfig};
use brigade::models::{Batch, Dataset, Mlp, MlpConfig, Model};

/// Sends each rank's `fraction` largest gradient entries (value + index), keeps the rest as
/// error to add next time, and averages what the ranks sent. One hook per rank: it holds state.
struct TopK {
    fraction: f64,
    error: Mutex<HashMap<usize, Vec<f32>>>,
    bytes: Arc<AtomicUsize>,
}

impl CommHook for TopK {
    fn name(&self) -> String {
        format!("top-{}%", self.fraction * 100.0)
    }

    fn reduce(&self, comm: &Arc<dyn Communicator>, bucket: GradBucket) -> Work<Vec<f32>> {
        let (n, world) = (bucket.buffer.len(), comm.world_size() as f32);
        let mut g = bucket.buffer;
        let mut error = self.error.lock().unwrap();
        let e = error.entry(bucket.index).or_insert_with(|| vec![0.0; n]);
        g.iter_mut().zip(e.iter()).for_each(|(g, e)| *g += e); // error feedback
        let k = ((n as f64 * self.fraction).ceil() as usize).clamp(1, n.max(1));
        let mut order: Vec<usize> = (0..n).collect();
        order.select_nth_unstable_by(k - 1, |&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        order.truncate(k);
        let values: Vec<f32> = order.iter().map(|&i| g[i]).collect();
        let index: Vec<u8> = order.iter().flat_map(|&i| (i as u32).to_le_bytes()).collect();
        // what is not sent stays as error
        *e = g;
        order.iter().for_each(|&i| e[i] = 0.0);
        self.bytes.fetch_add(k * 8, Ordering::Relaxed);
        // both collectives issued now, in the same order on every rank
        let tag = format!("topk{}", bucket.index);
        let values = comm.all_gather(Buffer::F32(values), &tag);
        let index = comm.all_gather(Buffer::U8(index), &tag);
        values.and_then(move |v| {
            Ok(index.then(move |i| {
                let (v, i) = (
                    v.as_f32().unwrap_or_default().to_vec(),
                    i.as_u8().unwrap_or_default().to_vec(),
                );
                let mut out = vec![0.0f32; n];
                for (val, idx) in v.iter().zip(i.chunks_exact(4)) {
                    let idx = u32::from_le_bytes([idx[0], idx[1], idx[2], idx[3]]) as usize;
                    *out.get_mut(idx)
                        .ok_or_else(|| CommError::InvalidArgument(format!("index {idx} of {n}")))? += val / world;
                }
                Ok(out)
            }))
        })
    }
}

/// Trains 2 ranks with the hook `make()` builds on each; returns (losses, bytes sent by rank 0).
fn train(
    steps: usize,
    make: impl Fn(Arc<AtomicUsize>) -> Arc<dyn CommHook> + Sync,
) -> Result<(Vec<f64>, usize), Box<dyn std::error::Error>> {
    let cfg = LaunchConfig {
        backend: Backend::Thread,
        world_size: 2,
        timeout: Duration::from_secs(60),
        net: None,
        recorder: None,
    };
    let mlp = MlpConfig::new(vec![32, 128, 128, 4]);
    let data = Dataset::teacher(4096, 32, 4, 1)?;
    let launched = launch(
        &cfg,
        |_| Ok(data),
        |ctx, data| {
            let model = Mlp::new(mlp.clone(), 0)?;
            let bytes = Arc::new(AtomicUsize::new(0));
            let ddp_cfg = DdpConfig {
                comm_hook: make(bytes.clone()),
                ..DdpConfig::default()
            };
            let _ddp = DistributedDataParallel::new(model.params(), ctx.comm.clone(), ddp_cfg)?;
            let mut opt = Sgd::new(model.params().params().to_vec(), 0.05, 0.9, 0.0);
            let mut losses = vec![];
            for s in 0..steps {
                let batch: Batch = data.batch((s * ctx.world_size + ctx.rank) * 32, 32)?;
                model.params().zero_grad()?;
                let loss = model.loss(&batch)?;
                losses.push(loss.value().item()?);
                loss.backward()?;
                opt.step()?;
            }
            Ok((losses, bytes.load(Ordering::Relaxed)))
        },
    )?;
    Ok(launched.results.into_iter().next().map(|(_, r)| r).ok_or("no rank 0")?)
}

/// Counts what the default policy sends (one f32 per gradient element) around it.
struct Counted(Arc<AtomicUsize>);

impl CommHook for Counted {
    fn name(&self) -> String {
        "allreduce".into()
    }
    fn reduce(&self, comm: &Arc<dyn Communicator>, bucket: GradBucket) -> Work<Vec<f32>> {
        self.0.fetch_add(bucket.buffer.len() * 4, Ordering::Relaxed);
        AllReduceHook.reduce(comm, bucket)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args().nth(1).map_or(Ok(60), |s| s.parse())?;
    let (plain, plain_bytes) = train(steps, |b| Arc::new(Counted(b)))?;
    let (topk, topk_bytes) = train(steps, |b| {
        Arc::new(TopK {
            fraction: 0.05,
            error: Mutex::new(HashMap::new()),
            bytes: b,
        })
    })?;
    println!("{:>6} {:>12} {:>12}", "step", "allreduce", "top-5%+EF");
    for s in (0..steps).filter(|s| s % 10 == 0 || s + 1 == steps) {
        println!("{s:>6} {:>12.4} {:>12.4}", plain[s], topk[s]);
    }
    println!(
        "bytes sent by rank 0: allreduce {plain_bytes}, top-5% {topk_bytes} ({:.1}x fewer)",
        plain_bytes as f64 / topk_bytes.max(1) as f64
    );
    if !(topk.last() < topk.first()) {
        return Err("top-k did not train".into());
    }
    Ok(())
}
