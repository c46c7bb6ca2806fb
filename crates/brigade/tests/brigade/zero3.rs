//! ZeRO-3 through `fit` on the GPT (units: `embed`, `blocks.{i}`, `head`): plain DDP's
//! training bit for bit (SGD and AdamW, two and three ranks, microbatches, dropout), clipping
//! within rounding, the memory report's shards and gathered units, a checkpoint of the whole
//! f32 model that loads as a state dict and resumes bit for bit, the counting fake device as
//! the CPU, and the join mode refused.

use std::sync::Arc;

use brigade::config::CheckpointConfig;
use brigade::launch::LaunchConfig;
use brigade::models::{load_safetensors_with_metadata, Dataset, Gpt, GptConfig, Model};
use brigade::policies::PolicySpec;
use brigade::tensor::DType;
use brigade::{fit, Error, OptimizerConfig, RunReport, TrainConfig};

use crate::common::{self, resuming};

fn gpt() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 16,
        n_layers: 2,
        n_heads: 2,
        d_ff: 32,
        context: 8,
        dtype: DType::F32,
        dropout: 0.1,
    }
}

fn config(steps: usize, optimizer: &str, policy: PolicySpec) -> TrainConfig {
    let opt = match optimizer {
        "sgd" => OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 1e-3,
        },
        _ => OptimizerConfig::AdamW {
            lr: 3e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        },
    };
    let mut c = TrainConfig::new(steps, 2, opt);
    c.model.name = "gpt".into();
    c.data.accum = 2;
    c.runtime.compute_threads = Some(1);
    c.distributed.get_or_insert_default().policy = Arc::new(policy);
    c
}

fn run(world: usize, cfg: &TrainConfig) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(world),
        cfg,
        |_| Dataset::builtin_text(8, 0).map_err(Error::from),
        // a different seed per rank: DDP starts every rank from rank 0's parameters, and the
        // dropout generators differ
        |ctx| Ok(Box::new(Gpt::new(gpt(), 7 + ctx.rank as u64)?) as Box<dyn Model>),
    )
}

/// Rank 0's final parameters, as bits.
fn bits(r: &RunReport) -> Vec<(String, Vec<u32>)> {
    r.outcome
        .params
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

#[test]
fn zero_3_trains_the_gpt_as_plain_ddp_does_bit_for_bit() {
    for optimizer in ["sgd", "adamw"] {
        for world in [2, 3] {
            let plain = run(world, &config(3, optimizer, PolicySpec::AllReduce)).unwrap();
            let z3 = run(world, &config(3, optimizer, PolicySpec::Zero3)).unwrap();
            let what = format!("{optimizer} world {world}");
            assert_eq!(z3.outcome.losses(), plain.outcome.losses(), "{what}");
            assert_eq!(bits(&z3), bits(&plain), "{what}");
            assert_eq!(bits(&z3).len(), Gpt::new(gpt(), 0).unwrap().params().len(), "{what}");
            let (m3, m) = (z3.outcome.memory.unwrap(), plain.outcome.memory.unwrap());
            // the parameters held between steps are this rank's shards (about a world-th)
            assert!(
                m3.parameters * world <= m.parameters + 64 * world,
                "{what}: {m3:?} vs {m:?}"
            );
            // a unit and the next, prefetched: at most `embed` (256 x 16 tokens, 8 x 16
            // positions) and block 0 (2 norms of 2 x 16, 16 x 48 + 48, 16 x 16 + 16, 16 x 32 +
            // 32, 32 x 16 + 16)
            let block = 4 * 16 + (16 * 48 + 48) + (16 * 16 + 16) + (16 * 32 + 32) + (32 * 16 + 16);
            assert_eq!(m3.gathered, 4 * (256 * 16 + 8 * 16 + block), "{what}: {m3:?}");
            assert_eq!(m.gathered, 0, "{what}");
            assert!(m3.total() < m.total(), "{what}: {m3:?} vs {m:?}");
        }
    }
}

#[test]
fn zero_3_clips_within_rounding_of_plain_ddp() {
    let clipped = |p: PolicySpec| {
        let mut c = config(3, "sgd", p);
        c.recipe.clip_grad_norm = Some(0.05);
        run(2, &c).unwrap()
    };
    let (z3, plain) = (clipped(PolicySpec::Zero3), clipped(PolicySpec::AllReduce));
    for (a, b) in z3.outcome.grad_norms().iter().zip(plain.outcome.grad_norms()) {
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(a > 0.05 && (a - b).abs() <= 1e-6 * b, "{a} vs {b}");
    }
    for ((n, a), (_, b)) in z3.outcome.params.iter().zip(&plain.outcome.params) {
        let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-6, "{n}: {worst}");
    }
}

#[test]
fn a_zero_3_checkpoint_is_the_whole_f32_model_and_resumes_bit_for_bit() {
    let dir = common::tmp("zero3", "checkpoint");
    let (half, straight) = (dir.join("half.safetensors"), dir.join("straight.safetensors"));
    let writing = |cfg: TrainConfig, path: &std::path::Path| {
        let mut c = cfg;
        c.runtime.checkpoint = CheckpointConfig {
            path: Some(path.to_path_buf()),
            ..CheckpointConfig::default()
        };
        c
    };
    let four = run(2, &writing(config(4, "adamw", PolicySpec::Zero3), &straight)).unwrap();
    run(2, &writing(config(2, "adamw", PolicySpec::Zero3), &half)).unwrap();
    let resumed = {
        let mut c = resuming(config(4, "adamw", PolicySpec::Zero3), &half);
        c.runtime.checkpoint.path = None;
        run(2, &c).unwrap()
    };
    assert_eq!(bits(&resumed), bits(&four), "2 + resume + 2 steps vs 4");
    assert_eq!(resumed.outcome.losses(), four.outcome.losses()[2..]);
    // the file holds every parameter whole, in f32, as rank 0 holds it after the run
    let (tensors, meta) = load_safetensors_with_metadata(&straight).unwrap();
    assert_eq!(meta.get("zero").map(String::as_str), Some("3"));
    for (name, t) in &four.outcome.params {
        let saved = tensors
            .iter()
            .find(|(n, _)| *n == format!("model.{name}"))
            .map(|(_, t)| t.clone())
            .unwrap_or_else(|| panic!("model.{name} missing"));
        assert_eq!(saved.dtype(), DType::F32);
        assert_eq!(saved.shape(), t.shape(), "{name}");
        assert_eq!(saved.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap(), "{name}");
    }
    // and it loads as the model's state dict (what --init and `brigade sample` read)
    let g = Gpt::new(gpt(), 99).unwrap();
    brigade::models::load_params(g.params(), &straight).unwrap();
    for (p, (_, t)) in g.params().params().iter().zip(&four.outcome.params) {
        assert_eq!(p.value().to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    }
}

#[test]
fn zero_3_with_a_join_mode_is_one_error_before_step_0() {
    let mut c = config(2, "sgd", PolicySpec::Zero3);
    c.data.join = Some(brigade::join::JoinMode::DivideInitial);
    let Err(e) = run(2, &c) else {
        panic!("zero3 with a join mode ran")
    };
    let e = e.to_string();
    assert!(e.contains("zero3 does not combine with a join mode"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
}

#[test]
fn zero_3_on_the_counting_fake_device_trains_as_on_the_cpu() {
    use brigade::placement::DevicePlacement;
    use brigade::tensor::fake;
    // fake device 230: an ordinal no other test of this binary counts on
    let on = |device: Option<usize>| {
        let mut c = config(3, "adamw", PolicySpec::Zero3);
        if let Some(o) = device {
            c.runtime.device = DevicePlacement::Fake(o);
            fake::reset(o);
        }
        run(2, &c).unwrap()
    };
    let (fake_run, cpu) = (on(Some(230)), on(None));
    assert_eq!(fake_run.outcome.losses(), cpu.outcome.losses());
    assert_eq!(bits(&fake_run), bits(&cpu));
    assert!(fake::counts(230).to_host > 0, "the run was on the fake device");
}

/// A checkpoint written under ZeRO-1, 2 or 3 on two ranks resumes on three: the optimizer state
/// and the parameters are saved whole and cut again for the new world, so the resumed run is
/// plain DDP's same resume bit for bit (ZeRO equals plain DDP at each world size).
#[test]
fn a_zero_checkpoint_resumes_on_another_world_size_as_plain_ddp_does() {
    let dir = common::tmp("zero3", "reshard");
    // one seed on every rank and no dropout: generators in different states would tie the
    // checkpoint to two ranks
    let run_plain = |world: usize, cfg: &TrainConfig| {
        fit(
            &LaunchConfig::threads(world),
            cfg,
            |_| Dataset::builtin_text(8, 0).map_err(Error::from),
            |_| {
                let c = GptConfig { dropout: 0.0, ..gpt() };
                Ok(Box::new(Gpt::new(c, 7)?) as Box<dyn Model>)
            },
        )
    };
    let two_then_three = |policy: PolicySpec| {
        let path = dir.join(format!("{policy}.safetensors"));
        // 3 rows a rank on 2 ranks, then 2 on 3: 6 rows a microbatch over the ranks both times,
        // so the resume reads on from the row the first run reached
        let mut first = config(2, "adamw", policy.clone());
        first.data.batch_size = 3;
        first.runtime.checkpoint = CheckpointConfig {
            path: Some(path.clone()),
            ..CheckpointConfig::default()
        };
        run_plain(2, &first).unwrap();
        let mut then = resuming(config(4, "adamw", policy), &path);
        then.runtime.checkpoint.path = None;
        then.data.batch_size = 2;
        run_plain(3, &then).unwrap()
    };
    let plain = two_then_three(PolicySpec::AllReduce);
    for policy in [PolicySpec::Zero1, PolicySpec::Zero2, PolicySpec::Zero3] {
        let resharded = two_then_three(policy.clone());
        assert_eq!(resharded.outcome.losses(), plain.outcome.losses(), "{policy}: losses");
        assert_eq!(bits(&resharded), bits(&plain), "{policy}: parameters");
    }
}

#[test]
fn the_memory_report_holds_the_runs_peak_split_into_what_held_it() {
    let peak_of = |steps: usize| {
        let mut c = config(steps, "adamw", PolicySpec::Zero3);
        c.data.accum = 1;
        let model = GptConfig {
            d_model: 64,
            n_layers: 4,
            d_ff: 128,
            context: 16,
            dropout: 0.0,
            ..gpt()
        };
        let r = fit(
            &LaunchConfig::threads(2),
            &c,
            |_| Dataset::builtin_text(16, 0).map_err(Error::from),
            |_| Ok(Box::new(Gpt::new(model.clone(), 7)?) as Box<dyn Model>),
        )
        .unwrap();
        r.outcome.memory.unwrap()
    };
    let (one, three) = (peak_of(1), peak_of(3));
    // the three steps' run holds its first step: its peak is no lower than the one step's (up to
    // the timing of what the comm stream's thread makes), whichever step is the higher (the
    // first starts from the whole model)
    assert!(
        three.peak as f64 >= 0.995 * one.peak as f64,
        "three steps peak at {} bytes, their first alone at {}",
        three.peak,
        one.peak
    );
    assert!(three.peak >= three.last_step_peak, "{three:?}");
    // the parts add up to the peak (up to what the comm stream's thread made or freed at its
    // moment), and the model's state is named
    let parts = three.peak_parts;
    assert!(
        (parts.total() as f64 - three.peak as f64).abs() <= 0.01 * three.peak as f64,
        "{parts:?} against {}",
        three.peak
    );
    assert!(parts.parameters > 0 && parts.activations > 0, "{parts:?}");
    assert!(three.construction_peak > 0, "{three:?}");
    assert!(parts.other < three.peak / 4, "{parts:?}");
}
