//! Activation checkpointing under `fit`: the GPT with dropout trains to the same losses and
//! parameters bit for bit with its blocks checkpointed, under DDP at world 2 with each
//! policy that reduces gradients differently (all-reduce, ZeRO-2, PowerSGD), with `no_sync`
//! accumulation and with uneven data under `--join`; the checkpoint records it and a resume
//! may change it.

use std::sync::Arc;

use brigade::join::JoinMode;
use brigade::launch::{LaunchConfig, RankContext};
use brigade::models::{Dataset, Gpt, GptConfig, Model};
use brigade::policies::PolicySpec;
use brigade::source::RankShards;
use brigade::{fit, OptimizerConfig, RunReport, TrainConfig};

use crate::common::{self, resuming, writing};

fn gpt() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 16,
        n_layers: 3,
        n_heads: 2,
        d_ff: 32,
        context: 8,
        dropout: 0.2,
        ..GptConfig::default()
    }
}

fn config(steps: usize, policy: PolicySpec, accum: usize, every: usize) -> TrainConfig {
    let mut c = TrainConfig::new(steps, 4, OptimizerConfig::adamw(3e-3, Some(0.01)));
    c.model.name = "gpt".into();
    c.model.activation_checkpointing = every;
    c.data.accum = accum;
    c.runtime.compute_threads = Some(1);
    c.distributed.get_or_insert_default().policy = Arc::new(policy);
    c
}

/// Rank r's model: seeds apart, so that the ranks' dropout masks differ (DDP starts every
/// rank from rank 0's parameters).
fn model(ctx: &RankContext) -> brigade::Result<Box<dyn Model>> {
    Ok(Box::new(Gpt::new(gpt(), 1 + 100 * ctx.rank as u64)?))
}

fn run(world: usize, cfg: &TrainConfig) -> RunReport {
    fit(
        &LaunchConfig::threads(world),
        cfg,
        |_| Dataset::builtin_text(8, 0).map_err(Into::into),
        model,
    )
    .unwrap()
}

/// Each step's loss and rank 0's final parameters, as bits.
fn bits(r: &RunReport) -> (Vec<u64>, Vec<Vec<u32>>) {
    let losses = r.outcome.losses().iter().map(|l| l.to_bits()).collect();
    let params = r
        .outcome
        .params
        .iter()
        .map(|(_, t)| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
        .collect();
    (losses, params)
}

#[test]
fn checkpointed_blocks_train_bit_for_bit_as_plain_ones_under_every_policy_and_no_sync() {
    let policies = [
        PolicySpec::AllReduce,
        PolicySpec::Zero2,
        PolicySpec::PowerSgd { rank: 1, start_iter: 0 },
    ];
    for policy in policies {
        for accum in [1, 2] {
            let plain = bits(&run(2, &config(3, policy.clone(), accum, 0)));
            for every in [1, 2] {
                let ck = bits(&run(2, &config(3, policy.clone(), accum, every)));
                assert_eq!(ck.0, plain.0, "losses: {policy}, accum {accum}, every {every}");
                assert!(
                    ck.1 == plain.1,
                    "parameters differ: {policy}, accum {accum}, every {every}"
                );
            }
        }
    }
}

#[test]
fn checkpointed_blocks_train_bit_for_bit_under_join() {
    // rank 1 runs out of data a step before rank 0 and joins
    let run_join = |every: usize| {
        let text = Dataset::builtin_text(8, 0).unwrap();
        let shards = vec![text.rows(0..12).unwrap(), text.rows(12..20).unwrap()];
        let mut cfg = config(3, PolicySpec::AllReduce, 1, every);
        cfg.data.join = Some(JoinMode::DivideActive);
        bits(&fit(&LaunchConfig::threads(2), &cfg, |_| Ok(RankShards::new(shards)), model).unwrap())
    };
    let plain = run_join(0);
    assert_eq!(plain.0.len(), 3);
    let ck = run_join(1);
    assert_eq!(ck.0, plain.0, "losses");
    assert!(ck.1 == plain.1, "parameters differ under join");
}

#[test]
fn a_checkpoint_records_the_checkpointing_and_a_resume_may_change_it() {
    let d = common::tmp("activation-checkpointing", "resume");
    let ckpt = d.join("run.ckpt");
    let straight = bits(&run(2, &config(4, PolicySpec::AllReduce, 1, 0)));
    run(2, &writing(config(2, PolicySpec::AllReduce, 1, 1), &ckpt));
    let (_, meta) = brigade::models::load_safetensors_with_metadata(&ckpt).unwrap();
    assert_eq!(meta.get("activation_checkpointing").map(String::as_str), Some("1"));
    let resumed = fit(
        &LaunchConfig::threads(2),
        &resuming(config(4, PolicySpec::AllReduce, 1, 0), &ckpt),
        |_| Dataset::builtin_text(8, 0).map_err(Into::into),
        model,
    )
    .unwrap();
    let changes: Vec<String> = resumed.outcome.resume_changes.iter().map(ToString::to_string).collect();
    assert!(
        changes.iter().any(|c| c == "model.activation_checkpointing 1 -> 0"),
        "{changes:?}"
    );
    let resumed = bits(&resumed);
    assert_eq!(
        resumed.0,
        straight.0[2..],
        "losses of 2 checkpointed + 2 plain steps against 4 plain"
    );
    assert!(resumed.1 == straight.1);
}

/// Rank 0's measured memory after 2 steps of a GPT whose activations outweigh its state.
fn measured(every: usize, policy: PolicySpec) -> brigade::ddp::MemoryReport {
    let cfg = GptConfig {
        d_model: 64,
        n_layers: 4,
        n_heads: 2,
        d_ff: 256,
        context: 32,
        ..gpt()
    };
    let mut c = config(2, policy, 1, every);
    c.data.batch_size = 8;
    let r = fit(
        &LaunchConfig::threads(2),
        &c,
        |_| Dataset::builtin_text(32, 0).map_err(Into::into),
        move |_ctx: &RankContext| Ok(Box::new(Gpt::new(cfg.clone(), 1)?) as Box<dyn Model>),
    )
    .unwrap();
    r.outcome.memory.unwrap()
}

#[test]
fn checkpointing_lowers_the_measured_activations_and_peak() {
    for policy in [PolicySpec::AllReduce, PolicySpec::Zero2] {
        let plain = measured(0, policy.clone());
        let ck = measured(1, policy.clone());
        // the measured activations are real: more than the logits and their softmax alone
        // (8 x 32 positions x 256 classes x 4 bytes, twice)
        assert!(plain.activations > 2 * 8 * 32 * 256 * 4, "{plain:?}");
        // each checkpointed block keeps its input [8, 32, 64] instead of ~20 tensors of that
        // size or larger: the GPT's activations fall to well under half
        let ratio = ck.activations as f64 / plain.activations as f64;
        assert!(
            ratio < 0.5,
            "{policy}: activations {} -> {} ({ratio:.2})",
            plain.activations,
            ck.activations
        );
        assert!(ck.peak < plain.peak, "{policy}: peak {} -> {}", plain.peak, ck.peak);
        // the peak holds at least the state between steps and the activations
        assert!(plain.peak >= plain.activations + plain.parameters, "{plain:?}");
        // what stays between steps does not change
        assert_eq!(
            (ck.parameters, ck.gradients, ck.optimizer_state),
            (plain.parameters, plain.gradients, plain.optimizer_state)
        );
        eprintln!(
            "{policy}: activations {} -> {} bytes ({ratio:.3}), peak {} -> {} bytes ({:.3})",
            plain.activations,
            ck.activations,
            plain.peak,
            ck.peak,
            ck.peak as f64 / plain.peak as f64
        );
    }
}

#[test]
fn a_run_leaves_no_meter_on_the_thread_and_a_failed_one_neither() {
    use brigade::tensor::MemoryMeter;
    assert!(MemoryMeter::current().is_none());
    let ok = run(1, &config(1, PolicySpec::AllReduce, 1, 1));
    assert!(ok.outcome.memory.unwrap().peak > 0);
    assert!(MemoryMeter::current().is_none(), "fit took its meter off");
    // a trainer built here, on a thread without a meter, that fails to build
    let mut cfg = config(1, PolicySpec::AllReduce, 1, 1);
    cfg.model.activation_checkpointing = 1;
    let data = Dataset::builtin_text(8, 0).unwrap();
    let e = brigade::launch::run_ranks(
        &LaunchConfig::threads(1),
        |_| Ok(data),
        |ctx, data| {
            let mlp = brigade::models::Mlp::new(brigade::models::MlpConfig::new(vec![4, 2]), 0)?;
            let t = brigade::trainer::Trainer::new(&cfg, Box::new(mlp), data, ctx).map(|_| ());
            assert!(
                MemoryMeter::current().is_none(),
                "the failed trainer took its meter off"
            );
            t
        },
    );
    assert!(e.is_err());
}
