//! What `scripts/pytorch_parity.py` does with torchrun, in Brigade: an 8→64→LayerNorm→GELU→1
//! regressor on synthetic data, 2 ranks, AdamW, int8 with error feedback, warmup + cosine,
//! clipping at 1.0, a checkpoint at step 25 of 50 and an exact resume from it (asserted), and
//! held-out evaluation in eval mode. `cargo run --release -p brigade --example pytorch_parity`
use std::sync::Arc;

use brigade::config::{CheckpointConfig, Instrumentation};
use brigade::models::{nn::Sequential, Dataset};
use brigade::policies::Int8;
use brigade::recipe::{EvalConfig, HeldOut};
use brigade::tensor::{DType, Rng, Tensor};
use brigade::{fit, launch::LaunchConfig, observe::on_step, outcome::TrainOutcome, policy::per_rank};
use brigade::{OptimizerConfig, ScheduleConfig, ScheduleName, TrainConfig};

/// `y = sin(x · w) + noise` over `rows` rows of 8 inputs.
fn data(rows: usize, seed: u64) -> brigade::Result<Dataset> {
    let x = Tensor::randn(&[rows, 8], 1.0, DType::F32, &mut Rng::new(seed));
    let w = Tensor::randn(&[8, 1], 0.5, DType::F32, &mut Rng::new(7));
    let noise = Tensor::randn(&[rows, 1], 0.05, DType::F32, &mut Rng::new(seed + 1));
    let y = x.matmul(&w)?.sin()?.add(&noise)?;
    Ok(Dataset::from_tensors(
        "sine",
        &[("inputs".into(), x), ("targets".into(), y)],
    )?)
}

fn run(checkpoint: CheckpointConfig, print: bool) -> brigade::Result<TrainOutcome> {
    let mut cfg = TrainConfig::new(50, 32, OptimizerConfig::adamw(3e-3, Some(0.01)));
    cfg.distributed.get_or_insert_default().policy = per_rank(|_| Int8::default());
    cfg.recipe.schedule = ScheduleConfig {
        name: ScheduleName::Cosine,
        warmup_steps: 5,
        ..ScheduleConfig::default()
    };
    cfg.recipe.clip_grad_norm = Some(1.0);
    let held_out = HeldOut::new(data(512, 100)?, 256);
    cfg.recipe.eval = Some(EvalConfig {
        every: 25,
        data: Arc::new(held_out),
    });
    cfg.runtime.instrument = Instrumentation {
        observer: print.then(|| on_step(|s| println!("step {:>2} loss {:.4} lr {:.2e}", s.step, s.loss, s.lr))),
        ..Instrumentation::default()
    };
    cfg.runtime.checkpoint = checkpoint;
    let model = |_: &_| Ok(Box::new(Sequential::new(0).linear(8, 64)?.layer_norm(64)?.gelu().linear(64, 1)?) as _);
    Ok(fit(&LaunchConfig::threads(2), &cfg, |_| data(4096, 1), model)?.outcome)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("pytorch-parity-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let write = CheckpointConfig {
        path: Some(dir.join("run-{step}.ckpt")),
        every: Some(25),
        ..CheckpointConfig::default()
    };
    let straight = run(write, true)?;
    let resume = CheckpointConfig {
        resume: Some(dir.join("run-25.ckpt")),
        ..CheckpointConfig::default()
    };
    let resumed = run(resume, false)?;
    assert_eq!(
        resumed.losses(),
        straight.losses()[25..],
        "the resume from step 25 is exact"
    );
    let params = |o: &TrainOutcome| {
        o.params
            .iter()
            .map(|p| p.1.to_vec::<f32>())
            .collect::<Result<Vec<_>, _>>()
    };
    assert_eq!(params(&resumed)?, params(&straight)?, "the parameters after the resume");
    let val: Vec<f64> = straight.val_losses().into_iter().flatten().collect();
    println!("held-out loss (eval mode) after steps 25 and 50: {val:?}; resume exact");
    assert!(
        val[1] < val[0] && straight.losses()[49] < straight.losses()[0],
        "it learns"
    );
    Ok(std::fs::remove_dir_all(&dir)?)
}
