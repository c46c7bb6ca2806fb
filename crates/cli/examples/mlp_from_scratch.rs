//! An MLP defined from `Linear` layers, trained on 2 thread ranks with DDP on synthetic data;
//! prints the loss curve (the mean over ranks of each step).
//!
//! `cargo run --release -p brigade --example mlp_from_scratch [-- STEPS]`

use std::time::Duration;

use brigade::autograd::{scope, Optimizer, ParamStore, Sgd, Var};
use brigade::comm::{Buffer, ReduceOp};
use brigade::ddp::{DdpConfig, DistributedDataParallel};
use brigade::launch::{launch, Backend, LaunchConfig};
use brigade::models::nn::{Activation, Init, Linear, Params};
use brigade::tensor::{DType, Rng, Tensor};

/// `Linear ReLU Linear ReLU Linear`, parameters named `layers.{i}.weight` / `.bias`.
struct Mlp {
    store: ParamStore,
    layers: Vec<Linear>,
}

impl Mlp {
    fn new(widths: &[usize], seed: u64) -> brigade::models::Result<Mlp> {
        let (mut store, mut rng) = (ParamStore::new(), Rng::new(seed));
        let mut p = Params::new(&mut store, &mut rng, DType::F32);
        let layers = (0..widths.len() - 1)
            .map(|i| {
                Linear::new(
                    &mut p.sub(&format!("layers.{i}")),
                    widths[i],
                    widths[i + 1],
                    true,
                    Init::TorchLinear,
                )
            })
            .collect::<brigade::models::Result<_>>()?;
        Ok(Mlp { store, layers })
    }

    /// Cross-entropy of `x [B, in]` against `y [B]`; one scope per layer (one span each in
    /// timelines, one announcement group on the gradient-ready bus).
    fn loss(&self, x: &Tensor, y: &Tensor) -> brigade::models::Result<Var> {
        let mut h = Var::constant(x.clone());
        for (i, layer) in self.layers.iter().enumerate() {
            let last = i + 1 == self.layers.len();
            h = scope(&format!("layers.{i}"), || {
                let z = layer.forward(&h)?;
                if last {
                    Ok(z)
                } else {
                    Activation::Relu.apply(&z)
                }
            })?;
        }
        Ok(h.cross_entropy(y)?)
    }
}

/// `n` rows of 16 inputs labelled by which of the first 4 is largest (learnable).
fn synthetic(n: usize) -> (Vec<f32>, Vec<i64>) {
    let mut rng = Rng::new(7);
    let x: Vec<f32> = (0..n * 16).map(|_| rng.normal() as f32).collect();
    let y = x
        .chunks(16)
        .map(|r| (0..4).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as i64)
        .collect();
    (x, y)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args().nth(1).map_or(Ok(60), |s| s.parse())?;
    let (world, batch) = (2, 32);
    let cfg = LaunchConfig {
        backend: Backend::Thread,
        world_size: world,
        timeout: Duration::from_secs(60),
        net: None,
        recorder: None,
    };
    let data = synthetic(steps * world * batch);
    let launched = launch(
        &cfg,
        |_| Ok(data),
        |ctx, (x, y)| {
            // Every rank builds the model (DDP starts them all from rank 0's values).
            let model = Mlp::new(&[16, 64, 64, 4], 0)?;
            let _ddp = DistributedDataParallel::new(&model.store, ctx.comm.clone(), DdpConfig::default())?;
            let mut opt = Sgd::new(model.store.params().to_vec(), 0.1, 0.9, 0.0);
            let mut curve = vec![];
            for s in 0..steps {
                let row = (s * ctx.world_size + ctx.rank) * batch; // this rank's shard of step s
                let xb = Tensor::from_slice(&x[row * 16..(row + batch) * 16], &[batch, 16])?;
                let yb = Tensor::from_slice(&y[row..row + batch], &[batch])?;
                model.store.zero_grad()?;
                let loss = model.loss(&xb, &yb)?;
                loss.backward()?; // DDP all-reduces the gradient buckets while this runs
                opt.step()?;
                let mean = ctx
                    .comm
                    .all_reduce(Buffer::F32(vec![loss.value().item()? as f32]), ReduceOp::Avg, "loss")
                    .wait()?;
                curve.push(mean.as_f32().map_or(f32::NAN, |v| v[0]));
            }
            Ok(curve)
        },
    )?;
    let (_, curve) = &launched.results[0];
    for (s, l) in curve
        .iter()
        .enumerate()
        .filter(|(s, _)| s % 10 == 0 || *s + 1 == curve.len())
    {
        println!("step {s:>4}  loss {l:.4}");
    }
    if !(curve.last() < curve.first()) {
        return Err("the loss did not go down".into());
    }
    Ok(())
}
