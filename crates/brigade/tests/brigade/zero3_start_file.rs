//! ZeRO-3 started from a file (`model.init`): each rank reads only its shard's bytes of each
//! parameter, so the run trains bit for bit as plain DDP initialised from the same file does
//! (two and three ranks; a state dict in f32 and one in bf16, and a training checkpoint), its
//! construction peaks within the shards, and a file that does not fit the model is one error;
//! a NaN in one rank's range stops every rank at once with that rank's reason.

use std::path::Path;
use std::sync::Arc;

use brigade::launch::LaunchConfig;
use brigade::models::{save_safetensors, Dataset, Gpt, GptConfig, Model};
use brigade::policies::PolicySpec;
use brigade::tensor::DType;
use brigade::{fit, Error, OptimizerConfig, RunReport, TrainConfig};

use crate::common;

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

fn config(steps: usize, policy: PolicySpec, init: &Path) -> TrainConfig {
    let opt = OptimizerConfig::AdamW {
        lr: 3e-3,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let mut c = TrainConfig::new(steps, 2, opt);
    c.model.name = "gpt".into();
    c.model.init = Some(init.to_path_buf());
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

/// A model's parameters, as a state dict of `dtype` (`prefix` before each name).
fn write_init(path: &Path, n_layers: usize, dtype: DType, prefix: &str, format: Option<&str>) {
    let m = Gpt::new(gpt(n_layers), 99).unwrap();
    let tensors: Vec<(String, brigade::tensor::Tensor)> = (m.params().named_values().into_iter())
        .map(|(n, t)| (format!("{prefix}{n}"), t.to_dtype(dtype).unwrap()))
        .collect();
    let meta = format.map(|f| [("format".to_string(), f.to_string())].into_iter().collect());
    save_safetensors(path, &tensors, meta).unwrap();
}

fn psi_bytes(n_layers: usize) -> usize {
    4 * Gpt::new(gpt(n_layers), 0).unwrap().params().numel()
}

#[test]
fn zero_3_initialised_from_a_file_trains_as_plain_ddp_from_it_bit_for_bit() {
    let d = common::tmp("zero3_start_file", "parity");
    let files = [
        (d.join("f32.safetensors"), DType::F32, "", None),
        (d.join("bf16 state.safetensors"), DType::BF16, "", None),
        (
            d.join("checkpoint.safetensors"),
            DType::F32,
            "model.",
            Some(brigade::models::TRAINING_CHECKPOINT_FORMAT),
        ),
    ];
    for (path, dtype, prefix, format) in &files {
        write_init(path, 2, *dtype, prefix, *format);
    }
    for world in [2, 3] {
        for (path, dtype, ..) in &files {
            let plain = run(world, 2, &config(3, PolicySpec::AllReduce, path)).unwrap();
            let z3 = run(world, 2, &config(3, PolicySpec::Zero3, path)).unwrap();
            assert_eq!(z3.outcome.losses(), plain.outcome.losses(), "world {world} {dtype}");
            assert_eq!(bits(&z3), bits(&plain), "world {world} {dtype}");
        }
    }
}

#[test]
fn zero_3_initialised_from_a_file_builds_within_its_shards() {
    // as a sharded start from recipes: the shards (Ψ/N), AdamW's two moments of them (2Ψ/N)
    // and a quarter of Ψ for the rest; the whole model (Ψ) alone is more than that at world 4
    let (world, n_layers) = (4, 4);
    let d = common::tmp("zero3_start_file", "peak");
    let init = d.join("init.safetensors");
    write_init(&init, n_layers, DType::F32, "", None);
    let psi = psi_bytes(n_layers);
    let m = run(world, n_layers, &config(2, PolicySpec::Zero3, &init))
        .unwrap()
        .outcome
        .memory
        .unwrap();
    let bound = psi / world + 2 * psi / world + psi / 4;
    eprintln!(
        "construction {} peak {} bound {bound} psi {psi}",
        m.construction_peak, m.peak
    );
    assert!(
        m.construction_peak <= bound,
        "built at {} bytes > {bound} (psi {psi})",
        m.construction_peak
    );
}

#[test]
fn a_file_that_does_not_fit_the_model_is_one_error_under_zero_3() {
    let d = common::tmp("zero3_start_file", "mismatch");
    let init = d.join("small.safetensors");
    write_init(&init, 1, DType::F32, "", None);
    let e = run(2, 2, &config(1, PolicySpec::Zero3, &init))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("missing parameter") && e.contains("small.safetensors"),
        "{e}"
    );
}

#[test]
fn a_nan_in_one_ranks_range_of_the_file_stops_every_rank_at_once_with_its_reason() {
    let d = common::tmp("zero3_start_file", "nan");
    let init = d.join("nan.safetensors");
    let m = Gpt::new(gpt(2), 99).unwrap();
    // the head's last weight: the end of the last unit, in rank 1's shard of it
    let tensors: Vec<(String, brigade::tensor::Tensor)> = (m.params().named_values().into_iter())
        .map(|(n, t)| {
            let mut v = t.to_vec::<f32>().unwrap();
            if n == "head.weight" {
                *v.last_mut().unwrap() = f32::NAN;
            }
            (n, brigade::tensor::Tensor::from_vec(v, t.shape()).unwrap())
        })
        .collect();
    save_safetensors(&init, &tensors, None).unwrap();
    let mut launch = LaunchConfig::threads(2);
    // rank 0 reads a clean range: before the ranks agreed on the start it went on to the first
    // forward's gathers and waited there for the collective timeout
    launch.timeout = std::time::Duration::from_secs(20);
    let e = fit(
        &launch,
        &config(1, PolicySpec::Zero3, &init),
        |_| Dataset::builtin_text(8, 0).map_err(Error::from),
        |ctx| Ok(Box::new(Gpt::new(gpt(2), 7 + ctx.rank as u64)?) as Box<dyn Model>),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("NaN") && e.contains("head.weight"), "{e}");
    assert!(!e.to_lowercase().contains("time"), "a rank waited for the timeout: {e}");
    assert_eq!(e.lines().count(), 1, "{e}");
}
