//! Ranks that diverge between syncs in `fit`'s checkpoints: the `local_sgd` example (each rank
//! steps alone after its first K steps, the models averaged every H) declares that its ranks'
//! parameters and optimizer state diverge, so a checkpoint keeps every rank's and a resume
//! gives each rank its own back: with SGD momentum 0.9, resumed in the middle of a period and
//! right after an averaging, on 2 and 3 ranks, the run is the straight run bit for bit. Such a
//! checkpoint resumes on as many ranks only (one error line otherwise), and a policy whose ranks
//! diverge in what no checkpoint keeps is refused before step 0 of a run that checkpoints.

use crate::common::{self, resuming, writing};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use brigade::config::CheckpointConfig;
use brigade::ddp::policy::{Group, PolicyBucket, Reduction, StepContext};
use brigade::ddp::{KeepsState, RankState, ReducerPolicy, Replicas};
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::{fit, OptimizerConfig, RunReport, TrainConfig};

use crate::fake_policies::local_sgd::LocalSgd;

/// All-reduce for the first 2 steps, then the models averaged after every 4th step of each
/// rank's own: after steps 6 and 10 (counted from 1).
const K: u64 = 2;
const H: u64 = 4;

fn config(steps: usize) -> TrainConfig {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let mut c = TrainConfig::new(steps, 8, sgd);
    c.model.name = "mlp".into();
    c.runtime.compute_threads = Some(1);
    c.distributed.get_or_insert_default().policy = brigade::policy::per_rank(|_| LocalSgd::new(K, H));
    c
}

fn run(cfg: &TrainConfig, world: usize) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(world),
        cfg,
        |_| Dataset::teacher(576, 12, 3, 5).map_err(Into::into),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![12, 24, 16, 3]), 1)?)),
    )
}

fn tmp(name: &str) -> common::Scratch {
    common::tmp("replicas", name)
}

fn values(r: &RunReport) -> Vec<Vec<f32>> {
    r.outcome
        .params
        .iter()
        .map(|(_, t)| t.to_vec::<f32>().unwrap())
        .collect()
}

#[test]
fn local_sgd_resumes_bit_exact_mid_period_and_at_a_sync_step_with_every_ranks_model() {
    for world in [2, 3] {
        let d = tmp(&format!("local-sgd-{world}"));
        let straight = run(&config(12), world).unwrap();
        // checkpoints after steps 6 (the models just averaged) and 8 (two steps into a
        // period), each written inside the next step
        let mut periodic = config(12);
        periodic.runtime.checkpoint = CheckpointConfig {
            path: Some(d.join("run-{step}.ckpt")),
            every: Some(2),
            ..Default::default()
        };
        let written = run(&periodic, world).unwrap();
        assert_eq!(written.outcome.losses(), straight.outcome.losses());
        // and the final checkpoint of a run of 9 steps (three steps into a period)
        let last = d.join("last.ckpt");
        let mut nine = config(9);
        nine.runtime.checkpoint = CheckpointConfig {
            path: Some(last.clone()),
            ..Default::default()
        };
        run(&nine, world).unwrap();
        for (at, path) in [(6, d.join("run-6.ckpt")), (8, d.join("run-8.ckpt")), (9, last)] {
            let resumed = run(&resuming(config(12), &path), world).unwrap();
            assert_eq!(resumed.outcome.first_step, at);
            assert_eq!(
                resumed.outcome.losses(),
                straight.outcome.losses()[at..],
                "{world} ranks, resumed at {at}: losses (the mean over the ranks), bit for bit"
            );
            assert_eq!(
                values(&resumed),
                values(&straight),
                "{world} ranks, resumed at {at}: parameters, bit for bit"
            );
        }
    }
}

/// Local SGD as a user who knows its ranks diverge in something no checkpoint keeps declares it.
struct Unsaved(LocalSgd);

impl ReducerPolicy for Unsaved {
    fn name(&self) -> String {
        self.0.name()
    }

    fn keeps_state(&self) -> KeepsState {
        self.0.keeps_state()
    }

    fn replicas(&self) -> Replicas {
        Replicas::DivergeUnsaved
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        self.0.reduce(bucket, comm)
    }

    fn after_step(&mut self, step: &StepContext<'_>, comm: &Group) -> brigade::ddp::Result<()> {
        self.0.after_step(step, comm)
    }
}

#[test]
fn a_policy_that_diverges_in_what_no_checkpoint_keeps_is_refused_before_step_0_when_the_run_checkpoints() {
    let d = tmp("unsaved");
    let unsaved = |steps| {
        let mut c = config(steps);
        c.distributed.get_or_insert_default().policy = brigade::policy::per_rank(|_| Unsaved(LocalSgd::new(K, H)));
        c
    };
    // without a checkpoint it trains as the declared policy does
    assert_eq!(
        run(&unsaved(8), 2).unwrap().outcome.losses(),
        run(&config(8), 2).unwrap().outcome.losses()
    );
    let mut periodic = unsaved(8);
    periodic.runtime.checkpoint = CheckpointConfig {
        path: Some(d.join("run-{step}.ckpt")),
        every: Some(3),
        ..Default::default()
    };
    let steps = Arc::new(AtomicUsize::new(0));
    let counted = steps.clone();
    periodic.runtime.instrument.observer = Some(brigade::observe::on_step(move |_| {
        counted.fetch_add(1, Ordering::Relaxed);
    }));
    let e = run(&periodic, 2)
        .err()
        .expect("a checkpoint that would lose the ranks' state")
        .to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    assert!(e.contains("'local-sgd:4@2'") && e.contains("Replicas::Diverge"), "{e}");
    assert_eq!(steps.load(Ordering::Relaxed), 0, "refused before step 0");
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "nothing written");
}

/// Each rank trains alone, never syncing: its ranks diverge from the first step, and it keeps
/// no state of its own.
struct Alone;

impl ReducerPolicy for Alone {
    fn name(&self) -> String {
        "alone".into()
    }

    fn keeps_state(&self) -> KeepsState {
        KeepsState::Nothing
    }

    fn replicas(&self) -> Replicas {
        Replicas::Diverge(RankState::ALL)
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        Ok(Reduction::Full(comm.ready(bucket.tensor)))
    }
}

#[test]
fn a_diverged_checkpoint_resumed_on_another_number_of_ranks_is_one_error_line() {
    let d = tmp("other-world");
    let ckpt = d.join("run.ckpt");
    let alone = |steps| {
        let mut c = config(steps);
        c.distributed.get_or_insert_default().policy = brigade::policy::per_rank(|_| Alone);
        c
    };
    run(&writing(alone(3), &ckpt), 2).unwrap();
    // on 2 ranks it resumes (each rank its own model: the straight run's losses)
    let straight = run(&alone(5), 2).unwrap();
    let resumed = run(&resuming(alone(5), &ckpt), 2).unwrap();
    assert_eq!(resumed.outcome.losses(), straight.outcome.losses()[3..]);
    // the same 16 rows a step over all ranks, so that the data would continue where it stood
    for (world, batch) in [(1, 16), (4, 4)] {
        let mut other = resuming(alone(5), &ckpt);
        other.data.batch_size = batch;
        let e = run(&other, world)
            .err()
            .expect("each rank's model cannot be continued on another number of ranks")
            .to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        assert!(
            e.contains("each of its 2 ranks' own parameters")
                && e.contains("'alone'")
                && e.contains(&format!("this run has {world}")),
            "{e}"
        );
    }
}

#[test]
fn beside_bf16_parameters_each_rank_resumes_its_own_f32_master_weights() {
    let d = tmp("bf16");
    let ckpt = d.join("run.ckpt");
    let alone = |steps| {
        let mut c = config(steps);
        c.distributed.get_or_insert_default().policy = brigade::policy::per_rank(|_| Alone);
        c.recipe.precision = brigade::MixedPrecision::uniform(brigade::tensor::DType::BF16);
        c
    };
    let straight = run(&alone(6), 2).unwrap();
    run(&writing(alone(3), &ckpt), 2).unwrap();
    let resumed = run(&resuming(alone(6), &ckpt), 2).unwrap();
    assert_eq!(
        resumed.outcome.losses(),
        straight.outcome.losses()[3..],
        "losses, bit for bit"
    );
    assert_eq!(
        values(&resumed),
        values(&straight),
        "rank 0's master weights, bit for bit"
    );
}
