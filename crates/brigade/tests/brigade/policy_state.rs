//! Reducer-policy state in `fit`'s checkpoints: every rank's state (PowerSGD's error feedback,
//! its warm-start factors and iteration count) is written with the checkpoint and restored on
//! resume, so that 5 steps + resume + 5 steps is 10 straight steps bit for bit; the checkpoint
//! records the policy's spec, and a resume under another policy is refused in one line. A
//! user's policy that keeps state says so: the int8 example resumes exactly from its saved
//! residual, and the same policy saying nothing and saving nothing has its checkpoint refused.

use crate::common::{self, resuming, writing};
use std::sync::Arc;

use brigade::ddp::policy::{Group, PolicyBucket, Reduction};
use brigade::ddp::ReducerPolicy;
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::policies::PolicySpec;
use brigade::{fit, OptimizerConfig, RunReport, TrainConfig};

/// PowerSGD of rank 1 compressing from iteration 2: the cut (after step 5) is well past it.
const POWERSGD: &str = "powersgd:1@2";

fn config(spec: &str, steps: usize) -> TrainConfig {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    {
        let mut c = TrainConfig::new(steps, 8, sgd);
        c.model.name = "mlp".into();
        c.runtime.compute_threads = Some(1);
        c.distributed.get_or_insert_default().policy = Arc::new(spec.parse::<PolicySpec>().unwrap());
        c
    }
}

fn run(cfg: &TrainConfig) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(2),
        cfg,
        |_| Dataset::teacher(512, 12, 3, 5).map_err(Into::into),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![12, 24, 16, 3]), 1)?)),
    )
}

fn tmp(name: &str) -> common::Scratch {
    common::tmp("policy-state", name)
}

fn values(r: &RunReport) -> Vec<Vec<f32>> {
    r.outcome
        .params
        .iter()
        .map(|(_, t)| t.to_vec::<f32>().unwrap())
        .collect()
}

#[test]
fn powersgd_resumes_bit_exact_with_every_ranks_state_from_the_checkpoint() {
    let d = tmp("powersgd");
    let ckpt = d.join("run.ckpt");
    let straight = run(&config(POWERSGD, 10)).unwrap();
    run(&writing(config(POWERSGD, 5), &ckpt)).unwrap();
    let resumed = run(&resuming(config(POWERSGD, 10), &ckpt)).unwrap();
    assert_eq!(resumed.outcome.first_step, 5);
    assert_eq!(
        resumed.outcome.losses(),
        straight.outcome.losses()[5..],
        "losses, bit for bit"
    );
    assert_eq!(values(&resumed), values(&straight), "parameters, bit for bit");
    // Resumed with its state, PowerSGD compresses from the first resumed step on: each step
    // sends what the straight run's steps after the cut sent (not two plain all-reduces
    // again), and on the buckets the checkpoint records, so without the small agreement on the
    // bucket order that the straight run's first step made (straight: steps 0 and 1 both
    // plain, 0 with the agreement).
    let bytes = |r: &RunReport| r.outcome.sent().iter().map(|s| s.payload_bytes).collect::<Vec<_>>();
    let (straight_b, resumed_b) = (bytes(&straight), bytes(&resumed));
    assert_eq!(resumed_b, straight_b[5..], "compressed steps, no second agreement");
    assert!(straight_b[0] > straight_b[1], "{straight_b:?}");
}

#[test]
fn a_checkpoint_resumes_only_under_the_policy_it_was_written_with() {
    let d = tmp("other-policy");
    let ckpt = d.join("run.ckpt");
    run(&writing(config(POWERSGD, 3), &ckpt)).unwrap();
    for other in ["allreduce", "powersgd:2@2", "fp16"] {
        let e = run(&resuming(config(other, 6), &ckpt))
            .err()
            .expect("another policy")
            .to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        assert!(
            e.contains(&format!("'{POWERSGD}'")) && e.contains(&format!("'{other}'")),
            "{e}"
        );
    }
    // and a plain checkpoint is not resumed under PowerSGD either
    run(&writing(config("allreduce", 3), &ckpt)).unwrap();
    let e = run(&resuming(config(POWERSGD, 6), &ckpt))
        .err()
        .expect("another policy")
        .to_string();
    assert!(e.contains("'allreduce'") && e.contains(POWERSGD), "{e}");
}

fn int8_config(steps: usize, declared: bool) -> TrainConfig {
    use crate::fake_policies::own_hook::Int8;
    let policy = match declared {
        true => brigade::policy::per_rank(|_| Int8::default()),
        false => brigade::policy::per_rank(|_| Undeclared(Int8::default())),
    };
    let mut c = config("allreduce", steps);
    c.distributed.get_or_insert_default().policy = policy;
    c
}

/// The int8 example as a user who copied it without `keeps_state` and `state_dict` has it: it
/// keeps its residual across steps and says nothing of it.
struct Undeclared(crate::fake_policies::own_hook::Int8);

impl ReducerPolicy for Undeclared {
    fn name(&self) -> String {
        self.0.name()
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        self.0.reduce(bucket, comm)
    }
}

#[test]
fn the_int8_example_resumes_bit_exact_with_its_error_feedback_from_the_checkpoint() {
    let d = tmp("int8");
    let ckpt = d.join("run.ckpt");
    let straight = run(&int8_config(10, true)).unwrap();
    run(&writing(int8_config(5, true), &ckpt)).unwrap();
    let resumed = run(&resuming(int8_config(10, true), &ckpt)).unwrap();
    assert_eq!(resumed.outcome.first_step, 5);
    assert_eq!(
        resumed.outcome.losses(),
        straight.outcome.losses()[5..],
        "losses, bit for bit"
    );
    assert_eq!(values(&resumed), values(&straight), "parameters, bit for bit");
}

#[test]
fn a_checkpoint_of_a_policy_that_neither_declares_nor_saves_its_state_is_refused_in_one_line() {
    let d = tmp("undeclared");
    let ckpt = d.join("run.ckpt");
    // without a checkpoint the policy trains as the declared one does
    let plain = run(&int8_config(4, false)).unwrap();
    assert_eq!(
        plain.outcome.losses(),
        run(&int8_config(4, true)).unwrap().outcome.losses()
    );
    let e = run(&writing(int8_config(4, false), &ckpt))
        .err()
        .expect("a checkpoint that would lose the residual")
        .to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    assert!(
        e.contains("'int8'") && e.contains("keeps_state") && e.contains("state_dict"),
        "{e}"
    );
    assert!(!ckpt.exists(), "nothing written");
}

#[test]
fn a_periodic_checkpoint_holds_the_policy_state_its_step_starts_from() {
    // the checkpoint after 5 steps is written during step 5, after that step's backward has
    // updated the residual: it must hold the residual step 5 started from
    let d = tmp("int8-periodic");
    let straight = run(&int8_config(10, true)).unwrap();
    let mut periodic = int8_config(10, true);
    periodic.runtime.checkpoint = brigade::config::CheckpointConfig {
        path: Some(d.join("run-{step}.ckpt")),
        every: Some(5),
        ..Default::default()
    };
    assert_eq!(run(&periodic).unwrap().outcome.losses(), straight.outcome.losses());
    let resumed = run(&resuming(int8_config(10, true), &d.join("run-5.ckpt"))).unwrap();
    assert_eq!(
        resumed.outcome.losses(),
        straight.outcome.losses()[5..],
        "losses, bit for bit"
    );
    assert_eq!(values(&resumed), values(&straight), "parameters, bit for bit");
}

/// The shipped int8 policy on an MLP whose buckets DDP regroups after the first step (the
/// ready order puts each layer's weight before its bias, so a half-MiB cap closes the buckets
/// at other parameters than the reverse registration order did), on `world` ranks.
fn regrouped_int8(steps: usize, world: usize) -> (TrainConfig, LaunchConfig) {
    regrouped("int8", steps, world)
}

/// `spec` on the regrouped MLP of [`regrouped_int8`].
fn regrouped(spec: &str, steps: usize, world: usize) -> (TrainConfig, LaunchConfig) {
    let mut c = config(spec, steps);
    c.data.batch_size = 6;
    let ddp = &mut c.distributed.get_or_insert_default().ddp;
    (ddp.bucket_cap_mb, ddp.first_bucket_cap_mb) = (0.5, 0.5);
    (c, LaunchConfig::threads(world))
}

fn run_regrouped(cfg: &TrainConfig, launch: &LaunchConfig) -> brigade::Result<RunReport> {
    fit(
        launch,
        cfg,
        |_| Dataset::teacher(720, 128, 10, 5).map_err(Into::into),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![128, 512, 512, 10]), 1)?)),
    )
}

#[test]
fn int8_resumes_bit_exact_on_the_buckets_ddp_regrouped() {
    for world in [2, 3] {
        let d = tmp(&format!("int8-regrouped-{world}"));
        let (straight_cfg, launch) = regrouped_int8(8, world);
        let straight = run_regrouped(&straight_cfg, &launch).unwrap();
        let buckets = |r: &RunReport| r.outcome.buckets.iter().map(|b| b.params.clone()).collect::<Vec<_>>();
        // the regrouping moved a parameter to another bucket: the case this test is about
        let fresh = run_regrouped(&regrouped_int8(0, world).0, &launch).unwrap();
        assert_ne!(buckets(&fresh), buckets(&straight), "the buckets were regrouped");
        // the final checkpoint after 4 steps, and a periodic one written inside step 4
        let mut periodic = regrouped_int8(8, world).0;
        periodic.runtime.checkpoint = brigade::config::CheckpointConfig {
            path: Some(d.join("run-{step}.ckpt")),
            every: Some(3),
            ..Default::default()
        };
        assert_eq!(
            run_regrouped(&periodic, &launch).unwrap().outcome.losses(),
            straight.outcome.losses()
        );
        let ckpt = d.join("run.ckpt");
        run_regrouped(&writing(regrouped_int8(4, world).0, &ckpt), &launch).unwrap();
        for (at, path) in [(4, ckpt), (3, d.join("run-3.ckpt"))] {
            let resumed = run_regrouped(&resuming(regrouped_int8(8, world).0, &path), &launch).unwrap();
            assert_eq!(resumed.outcome.first_step, at);
            assert_eq!(
                resumed.outcome.losses(),
                straight.outcome.losses()[at..],
                "{world} ranks, resumed at {at}: losses, bit for bit"
            );
            assert_eq!(
                values(&resumed),
                values(&straight),
                "{world} ranks: parameters, bit for bit"
            );
            assert_eq!(buckets(&resumed), buckets(&straight), "{world} ranks: the same buckets");
        }
    }
}

#[test]
fn topk_and_efsign_resume_bit_exact_with_their_residuals_on_the_buckets_ddp_regrouped() {
    for spec in ["topk:0.05", "efsign"] {
        let d = tmp(&format!("{}-regrouped", spec.replace(':', "-")));
        let (straight_cfg, launch) = regrouped(spec, 6, 2);
        let straight = run_regrouped(&straight_cfg, &launch).unwrap();
        // a periodic checkpoint written inside step 3, and the final one after 4 steps
        let mut periodic = regrouped(spec, 6, 2).0;
        periodic.runtime.checkpoint = brigade::config::CheckpointConfig {
            path: Some(d.join("run-{step}.ckpt")),
            every: Some(3),
            ..Default::default()
        };
        assert_eq!(
            run_regrouped(&periodic, &launch).unwrap().outcome.losses(),
            straight.outcome.losses()
        );
        let ckpt = d.join("run.ckpt");
        run_regrouped(&writing(regrouped(spec, 4, 2).0, &ckpt), &launch).unwrap();
        for (at, path) in [(4, ckpt), (3, d.join("run-3.ckpt"))] {
            let resumed = run_regrouped(&resuming(regrouped(spec, 6, 2).0, &path), &launch).unwrap();
            assert_eq!(resumed.outcome.first_step, at);
            assert_eq!(
                resumed.outcome.losses(),
                straight.outcome.losses()[at..],
                "{spec}, resumed at {at}: losses, bit for bit"
            );
            assert_eq!(values(&resumed), values(&straight), "{spec}: parameters, bit for bit");
        }
    }
}
