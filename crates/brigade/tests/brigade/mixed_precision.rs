//! `fit` under `--precision bf16`: the MLP and the GPT train to within 2% of the f32 run's
//! final loss from the same initial weights and data; the buckets hold bf16 (half the bytes)
//! and f32 master weights sit beside the bf16 parameters; the final weights and the checkpoint
//! are the f32 masters, and 2 steps + resume + 2 steps are 4 straight steps bit for bit;
//! fp16's loss scale skips, backs off and grows as GradScaler's rule says, and resumes
//! with the run; ZeRO-1/2 keep f32 master shards and follow the bf16 all-reduce (their
//! checkpoints resume on another world size), the compression policies and PowerSGD train under
//! bf16, `reduce_dtype` f32 reduces closer to the f32 run, every rank starts from rank 0's
//! masters; combinations not built are refused in one line.

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

pub(crate) fn config(steps: usize, batch: usize, precision: DType) -> TrainConfig {
    let mut c = TrainConfig::new(steps, batch, adamw());
    c.runtime.compute_threads = Some(1);
    c.recipe.precision = MixedPrecision::uniform(precision);
    c
}

pub(crate) fn mlp(cfg: &TrainConfig) -> brigade::Result<RunReport> {
    let mut cfg = cfg.clone();
    cfg.model.name = "mlp".into();
    fit(
        &LaunchConfig::threads(2),
        &cfg,
        |_| Dataset::teacher(1024, 16, 4, 3).map_err(Into::into),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 64, 4]), 1)?) as Box<dyn Model>),
    )
}

pub(crate) fn gpt(cfg: &TrainConfig) -> brigade::Result<RunReport> {
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

fn tmp(name: &str) -> common::Scratch {
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
pub(crate) fn fp16_config(steps: usize) -> TrainConfig {
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
    for (spec, says) in [
        ("bf16", "defeats recipe.precision.reduce_dtype f32"),
        ("fp16", "defeats recipe.precision.reduce_dtype f32"),
    ] {
        c.distributed.as_mut().unwrap().policy = std::sync::Arc::new(spec.parse::<PolicySpec>().unwrap());
        let e = mlp(&c).err().expect("refused").to_string();
        assert!(e.contains(says) && !e.contains('\n'), "{spec}: {e}");
    }
}

/// The small GPT on `world` ranks under `policy` (one seed on every rank, no dropout).
fn gpt_under(world: usize, cfg: &TrainConfig, policy: PolicySpec) -> brigade::Result<RunReport> {
    let mut cfg = cfg.clone();
    cfg.model.name = "gpt".into();
    cfg.distributed.as_mut().unwrap().policy = std::sync::Arc::new(policy);
    fit(
        &LaunchConfig::threads(world),
        &cfg,
        |_| Dataset::builtin_text(16, 0).map_err(Error::from),
        |_| Ok(Box::new(Gpt::new(crate::fake_device::small_gpt(), 0)?) as Box<dyn Model>),
    )
}

fn master_bits(r: &RunReport) -> Vec<(String, Vec<u32>)> {
    r.outcome
        .params
        .iter()
        .map(|(n, t)| {
            assert_eq!(t.dtype(), DType::F32, "'{n}' is an f32 master");
            (
                n.clone(),
                t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

/// Largest relative difference of two loss curves.
pub(crate) fn worst_relative(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs())
        .fold(0.0, f64::max)
}

/// ZeRO-1 and ZeRO-2 beside bf16 parameters: each rank steps its f32 master shard from the
/// reduce-scattered bf16 gradients and gathers the rounded bf16 compute copy, so they follow the
/// bf16 all-reduce run (the same f32 master arithmetic; only the reduction's rounding may
/// differ); the masters kept are Ψ·4/N bytes (a shard's padding aside), and the final weights
/// are the whole f32 masters.
#[test]
fn zero1_and_zero2_in_bf16_follow_the_bf16_all_reduce_with_master_shards() {
    let cfg = config(12, 4, DType::BF16);
    let plain = gpt_under(2, &cfg, PolicySpec::AllReduce).unwrap();
    let psi: usize = plain.outcome.params.iter().map(|(_, t)| t.numel()).sum();
    let plain_mem = plain.outcome.memory.unwrap();
    assert_eq!(plain_mem.master_weights, psi * 4, "allreduce: whole f32 masters");
    for policy in [PolicySpec::Zero1, PolicySpec::Zero2] {
        let zero = gpt_under(2, &cfg, policy.clone()).unwrap();
        let worst = worst_relative(&plain.outcome.losses(), &zero.outcome.losses());
        eprintln!("{policy}: worst relative loss difference {worst:e}");
        assert!(
            worst < 1e-3,
            "{policy}: losses {:?} vs {:?}",
            zero.outcome.losses(),
            plain.outcome.losses()
        );
        let m = zero.outcome.memory.unwrap();
        let buckets = zero.outcome.buckets.len();
        assert!(
            m.master_weights >= psi * 4 / 2 && m.master_weights <= psi * 4 / 2 + 4 * buckets,
            "{policy}: master shards {} bytes, Ψ·4/2 = {}",
            m.master_weights,
            psi * 4 / 2
        );
        assert_eq!(
            m.parameters, plain_mem.parameters,
            "{policy}: the bf16 compute copy, whole"
        );
        let (a, b) = (master_bits(&plain), master_bits(&zero));
        assert_eq!(
            a.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            b.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            "{policy}: the masters of every parameter"
        );
        let worst_weight = plain
            .outcome
            .params
            .iter()
            .zip(&zero.outcome.params)
            .flat_map(|((_, x), (_, y))| {
                let (x, y) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
                x.into_iter().zip(y).map(|(x, y)| (x - y).abs()).collect::<Vec<_>>()
            })
            .fold(0.0f32, f32::max);
        eprintln!("{policy}: worst master difference {worst_weight:e}");
        assert!(worst_weight < 1e-3, "{policy}: masters differ by {worst_weight}");
    }
}

/// A bf16 ZeRO checkpoint holds the whole f32 masters, and resumes on another world size as
/// the bf16 all-reduce checkpoint does: 2 steps on 2 ranks, then 2 more on 3 (6 rows a rank,
/// then 4: 12 rows a step both times, so the resume reads on from the row the first run reached).
#[test]
fn a_bf16_zero_checkpoint_holds_whole_f32_masters_and_resumes_on_three_ranks() {
    let dir = tmp("zero-reshard");
    let two_then_three = |policy: PolicySpec| {
        let path = dir.join(format!("{policy}.safetensors"));
        gpt_under(2, &writing(config(2, 6, DType::BF16), &path), policy.clone()).unwrap();
        let (tensors, _) = load_safetensors_with_metadata(&path).unwrap();
        let model: Vec<_> = tensors.iter().filter(|(n, _)| n.starts_with("model.")).collect();
        assert!(
            !model.is_empty() && model.iter().all(|(_, t)| t.dtype() == DType::F32),
            "{policy}: the model saved is f32"
        );
        let saved: Vec<(String, Vec<u32>)> = model
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(),
                )
            })
            .collect();
        (
            saved,
            gpt_under(3, &resuming(config(4, 4, DType::BF16), &path), policy).unwrap(),
        )
    };
    let (plain_saved, plain) = two_then_three(PolicySpec::AllReduce);
    for policy in [PolicySpec::Zero1, PolicySpec::Zero2] {
        let (saved, resharded) = two_then_three(policy.clone());
        assert_eq!(
            saved.iter().map(|(n, t)| (n, t.len())).collect::<Vec<_>>(),
            plain_saved.iter().map(|(n, t)| (n, t.len())).collect::<Vec<_>>(),
            "{policy}: every master whole"
        );
        assert_eq!(resharded.outcome.losses().len(), 2);
        let worst = worst_relative(&plain.outcome.losses(), &resharded.outcome.losses());
        eprintln!("{policy}: resumed on 3, worst relative loss difference {worst:e}");
        assert!(
            worst < 1e-3,
            "{policy}: resumed losses {:?} vs {:?}",
            resharded.outcome.losses(),
            plain.outcome.losses()
        );
        master_bits(&resharded);
    }
}

/// The compression policies and PowerSGD beside bf16 parameters, on 2 ranks: bf16 compression
/// changes no bytes (each share is rounded to bf16 once, the sum accumulated in f32), fp16
/// compression casts the bf16 gradients to fp16 (exact within its range), PowerSGD computes its
/// factors and error feedback in f32 from the bf16 gradients (compressing from step 2). Each
/// trains as the bf16 all-reduce run does, within its own compression's error.
#[test]
fn compression_and_powersgd_in_bf16_train_as_the_all_reduce_does() {
    let cfg = config(20, 4, DType::BF16);
    let plain = gpt_under(2, &cfg, PolicySpec::AllReduce).unwrap();
    let l = plain.outcome.losses();
    assert!(last(&plain) < 0.9 * l[0], "the bf16 all-reduce run learns: {l:?}");
    for (spec, tolerance) in [("bf16", 0.0), ("fp16", 0.01), ("powersgd:4@2", 0.05)] {
        let r = gpt_under(2, &cfg, spec.parse::<PolicySpec>().unwrap()).unwrap();
        let losses = r.outcome.losses();
        assert!(losses.iter().all(|x| x.is_finite()), "{spec}: {losses:?}");
        let worst = worst_relative(&l, &losses);
        eprintln!("{spec}: worst relative loss difference to the bf16 all-reduce {worst:e}");
        // bf16 on 2 ranks: each half of a bf16 gradient is exact in bf16, and the sum is rounded
        // once, as the all-reduce's average is: the same run
        assert!(worst <= tolerance, "{spec}: losses {losses:?} vs {l:?}");
        assert_eq!(
            r.outcome.memory.unwrap().buckets,
            plain.outcome.memory.unwrap().buckets,
            "{spec}: bf16 buckets"
        );
        if spec.starts_with("powersgd") {
            assert!(
                r.outcome.memory.unwrap().policy_state > 0,
                "powersgd compressed: its error feedback is kept"
            );
        }
    }
    // under fp16 bf16 compression is refused with its reason (fp16 compression and PowerSGD
    // train there: `mixed_policies`)
    let mut c = config(2, 8, DType::F16);
    c.distributed.as_mut().unwrap().policy = std::sync::Arc::new("bf16".parse::<PolicySpec>().unwrap());
    let e = mlp(&c).err().expect("refused").to_string();
    assert!(
        e.contains("no fewer bytes") && e.contains("mantissa") && !e.contains('\n'),
        "fp16 bf16: {e}"
    );
}

fn sgd_config(precision: DType, reduce: DType) -> TrainConfig {
    let mut c = config(1, 8, precision);
    c.recipe.optimizer = OptimizerConfig::Sgd {
        lr: 0.5,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    c.recipe.precision.reduce_dtype = reduce;
    // four microbatches accumulated in the bucket before it is reduced
    c.data.accum = 4;
    c
}

/// `--reduce-dtype f32` beside bf16 parameters: f32 buckets (the bf16 gradients widened as they
/// accumulate, the sum exact in f32), so one SGD step's masters (init − lr·averaged gradient)
/// lie closer to the f32 run's weights than those of the bf16 reduction do.
#[test]
fn reducing_bf16_gradients_in_f32_is_closer_to_the_f32_run() {
    let f32_run = mlp(&sgd_config(DType::F32, DType::F32)).unwrap();
    let in_bf16 = mlp(&sgd_config(DType::BF16, DType::BF16)).unwrap();
    let in_f32 = mlp(&sgd_config(DType::BF16, DType::F32)).unwrap();
    let distance = |r: &RunReport| -> f64 {
        f32_run
            .outcome
            .params
            .iter()
            .zip(&r.outcome.params)
            .flat_map(|((_, a), (_, b))| {
                let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
                a.into_iter()
                    .zip(b)
                    .map(|(a, b)| ((a - b) as f64).powi(2))
                    .collect::<Vec<_>>()
            })
            .sum::<f64>()
            .sqrt()
    };
    let (d16, d32) = (distance(&in_bf16), distance(&in_f32));
    eprintln!("distance to the f32 run's weights after one step: reduce bf16 {d16:e}, reduce f32 {d32:e}");
    assert!(d32 < d16, "reduce f32 {d32} is not closer than reduce bf16 {d16}");
    let (m16, m32, mf) = (
        in_bf16.outcome.memory.unwrap(),
        in_f32.outcome.memory.unwrap(),
        f32_run.outcome.memory.unwrap(),
    );
    assert_eq!((m32.buckets, m16.buckets * 2), (mf.buckets, mf.buckets), "f32 buckets");
    assert_eq!(m32.parameters, m16.parameters, "the compute copy stays bf16");
    // a narrower reduce dtype than the parameters' is refused in one line
    let e = mlp(&sgd_config(DType::F32, DType::BF16))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("recipe.precision.reduce_dtype bf16") && !e.contains('\n'),
        "{e}"
    );
}

/// Ranks that initialise differently start from rank 0's weights, masters included: a bf16 run
/// whose rank r is seeded r + 1 is the run whose every rank is seeded 1, bit for bit.
#[test]
fn every_rank_starts_from_rank_0s_masters() {
    let seeded = |per_rank: bool| {
        let mut cfg = config(3, 16, DType::BF16);
        cfg.model.name = "mlp".into();
        fit(
            &LaunchConfig::threads(2),
            &cfg,
            |_| Dataset::teacher(1024, 16, 4, 3).map_err(Into::into),
            move |ctx: &brigade::launch::RankContext| {
                let seed = if per_rank { ctx.rank as u64 + 1 } else { 1 };
                Ok(Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 64, 4]), seed)?) as Box<dyn Model>)
            },
        )
        .unwrap()
    };
    let (same, different) = (seeded(false), seeded(true));
    assert_eq!(different.outcome.losses(), same.outcome.losses());
    assert_eq!(master_bits(&different), master_bits(&same));
}

/// fp16 under ZeRO-1/2: the loss-scaled gradient shards are unscaled as they are widened onto
/// the f32 master shards, and the ranks agree on an inf/NaN in any shard before skipping: the
/// scale, its skips and the losses of 40 steps follow the fp16 all-reduce run's (bit for bit on
/// the thread backend, whose reduce-scatter rounds as its all-reduce does).
#[test]
fn fp16_under_zero1_and_zero2_skips_as_the_all_reduce_does() {
    let run = |policy: PolicySpec| {
        let mut c = fp16_config(40);
        c.distributed.as_mut().unwrap().policy = std::sync::Arc::new(policy);
        mlp(&c).unwrap()
    };
    let verdicts =
        |r: &RunReport| -> Vec<(Option<f64>, bool)> { r.outcome.steps.iter().map(|s| (s.scale, s.skipped)).collect() };
    let plain = run(PolicySpec::AllReduce);
    assert!(
        plain.outcome.skipped_steps() > 0,
        "the all-reduce run skips: {:?}",
        verdicts(&plain)
    );
    for policy in [PolicySpec::Zero1, PolicySpec::Zero2] {
        let zero = run(policy.clone());
        assert_eq!(verdicts(&zero), verdicts(&plain), "{policy}: scales and skips");
        let worst = worst_relative(&plain.outcome.losses(), &zero.outcome.losses());
        eprintln!("{policy}: fp16, worst relative loss difference {worst:e}");
        assert!(
            worst < 1e-3,
            "{policy}: {:?} vs {:?}",
            zero.outcome.losses(),
            plain.outcome.losses()
        );
        master_bits(&zero);
    }
}
