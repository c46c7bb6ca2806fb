//! ZeRO-3 resumed from a checkpoint by shards: each rank reads only its ranges of the
//! parameters and of the optimizer state (AdamW's moments, SGD's momentum) from the file, so
//! the resumed run is the uninterrupted one bit for bit (two and three ranks, and on another
//! number of ranks than wrote it), its construction peaks within its shards and its run no
//! higher than the uninterrupted run, and a truncated, corrupt or non-finite checkpoint is one
//! error line on every rank.

use std::path::Path;
use std::sync::Arc;

use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Gpt, GptConfig, Model};
use brigade::policies::PolicySpec;
use brigade::tensor::DType;
use brigade::{fit, Error, OptimizerConfig, RunReport, TrainConfig};

use crate::common::{self, resuming, writing};

fn gpt(n_layers: usize) -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 16,
        n_layers,
        n_heads: 2,
        d_ff: 32,
        context: 8,
        dtype: DType::F32,
        dropout: 0.0,
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
    c.runtime.compute_threads = Some(1);
    c.distributed.get_or_insert_default().policy = Arc::new(policy);
    c
}

fn run(world: usize, n_layers: usize, cfg: &TrainConfig) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(world),
        cfg,
        |_| Dataset::builtin_text(8, 0).map_err(Error::from),
        |ctx| Ok(Box::new(Gpt::new(gpt(n_layers), 7 + ctx.rank as u64)?) as Box<dyn Model>),
    )
}

fn bits(r: &RunReport) -> Vec<(String, Vec<u32>)> {
    (r.outcome.params.iter())
        .map(|(n, t)| {
            (
                n.clone(),
                t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

/// `steps` steps resumed from `path` on `world` ranks, writing no checkpoint.
fn resume(world: usize, n_layers: usize, cfg: TrainConfig, path: &Path) -> brigade::Result<RunReport> {
    let mut c = resuming(cfg, path);
    c.runtime.checkpoint.path = None;
    run(world, n_layers, &c)
}

#[test]
fn a_zero_3_resume_by_shards_is_the_uninterrupted_run_bit_for_bit() {
    let dir = common::tmp("zero3_resume_shards", "parity");
    for optimizer in ["adamw", "sgd"] {
        for world in [2, 3] {
            let what = format!("{optimizer} world {world}");
            let half = dir.join(format!("{optimizer}-{world}.safetensors"));
            let straight = run(world, 2, &config(4, optimizer, PolicySpec::Zero3)).unwrap();
            run(world, 2, &writing(config(2, optimizer, PolicySpec::Zero3), &half)).unwrap();
            let resumed = resume(world, 2, config(4, optimizer, PolicySpec::Zero3), &half).unwrap();
            assert_eq!(resumed.outcome.losses(), straight.outcome.losses()[2..], "{what}");
            assert_eq!(bits(&resumed), bits(&straight), "{what}");
        }
    }
    // ZeRO++'s options: qgZ's rounding state is the policy's, per rank, read whole
    let both = PolicySpec::Zero3Quantized(brigade::policies::ZeroPlusPlus { qwz: true, qgz: true });
    let half = dir.join("zeropp.safetensors");
    let straight = run(2, 2, &config(4, "adamw", both.clone())).unwrap();
    run(2, 2, &writing(config(2, "adamw", both.clone()), &half)).unwrap();
    let resumed = resume(2, 2, config(4, "adamw", both), &half).unwrap();
    assert_eq!(resumed.outcome.losses(), straight.outcome.losses()[2..], "zero++");
    assert_eq!(bits(&resumed), bits(&straight), "zero++");
}

#[test]
fn a_zero_3_checkpoint_resumes_by_shards_on_another_world_size_as_plain_ddp_does() {
    let dir = common::tmp("zero3_resume_shards", "reshard");
    // 3 rows a rank on 2 ranks, then 2 on 3: the resume reads on from the row the first reached
    let two_then_three = |policy: PolicySpec| {
        let path = dir.join(format!("{policy}.safetensors"));
        let mut first = writing(config(2, "adamw", policy.clone()), &path);
        first.data.batch_size = 3;
        let run_one_seed = |world: usize, cfg: &TrainConfig| {
            fit(
                &LaunchConfig::threads(world),
                cfg,
                |_| Dataset::builtin_text(8, 0).map_err(Error::from),
                |_| Ok(Box::new(Gpt::new(gpt(2), 7)?) as Box<dyn Model>),
            )
        };
        run_one_seed(2, &first).unwrap();
        let mut then = resuming(config(4, "adamw", policy), &path);
        then.runtime.checkpoint.path = None;
        then.data.batch_size = 2;
        run_one_seed(3, &then).unwrap()
    };
    let plain = two_then_three(PolicySpec::AllReduce);
    let z3 = two_then_three(PolicySpec::Zero3);
    assert_eq!(z3.outcome.losses(), plain.outcome.losses());
    assert_eq!(bits(&z3), bits(&plain));
}

#[test]
fn a_zero_3_resume_builds_within_its_shards_and_peaks_no_higher_than_the_uninterrupted_run() {
    // as a sharded start: the shards (Ψ/N), AdamW's two moments of them (2Ψ/N) and a quarter
    // of Ψ for the rest; the whole model (Ψ) alone is more than that at world 4, and the whole
    // model with its whole moments (3Ψ) three times more
    let (world, n_layers) = (4, 4);
    let dir = common::tmp("zero3_resume_shards", "peak");
    let path = dir.join("half.safetensors");
    run(world, n_layers, &writing(config(2, "adamw", PolicySpec::Zero3), &path)).unwrap();
    let psi = 4 * Gpt::new(gpt(n_layers), 0).unwrap().params().numel();
    let straight = run(world, n_layers, &config(3, "adamw", PolicySpec::Zero3))
        .unwrap()
        .outcome
        .memory
        .unwrap();
    // the whole load (what a run that takes non-finite values still does) passes both bounds
    let mut whole = config(3, "adamw", PolicySpec::Zero3);
    whole.recipe.allow_nonfinite = true;
    let w = resume(world, n_layers, whole, &path).unwrap().outcome.memory.unwrap();
    let m = resume(world, n_layers, config(3, "adamw", PolicySpec::Zero3), &path)
        .unwrap()
        .outcome
        .memory
        .unwrap();
    let bound = psi / world + 2 * psi / world + psi / 4;
    eprintln!(
        "resume: construction {} peak {} (whole load {} {}; uninterrupted peak {}) bound {bound} psi {psi}",
        m.construction_peak, m.peak, w.construction_peak, w.peak, straight.peak
    );
    assert!(w.construction_peak > bound && w.peak > straight.peak, "{w:?}");
    assert!(
        m.construction_peak <= bound,
        "resumed at {} bytes > {bound} (psi {psi})",
        m.construction_peak
    );
    // its first step gathers each unit as every later one does: the resumed run's peak is
    // no higher than the uninterrupted run's
    assert!(
        m.peak <= straight.peak,
        "the resumed run peaks at {} bytes, the uninterrupted one at {}",
        m.peak,
        straight.peak
    );
}

#[test]
fn a_truncated_or_corrupt_checkpoint_is_one_error_line_under_zero_3() {
    let dir = common::tmp("zero3_resume_shards", "bad");
    let path = dir.join("half.safetensors");
    run(2, 2, &writing(config(2, "adamw", PolicySpec::Zero3), &path)).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a checkpoint at all").unwrap();
    for bad in [&truncated, &garbage] {
        let e = resume(2, 2, config(4, "adamw", PolicySpec::Zero3), bad)
            .err()
            .expect("refused")
            .to_string();
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.contains(&*bad.file_name().unwrap().to_string_lossy()), "{e}");
    }
}

#[test]
fn a_nan_in_one_rank_s_range_of_the_checkpoint_stops_every_rank_with_one_error_line() {
    // each element of a parameter lies in one rank's shard: only that rank reads it, and the
    // others must stop with it rather than wait for it at the next collective
    let dir = common::tmp("zero3_resume_shards", "nan");
    let path = dir.join("half.safetensors");
    run(2, 2, &writing(config(2, "adamw", PolicySpec::Zero3), &path)).unwrap();
    let (stored, _) = brigade::models::stored_tensors(&path).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // an element near a tensor's start and one at its end: held by different ranks
    for (name, first) in [
        ("model.blocks.1.mlp.fc.weight", true),
        ("optim.blocks.0.attn.qkv.weight.exp_avg", false),
    ] {
        let t = stored
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("{name}"));
        let numel: usize = t.shape.iter().product();
        let at = t.offset as usize + 4 * if first { 5 } else { numel - 1 };
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let bad = dir.join("nan.safetensors");
        std::fs::write(&bad, &bytes).unwrap();
        let e = resume(2, 2, config(4, "adamw", PolicySpec::Zero3), &bad)
            .err()
            .expect("refused")
            .to_string();
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.contains("NaN") && e.contains("nan.safetensors"), "{name}: {e}");
        // the tensor is named: a parameter as the whole read names it (the checkpoint's
        // tensor, its multi-index), or the optimizer state's entry
        let named = match first {
            true => format!("tensor '{name}' holds NaN at index [0, 5]"),
            false => format!("'{}'", name.split_once('.').unwrap().1),
        };
        assert!(e.contains(&named), "{name}: {e}");
        eprintln!("{name}: {e}");
        bytes = std::fs::read(&path).unwrap();
    }
}
