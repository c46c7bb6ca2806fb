//! A model and a data source of your own, trained through the library's loop: an MLP defined
//! from `Linear` layers, fed synthetic rows, on 2 thread ranks with DDP (`brigade::fit`, the loop
//! `brigade train` runs: sharding, accumulation, checkpoints, timelines); prints the loss curve.
//!
//! `cargo run --release -p brigade --example mlp_from_scratch [-- STEPS]`

use brigade::autograd::{scope, ParamStore, Var};
use brigade::launch::LaunchConfig;
use brigade::models::nn::{Activation, Init, Linear, Params};
use brigade::models::{Batch, Model, Result};
use brigade::source::{DataSource, Microbatch};
use brigade::tensor::{DType, Rng, Tensor};
use brigade::{OptimizerConfig, TrainConfig};

/// `Linear ReLU Linear ReLU Linear`, parameters named `layers.{i}.weight` / `.bias`.
struct Mlp {
    store: ParamStore,
    layers: Vec<Linear>,
}

impl Mlp {
    fn new(widths: &[usize], seed: u64) -> Result<Mlp> {
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
            .collect::<Result<_>>()?;
        Ok(Mlp { store, layers })
    }
}

impl Model for Mlp {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    /// Cross-entropy of `inputs [B, in]` against `targets [B]`; one scope per layer (one span
    /// each in timelines, one announcement group on the gradient-ready bus).
    fn loss(&self, batch: &Batch) -> Result<Var> {
        let (inputs, targets) = (batch.tensor("mlp", "inputs")?, batch.tensor("mlp", "targets")?);
        let mut h = Var::constant(inputs.clone());
        for (i, layer) in self.layers.iter().enumerate() {
            let last = i + 1 == self.layers.len();
            h = scope(&format!("layers.{i}"), || match layer.forward(&h)? {
                z if last => Ok(z),
                z => Activation::Relu.apply(&z),
            })?;
        }
        Ok(h.cross_entropy(targets)?)
    }

    fn layer_names(&self) -> Vec<String> {
        (0..self.layers.len()).map(|i| format!("layers.{i}")).collect()
    }
}

/// Endless synthetic rows: row `i` is 16 normal inputs drawn from seed `i`, labelled by which
/// of the first 4 is largest (learnable). Rank r's share of each step is `mb.first_row()` on.
struct Synthetic;

impl DataSource for Synthetic {
    fn batch(&self, mb: &Microbatch) -> brigade::Result<Batch> {
        let (mut x, mut y) = (vec![], vec![]);
        for i in mb.first_row()..mb.first_row() + mb.rows {
            let mut rng = Rng::new(i as u64);
            let row: Vec<f32> = (0..16).map(|_| rng.normal() as f32).collect();
            y.push((0..4).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap_or(0) as i64);
            x.extend(row);
        }
        Ok(Batch::classify(
            Tensor::from_vec(x, &[mb.rows, 16])?,
            Tensor::from_vec(y, &[mb.rows])?,
        ))
    }
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN loss did not go down either
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args().nth(1).map_or(Ok(60), |s| s.parse())?;
    let sgd = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    // 2 ranks x 32 rows a step; every rank builds its own model (DDP starts them from rank 0's).
    let report = brigade::fit(
        &LaunchConfig::threads(2),
        &TrainConfig::new(steps, 32, sgd),
        |_world| Ok(Synthetic),
        |_ctx| Ok(Box::new(Mlp::new(&[16, 64, 64, 4], 0)?)),
    )?;
    let curve = &report.outcome.losses(); // the mean over ranks of each step
    for (s, l) in curve
        .iter()
        .enumerate()
        .filter(|(s, _)| s % 10 == 0 || s + 1 == curve.len())
    {
        println!("step {s:>4}  loss {l:.4}");
    }
    if !(curve.last() < curve.first()) {
        return Err("the loss did not go down".into());
    }
    Ok(())
}
