//! ZeRO-3 beside 16-bit parameters through `fit`: each rank's f32 shard is the master (no
//! second copy), the units are gathered in bf16 (half the gathered and sent bytes of f32) and
//! the gradients reduce-scattered in bf16, so bf16 ZeRO-3 is bf16 ZeRO-2 bit for bit (the MLP and
//! the GPT, 2 ranks, and 3 ranks whose units do not divide evenly); fp16 ZeRO-3's loss scale
//! grows, skips and backs off as fp16 ZeRO-2's, a skipped step leaving the shards as they were;
//! the checkpoint holds the whole f32 masters, loads as a state dict, and 2 + resume + 2 steps
//! are 4 bit for bit (bf16 and fp16).

use std::sync::Arc;

use crate::common::{self, resuming, writing};
use brigade::config::TrainConfig;
use brigade::launch::LaunchConfig;
use brigade::models::{load_params, load_safetensors, Dataset, Gpt, Mlp, MlpConfig, Model};
use brigade::policies::PolicySpec;
use brigade::tensor::DType;
use brigade::{fit, Error, MixedPrecision, OptimizerConfig, RunReport};

fn config(steps: usize, batch: usize, precision: DType, policy: PolicySpec) -> TrainConfig {
    let mut c = TrainConfig::new(
        steps,
        batch,
        OptimizerConfig::AdamW {
            lr: 3e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        },
    );
    c.runtime.compute_threads = Some(1);
    c.recipe.precision = MixedPrecision::uniform(precision);
    c.distributed.get_or_insert_default().policy = Arc::new(policy);
    c
}

/// fp16 on the MLP, its scale doubling every 2 clean steps until the scaled gradients overflow.
fn fp16(steps: usize, policy: PolicySpec) -> TrainConfig {
    let mut c = config(steps, 16, DType::F16, policy);
    c.recipe.loss_scale_growth_interval = 2;
    c
}

fn mlp_model() -> brigade::Result<Box<dyn Model>> {
    Ok(Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 64, 4]), 1)?))
}

fn gpt_model() -> brigade::Result<Box<dyn Model>> {
    Ok(Box::new(Gpt::new(crate::fake_device::small_gpt(), 0)?))
}

/// `model` (`mlp` or `gpt`, one seed on every rank) on `world` ranks under `cfg`.
fn run(model: &str, world: usize, cfg: &TrainConfig) -> RunReport {
    let mut cfg = cfg.clone();
    cfg.model.name = model.into();
    let launch = LaunchConfig::threads(world);
    match model {
        "mlp" => fit(
            &launch,
            &cfg,
            |_| Dataset::teacher(1024, 16, 4, 3).map_err(Into::into),
            |_| mlp_model(),
        ),
        _ => fit(
            &launch,
            &cfg,
            |_| Dataset::builtin_text(16, 0).map_err(Error::from),
            |_| gpt_model(),
        ),
    }
    .unwrap_or_else(|e| panic!("{model} on {world} ranks: {e}"))
}

/// Rank 0's final weights (each an f32 master), as bits.
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

fn loss_bits(r: &RunReport) -> Vec<u64> {
    r.outcome.losses().iter().map(|l| l.to_bits()).collect()
}

/// bf16 ZeRO-3 against bf16 ZeRO-2 at the same world size: the same arithmetic element by
/// element (the bf16 gradients averaged by the same reduce-scatter, widened to f32, the same
/// AdamW on the f32 master shard, the same rounding of the master to the bf16 compute copy;
/// only where it is rounded differs: ZeRO-2 rounds the shard and all-gathers it after the step,
/// ZeRO-3 before each use), so bit for bit. The masters are Ψ·4/N bytes once (a shard's padding
/// aside; no compute copy held between steps), and against f32 ZeRO-3 the gathered units and
/// every step's collective bytes are half.
#[test]
fn bf16_zero3_is_bf16_zero2_bit_for_bit_with_one_f32_master_shard() {
    for (model, world, steps) in [("mlp", 2, 4), ("gpt", 2, 3), ("gpt", 3, 2)] {
        let what = format!("{model} world {world}");
        let z2 = run(model, world, &config(steps, 4, DType::BF16, PolicySpec::Zero2));
        let z3 = run(model, world, &config(steps, 4, DType::BF16, PolicySpec::Zero3));
        assert_eq!(loss_bits(&z3), loss_bits(&z2), "{what}: losses");
        assert_eq!(master_bits(&z3), master_bits(&z2), "{what}: masters");
        let psi: usize = z3.outcome.params.iter().map(|(_, t)| t.numel()).sum();
        let units = z3.outcome.buckets.len();
        let m = z3.outcome.memory.unwrap();
        assert!(
            m.master_weights >= psi * 4 / world && m.master_weights <= psi * 4 / world + 4 * units,
            "{what}: master shards {} bytes, Ψ·4/{world} = {}",
            m.master_weights,
            psi * 4 / world
        );
        assert_eq!(
            m.parameters, 0,
            "{what}: the shard is counted once, as the masters: {m:?}"
        );
        assert!(m.total() < z2.outcome.memory.unwrap().total(), "{what}: {m:?}");
        if (model, world) == ("gpt", 2) {
            let f32_run = run(model, world, &config(steps, 4, DType::F32, PolicySpec::Zero3));
            let m32 = f32_run.outcome.memory.unwrap();
            assert_eq!(
                m.gathered * 2,
                m32.gathered,
                "{what}: units gathered in bf16: {m:?} vs {m32:?}"
            );
            assert_eq!(m32.master_weights, 0, "{what}: f32's shard is the parameter");
            let payload = |r: &RunReport| -> Vec<u64> { r.outcome.sent().iter().map(|s| s.payload_bytes).collect() };
            let (p16, p32) = (payload(&z3), payload(&f32_run));
            assert!(p16.iter().all(|&b| b > 0), "{what}: {p16:?}");
            // from step 1: the f32 run starts sharded, so its first forward gathers too, where
            // the bf16 run's (its masters made from the whole model) runs on the whole parameters
            assert_eq!(
                p16.iter().skip(1).map(|b| 2 * b).collect::<Vec<_>>(),
                p32[1..],
                "{what}: bf16 gathers and reduce-scatters send half the bytes"
            );
            assert!(2 * p16[0] < p32[0], "{what}: {p16:?} {p32:?}");
        }
    }
}

/// fp16 ZeRO-3 on the MLP against fp16 ZeRO-2: the same scales, growths, skips and losses bit
/// for bit over 40 steps (the ranks agree on an inf/NaN in any gradient shard); and a skipped
/// step leaves every master shard as it was (the run that ends on it holds the weights of the
/// run one step shorter).
#[test]
fn fp16_zero3_grows_skips_and_backs_off_as_fp16_zero2() {
    let verdicts =
        |r: &RunReport| -> Vec<(Option<f64>, bool)> { r.outcome.steps.iter().map(|s| (s.scale, s.skipped)).collect() };
    let z2 = run("mlp", 2, &fp16(40, PolicySpec::Zero2));
    let z3 = run("mlp", 2, &fp16(40, PolicySpec::Zero3));
    let v = verdicts(&z3);
    assert!(z3.outcome.skipped_steps() > 0, "some step is skipped: {v:?}");
    assert!(v.iter().any(|(s, _)| *s > Some(65536.0)), "the scale grows: {v:?}");
    assert_eq!(v, verdicts(&z2), "scales and skips");
    assert_eq!(loss_bits(&z3), loss_bits(&z2), "losses");
    assert_eq!(master_bits(&z3), master_bits(&z2), "masters");
    let skipped = z3.outcome.steps.iter().position(|s| s.skipped).expect("a skipped step");
    assert!(skipped > 0, "the first step is clean: {v:?}");
    let before = run("mlp", 2, &fp16(skipped, PolicySpec::Zero3));
    let through = run("mlp", 2, &fp16(skipped + 1, PolicySpec::Zero3));
    assert!(
        through.outcome.steps.last().unwrap().skipped,
        "step {skipped} is skipped again"
    );
    assert_eq!(
        master_bits(&through),
        master_bits(&before),
        "the skipped step {skipped} moved a master"
    );
}

/// The checkpoint of a 16-bit ZeRO-3 run holds every f32 master whole, loads into a fresh model
/// as its state dict (what `--init` and `brigade sample` read), and 2 steps + resume + 2 steps
/// are 4 straight steps bit for bit: bf16 on the GPT, fp16 (its scale and counter) on the MLP.
#[test]
fn a_16_bit_zero3_checkpoint_holds_the_whole_f32_masters_and_resumes_bit_for_bit() {
    let dir = common::tmp("zero3-mixed", "resume");
    let cases: [(&str, fn(usize) -> TrainConfig); 2] = [
        ("gpt", |steps| config(steps, 4, DType::BF16, PolicySpec::Zero3)),
        ("mlp", |steps| fp16(steps, PolicySpec::Zero3)),
    ];
    for (model, cfg) in cases {
        let (straight, half) = (
            dir.join(format!("{model}-4.safetensors")),
            dir.join(format!("{model}-2.safetensors")),
        );
        let four = run(model, 2, &writing(cfg(4), &straight));
        run(model, 2, &writing(cfg(2), &half));
        let resumed = run(model, 2, &resuming(cfg(4), &half));
        assert_eq!(loss_bits(&resumed), loss_bits(&four)[2..].to_vec(), "{model}: losses");
        assert_eq!(
            master_bits(&resumed),
            master_bits(&four),
            "{model}: masters after 2 + 2 steps"
        );
        let scales = |r: &RunReport| -> Vec<Option<f64>> { r.outcome.steps.iter().map(|s| s.scale).collect() };
        assert_eq!(scales(&resumed), scales(&four)[2..].to_vec(), "{model}: loss scales");
        let saved = load_safetensors(&straight).unwrap();
        for (name, bits) in master_bits(&four) {
            let t = saved
                .iter()
                .find(|(n, _)| *n == format!("model.{name}"))
                .map(|(_, t)| t)
                .unwrap_or_else(|| panic!("{model}: model.{name} missing"));
            assert_eq!(t.dtype(), DType::F32, "{model}: {name}");
            let got: Vec<u32> = t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, bits, "{model}: saved {name} is the final master");
        }
        let fresh = match model {
            "mlp" => Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 64, 4]), 9).unwrap()) as Box<dyn Model>,
            _ => Box::new(Gpt::new(crate::fake_device::small_gpt(), 9).unwrap()),
        };
        load_params(fresh.params(), &straight).unwrap();
        let loaded: Vec<Vec<u32>> = fresh
            .params()
            .params()
            .iter()
            .map(|p| p.value().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect();
        assert_eq!(
            loaded,
            master_bits(&four).into_iter().map(|(_, b)| b).collect::<Vec<_>>(),
            "{model}: loaded"
        );
    }
}
