//! `fit` under `--precision bf16`: the MLP and the GPT train to within 2% of the f32 run's
//! final loss from the same initial weights and data; the buckets hold bf16 (half the bytes)
//! and f32 master weights sit beside the bf16 parameters; the final weights and the checkpoint
//! are the f32 masters, and 2 steps + resume + 2 steps are 4 straight steps bit for bit;
//! fp16's loss scale skips, backs off and grows as GradScaler's rule says, and resumes
//! with the run; combinations not built are refused in one line.

use std::path::PathBuf;

use crate::common::{self, resuming, writing};
use brigade::config::TrainConfig;
use brigade::launch::LaunchConfig;
use brigade::models::{load_safetensors_with_metadata, Dataset, Gpt, Mlp, MlpConfig, Model};
use brigade::policies::PolicySpec;
use brigade::tensor::DType;
use brigade::{fit, Error, MixedPrecision, OptimizerConfig, RunReport};

fn adamw() -> OptimizerConfig {
    OptimizerConfig::AdamW {
        lr: 3e-3,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

fn config(steps: usize, batch: usize, precision: DType) -> TrainConfig {
    let mut c = TrainConfig::new(steps, batch, adamw());
    c.runtime.compute_threads = Some(1);
    c.recipe.precision = MixedPrecision::uniform(precision);
    c
}

fn mlp(cfg: &TrainConfig) -> brigade::Result<RunReport> {
    let mut cfg = cfg.clone();
    cfg.model.name = "mlp".into();
    fit(
        &LaunchConfig::threads(2),
        &cfg,
        |_| Dataset::teacher(1024, 16, 4, 3).map_err(Into::into),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 64, 4]), 1)?) as Box<dyn Model>),
    )
}

fn gpt(cfg: &TrainConfig) -> brigade::Result<RunReport> {
    let mut cfg = cfg.clone();
    cfg.model.name = "gpt".into();
    fit(
        &LaunchConfig::threads(2),
        &cfg,
        |_| Dataset::builtin_text(16, 0).map_err(Error::from),
        |_| Ok(Box::new(Gpt::new(crate::fake_device::small_gpt(), 0)?) as Box<dyn Model>),
    )
}

fn last(r: &RunReport) -> f64 {
    *r.outcome.losses().last().unwrap()
}

fn tmp(name: &str) -> PathBuf {
    common::tmp("mixed", name)
}

/// The bf16 run against the f32 run of the same model, data and initial weights.
fn bf16_tracks_f32(run: fn(&TrainConfig) -> brigade::Result<RunReport>, steps: usize, batch: usize, what: &str) {
    let f32_run = run(&config(steps, batch, DType::F32)).unwrap();
    let bf16_run = run(&config(steps, batch, DType::BF16)).unwrap();
    let (a, b) = (last(&f32_run), last(&bf16_run));
    let first = f32_run.outcome.losses()[0];
    assert!(a < 0.9 * first, "{what}: the f32 run must learn ({first} -> {a})");
    assert!(
        (b - a).abs() / a < 0.02,
        "{what}: bf16 final loss {b} is not within 2% of f32's {a}"
    );
    // same initial weights: the first losses agree to bf16 rounding, not bit for bit
    let b0 = bf16_run.outcome.losses()[0];
    assert!(
        (b0 - first).abs() / first < 0.01 && b0 != first,
        "{what}: first losses {b0} vs {first}"
    );

    let (m32, m16) = (f32_run.outcome.memory.unwrap(), bf16_run.outcome.memory.unwrap());
    assert_eq!(m16.buckets * 2, m32.buckets, "{what}: bf16 buckets hold half the bytes");
    assert_eq!(m16.parameters * 2, m32.parameters, "{what}: the compute copy is bf16");
    assert_eq!(
        (m32.master_weights, m16.master_weights),
        (0, m32.parameters),
        "{what}: f32 masters"
    );
    assert_eq!(
        m16.optimizer_state, m32.optimizer_state,
        "{what}: AdamW's moments stay f32"
    );
    for (name, t) in &bf16_run.outcome.params {
        assert_eq!(t.dtype(), DType::F32, "{what}: final weight '{name}' is the f32 master");
    }
}

#[test]
fn the_mlp_in_bf16_tracks_f32() {
    bf16_tracks_f32(mlp, 40, 16, "mlp");
}

#[test]
fn the_gpt_in_bf16_tracks_f32() {
    bf16_tracks_f32(gpt, 60, 4, "gpt");
}

#[test]
fn a_bf16_checkpoint_holds_f32_masters_and_resumes_bit_for_bit() {
    let dir = tmp("resume");
    let (straight, half) = (dir.join("straight.safetensors"), dir.join("half.safetensors"));
    let r4 = gpt(&writing(config(4, 4, DType::BF16), &straight)).unwrap();
    gpt(&writing(config(2, 4, DType::BF16), &half)).unwrap();
    let (tensors, _) = load_safetensors_with_metadata(&half).unwrap();
    let model: Vec<_> = tensors.iter().filter(|(n, _)| n.starts_with("model.")).collect();
    assert!(
        !model.is_empty() && model.iter().all(|(_, t)| t.dtype() == DType::F32),
        "the model saved is f32"
    );
    let resumed = gpt(&resuming(config(4, 4, DType::BF16), &half)).unwrap();
    assert_eq!(resumed.outcome.losses(), r4.outcome.losses()[2..].to_vec());
    let bits = |r: &RunReport| -> Vec<Vec<u32>> {
        r.outcome
            .params
            .iter()
            .map(|(_, t)| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    assert_eq!(
        bits(&resumed),
        bits(&r4),
        "the masters after 2 + 2 steps are those after 4"
    );
    // and the bf16 checkpoint starts an f32 run (what --init and `brigade sample` read)
    let f32_from_it = gpt(&resuming(config(4, 4, DType::F32), &half)).unwrap();
    assert_eq!(f32_from_it.outcome.losses().len(), 2);
}

/// An fp16 MLP whose scale doubles every 2 clean steps until the scaled gradients overflow
/// fp16: steps are skipped and the scale backs off.
fn fp16_config(steps: usize) -> TrainConfig {
    let mut c = config(steps, 16, DType::F16);
    c.recipe.loss_scale_growth_interval = 2;
    c
}

#[test]
fn fp16_skips_backs_off_and_grows_as_the_scaler_says_and_resumes_bit_for_bit() {
    let r = mlp(&fp16_config(40)).unwrap();
    let steps = &r.outcome.steps;
    // replay the recorded verdicts through the rule: 2^16 at first, x0.5 on a skip, x2 after
    // 2 clean steps in a row
    let (mut scale, mut clean) = (65536.0, 0);
    for s in steps {
        assert_eq!(s.scale, Some(scale), "step {}", s.step);
        if s.skipped {
            (scale, clean) = (scale * 0.5, 0);
        } else {
            clean += 1;
            if clean == 2 {
                (scale, clean) = (scale * 2.0, 0);
            }
        }
    }
    let skipped = r.outcome.skipped_steps();
    assert!(
        skipped > 0 && skipped < steps.len() / 2,
        "{skipped} of {} steps skipped",
        steps.len()
    );
    let f32_run = mlp(&config(40, 16, DType::F32)).unwrap();
    assert!(last(&r) < 0.8 * r.outcome.losses()[0], "fp16 learns despite its skips");
    assert!(last(&f32_run).is_finite());

    // the scale and its counter travel in the checkpoint: 3 + resume + 3 is 6 straight
    let dir = tmp("fp16");
    let half = dir.join("half.safetensors");
    let r6 = mlp(&fp16_config(6)).unwrap();
    mlp(&writing(fp16_config(3), &half)).unwrap();
    let resumed = mlp(&resuming(fp16_config(6), &half)).unwrap();
    let tail = |r: &RunReport| -> Vec<(u64, Option<f64>, bool)> {
        r.outcome
            .steps
            .iter()
            .map(|s| (s.loss.to_bits(), s.scale, s.skipped))
            .collect()
    };
    assert_eq!(tail(&resumed), tail(&r6)[3..].to_vec());
    let bits = |r: &RunReport| -> Vec<Vec<u32>> {
        r.outcome
            .params
            .iter()
            .map(|(_, t)| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    assert_eq!(bits(&resumed), bits(&r6));
}

#[test]
fn combinations_not_built_are_refused_in_one_line() {
    let mut c = config(2, 8, DType::BF16);
    c.recipe.precision.reduce_dtype = DType::F32;
    let e = mlp(&c).err().expect("refused").to_string();
    assert!(e.contains("reducing in f32") && !e.contains('\n'), "{e}");
    c.recipe.precision.reduce_dtype = DType::BF16;
    for (spec, says) in [
        ("bf16", "round bf16 gradients again"),
        ("zero2", "does not take 16-bit buckets"),
    ] {
        c.distributed.as_mut().unwrap().policy = std::sync::Arc::new(spec.parse::<PolicySpec>().unwrap());
        let e = mlp(&c).err().expect("refused").to_string();
        assert!(e.contains(says) && !e.contains('\n'), "{spec}: {e}");
    }
}
