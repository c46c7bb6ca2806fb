//! A real recipe through `fit`, no hand-written loop: a cosine learning-rate schedule with
//! warmup, global-norm gradient clipping, and evaluation on held-out rows every 10 steps, on 2
//! thread ranks with DDP; prints the learning rate, gradient norm, training and validation loss.
//!
//! `cargo run --release -p brigade --example recipe [-- STEPS]`

use std::sync::Arc;

use brigade::launch::LaunchConfig;
use brigade::models::{Batch, Dataset, Mlp, MlpConfig};
use brigade::recipe::{EvalConfig, EvalSource};
use brigade::source::{DataSource, Microbatch};
use brigade::{OptimizerConfig, ScheduleConfig, ScheduleName, TrainConfig};

/// Rows `0..TRAIN` of a teacher dataset train; rows `TRAIN..TRAIN + VAL` are held out.
const TRAIN: usize = 4096;
const VAL: usize = 512;

struct Split(Dataset);

impl DataSource for Split {
    fn batch(&self, mb: &Microbatch) -> brigade::Result<Batch> {
        let rows: Vec<usize> = (0..mb.rows).map(|i| (mb.first_row() + i) % TRAIN).collect();
        Ok(self.0.gather(&rows)?)
    }
}

impl EvalSource for Split {
    fn batches(&self, rank: usize, world_size: usize) -> brigade::Result<Vec<Batch>> {
        let share = VAL / world_size;
        let rows: Vec<usize> = (TRAIN + rank * share..TRAIN + (rank + 1) * share).collect();
        Ok(vec![self.0.gather(&rows)?])
    }
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN loss did not go down either
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args().nth(1).map_or(Ok(200), |s| s.parse())?;
    let split = || Dataset::teacher(TRAIN + VAL, 16, 4, 0).map(Split);
    let cfg = {
        let mut c = TrainConfig::new(steps, 32, OptimizerConfig::adamw(3e-3, None));
        c.recipe.schedule = ScheduleConfig {
            name: ScheduleName::Cosine,
            warmup_steps: steps as u64 / 10,
            min_lr: 1e-4,
            ..ScheduleConfig::default() // T: the run's steps
        };
        c.recipe.clip_grad_norm = Some(1.0);
        c.recipe.eval = Some(EvalConfig {
            every: 10,
            data: Arc::new(split()?),
        });
        c
    };
    let report = brigade::fit(
        &LaunchConfig::threads(2),
        &cfg,
        |_world| Ok(split()?),
        |_ctx| Ok(Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 4]), 0)?)),
    )?;
    let o = &report.outcome;
    for r in o.steps.iter().filter(|r| r.val_loss.is_some()) {
        let norm = r.grad_norm.unwrap_or(f64::NAN);
        let val = r.val_loss.unwrap_or(f64::NAN);
        println!(
            "step {:>4}  lr {:.2e}  grad norm {norm:.3}  loss {:.4}  val loss {val:.4}",
            r.step, r.lr, r.loss
        );
    }
    let val: Vec<f64> = o.steps.iter().filter_map(|r| r.val_loss).collect();
    if !(val.last() < val.first()) {
        return Err("the validation loss did not go down".into());
    }
    Ok(())
}
