//! DiLoCo and streaming DiLoCo through `fit`'s checkpoints: their ranks diverge between syncs,
//! so a checkpoint keeps every rank's parameters and inner optimizer state beside the policies'
//! snapshot, outer momentum, step count and (streaming) landed, unmerged fragment syncs. With
//! SGD momentum 0.9 on 2 ranks, resumed at a sync step, in the middle of a period and with a
//! fragment sync in flight (finished before the checkpoint), the run is the straight run bit
//! for bit.

use crate::common::{self, resuming};
use std::sync::Arc;

use brigade::config::CheckpointConfig;
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::policies::PolicySpec;
use brigade::{fit, OptimizerConfig, RunReport, TrainConfig};

fn config(steps: usize, policy: &str) -> TrainConfig {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let mut c = TrainConfig::new(steps, 8, sgd);
    c.model.name = "mlp".into();
    c.runtime.compute_threads = Some(1);
    c.distributed.get_or_insert_default().policy = Arc::new(policy.parse::<PolicySpec>().unwrap());
    c
}

fn run(cfg: &TrainConfig) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(2),
        cfg,
        |_| Dataset::teacher(576, 12, 3, 5).map_err(Into::into),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![12, 24, 16, 3]), 1)?)),
    )
}

fn tmp(name: &str) -> common::Scratch {
    common::tmp("diloco-resume", name)
}

fn values(r: &RunReport) -> Vec<Vec<f32>> {
    r.outcome
        .params
        .iter()
        .map(|(_, t)| t.to_vec::<f32>().unwrap())
        .collect()
}

/// H = 4. DiLoCo syncs after steps 4 and 8; streaming DiLoCo issues fragment 0 after steps 4
/// and 8 and fragment 1 after steps 2, 6 and 10, each merged DELAY steps later. Checkpoints
/// after steps 2, 4, 6, 8 and 10 (written inside the next step) and after the last step of a
/// run of 9.
#[test]
fn diloco_and_streaming_diloco_resume_bit_exact_at_a_sync_mid_period_and_with_a_sync_in_flight() {
    for policy in [
        "diloco:4",
        "streaming-diloco:4:2",
        "streaming-diloco:4:2:2",
        "streaming-diloco:4:2:bf16",
        "streaming-diloco:4:2:2:int8",
    ] {
        let d = tmp(&policy.replace(':', "-"));
        let straight = run(&config(12, policy)).unwrap();
        let mut periodic = config(12, policy);
        periodic.runtime.checkpoint = CheckpointConfig {
            path: Some(d.join("run-{step}.ckpt")),
            every: Some(2),
            ..Default::default()
        };
        let written = run(&periodic).unwrap();
        assert_eq!(
            written.outcome.losses(),
            straight.outcome.losses(),
            "{policy}: checkpoints change nothing"
        );
        let last = d.join("last.ckpt");
        let mut nine = config(9, policy);
        nine.runtime.checkpoint = CheckpointConfig {
            path: Some(last.clone()),
            ..Default::default()
        };
        run(&nine).unwrap();
        for (at, path) in [
            (4, d.join("run-4.ckpt")),
            (6, d.join("run-6.ckpt")),
            (8, d.join("run-8.ckpt")),
            (9, last),
        ] {
            let resumed = run(&resuming(config(12, policy), &path)).unwrap();
            assert_eq!(resumed.outcome.first_step, at);
            assert_eq!(
                resumed.outcome.losses(),
                straight.outcome.losses()[at..],
                "{policy}, resumed at {at}: losses, bit for bit"
            );
            assert_eq!(
                values(&resumed),
                values(&straight),
                "{policy}, resumed at {at}: parameters, bit for bit"
            );
        }
    }
}

#[test]
fn beside_bf16_parameters_diloco_syncs_the_f32_masters_and_resumes_bit_exact() {
    let d = tmp("bf16");
    let ckpt = d.join("run.ckpt");
    let bf16 = |steps| {
        let mut c = config(steps, "diloco:4");
        c.recipe.precision = brigade::MixedPrecision::uniform(brigade::tensor::DType::BF16);
        c
    };
    let straight = run(&bf16(10)).unwrap();
    // the parameters are the rounding of the synced f32 masters
    let plain = run(&config(10, "diloco:4")).unwrap();
    assert_ne!(
        straight.outcome.losses(),
        plain.outcome.losses(),
        "bf16 computes in bf16"
    );
    // after step 8, a sync: the step after it computes with the rounding of the synced masters
    let mut eight = bf16(8);
    eight.runtime.checkpoint = CheckpointConfig {
        path: Some(ckpt.clone()),
        ..Default::default()
    };
    run(&eight).unwrap();
    let resumed = run(&resuming(bf16(10), &ckpt)).unwrap();
    assert_eq!(
        resumed.outcome.losses(),
        straight.outcome.losses()[8..],
        "losses, bit for bit"
    );
    assert_eq!(
        values(&resumed),
        values(&straight),
        "rank 0's master weights, bit for bit"
    );
}
