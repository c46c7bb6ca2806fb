//! Dropout's generator in `fit`'s checkpoints: each rank's state is written with the
//! checkpoint and restored on resume, so that 2 steps + resume + 2 steps are 4 straight steps
//! bit for bit at `p > 0`, on one rank and on two ranks whose generators differ; a periodic
//! checkpoint (written inside the step it resumes) holds the generator from before that
//! step's masks; a checkpoint without generators still loads; another number of ranks
//! continues a generator the ranks shared and refuses ones that differ, in one line.

use crate::common::{self, resuming, writing};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use brigade::config::{CheckpointConfig, Instrumentation};
use brigade::launch::{LaunchConfig, RankContext};
use brigade::models::{load_safetensors_with_metadata, save_safetensors, Dataset, Mlp, MlpConfig, Model};
use brigade::observe::TrainObserver;
use brigade::outcome::StepRecord;
use brigade::{fit, OptimizerConfig, RunReport, TrainConfig};

/// The drop probability of every test here.
const P: f64 = 0.3;

fn config(steps: usize) -> TrainConfig {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    {
        let mut c = TrainConfig::new(steps, 8, sgd);
        c.model.name = "mlp".into();
        c.runtime.compute_threads = Some(1);
        c
    }
}

/// Each rank's model seed: the same on every rank, or one per rank (then the ranks' dropout
/// generators draw different masks; DDP still starts every rank from rank 0's parameters).
#[derive(Clone, Copy)]
enum Seeds {
    Shared,
    PerRank,
}

fn run(world: usize, cfg: &TrainConfig, seeds: Seeds) -> brigade::Result<RunReport> {
    let mlp = MlpConfig {
        dropout: P,
        ..MlpConfig::new(vec![12, 24, 16, 3])
    };
    fit(
        &LaunchConfig::threads(world),
        cfg,
        |_| Dataset::teacher(512, 12, 3, 5).map_err(Into::into),
        move |ctx: &RankContext| {
            let seed = match seeds {
                Seeds::Shared => 1,
                Seeds::PerRank => 1 + 100 * ctx.rank as u64,
            };
            Ok(Box::new(Mlp::new(mlp.clone(), seed)?) as Box<dyn Model>)
        },
    )
}

fn tmp(name: &str) -> common::Scratch {
    common::tmp("dropout", name)
}

/// Rank 0's final parameters, as bits.
fn bits(r: &RunReport) -> Vec<Vec<u32>> {
    r.outcome
        .params
        .iter()
        .map(|(_, t)| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Every `dropout_rng.*` entry of a checkpoint's metadata, sorted.
fn rng_entries(path: &Path) -> Vec<(String, String)> {
    let (_, meta) = load_safetensors_with_metadata(path).unwrap();
    let mut e: Vec<_> = meta
        .into_iter()
        .filter(|(k, _)| k.starts_with("dropout_rng."))
        .collect();
    e.sort();
    e
}

#[test]
fn resume_is_exact_at_p_above_zero_on_one_and_two_ranks() {
    for (world, seeds) in [(1, Seeds::Shared), (2, Seeds::PerRank)] {
        let d = tmp(&format!("exact-{world}"));
        let ckpt = d.join("run.ckpt");
        let straight = run(world, &config(4), seeds).unwrap();
        run(world, &writing(config(2), &ckpt), seeds).unwrap();
        // one entry per rank; two ranks seeded apart hold different generators
        let entries = rng_entries(&ckpt);
        assert_eq!(entries.len(), world, "{entries:?}");
        if world == 2 {
            assert_ne!(entries[0].1, entries[1].1, "each rank its own state: {entries:?}");
        }
        let resumed = run(world, &resuming(config(4), &ckpt), seeds).unwrap();
        assert_eq!(resumed.outcome.first_step, 2);
        assert_eq!(
            resumed.outcome.losses(),
            straight.outcome.losses()[2..],
            "world {world}: losses of 2 + 2 steps against 4, bit for bit"
        );
        assert_eq!(
            bits(&resumed),
            bits(&straight),
            "world {world}: parameters, bit for bit"
        );
    }
}

/// Keeps a copy of the checkpoint file as it is when step `after` has finished.
struct CopyAfter {
    after: usize,
    from: PathBuf,
    to: PathBuf,
}

impl TrainObserver for CopyAfter {
    fn step_finished(&self, record: &StepRecord) {
        if record.step == self.after {
            std::fs::copy(&self.from, &self.to).unwrap();
        }
    }
}

#[test]
fn a_periodic_checkpoint_holds_the_generator_from_before_the_step_it_resumes() {
    // Every 2 steps: the checkpoint of the state before step 2 is written during step 2,
    // after that step's forward passes drew their masks. Copied once step 2 has finished
    // (the end of the run writes over it), it resumes at step 2 exactly.
    let d = tmp("periodic");
    let (ckpt, copy) = (d.join("run.ckpt"), d.join("at-2.ckpt"));
    let straight = run(2, &config(4), Seeds::PerRank).unwrap();
    let periodic = {
        let mut c = config(4);
        c.runtime.checkpoint = CheckpointConfig {
            path: Some(ckpt.clone()),
            every: Some(2),
            resume: None,
            keep_last: None,
            metadata: vec![],
        };
        c.runtime.instrument = Instrumentation {
            observer: Some(Arc::new(CopyAfter {
                after: 2,
                from: ckpt.clone(),
                to: copy.clone(),
            })),
            ..Instrumentation::default()
        };
        c
    };
    run(2, &periodic, Seeds::PerRank).unwrap();
    let resumed = run(2, &resuming(config(4), &copy), Seeds::PerRank).unwrap();
    assert_eq!(resumed.outcome.first_step, 2);
    assert_eq!(resumed.outcome.losses(), straight.outcome.losses()[2..], "bit for bit");
    assert_eq!(bits(&resumed), bits(&straight));
}

#[test]
fn a_checkpoint_without_generators_still_loads() {
    // A checkpoint as written before generators were recorded (or by a model that draws
    // nothing): the entries taken out, it resumes with the model's fresh generator.
    let d = tmp("without");
    let ckpt = d.join("run.ckpt");
    run(1, &writing(config(2), &ckpt), Seeds::Shared).unwrap();
    let (tensors, mut meta) = load_safetensors_with_metadata(&ckpt).unwrap();
    meta.retain(|k, _| !k.starts_with("dropout_rng."));
    save_safetensors(&ckpt, &tensors, Some(meta)).unwrap();
    assert!(rng_entries(&ckpt).is_empty());
    let resumed = run(1, &resuming(config(4), &ckpt), Seeds::Shared).unwrap();
    assert_eq!(resumed.outcome.first_step, 2);
    assert_eq!(resumed.outcome.losses().len(), 2);
}

#[test]
fn another_world_size_continues_a_shared_generator_and_refuses_different_ones() {
    let d = tmp("world");
    let ckpt = d.join("run.ckpt");
    // one rank at 16 rows reads the 16 rows a step that two ranks at 8 read: the resume reads
    // on from the row the checkpoint reached
    let one_rank = |steps| {
        let mut c = config(steps);
        c.data.batch_size = 16;
        c
    };
    // two ranks seeded alike drew the same masks: one rank continues them
    run(2, &writing(config(2), &ckpt), Seeds::Shared).unwrap();
    let entries = rng_entries(&ckpt);
    assert_eq!(entries[0].1, entries[1].1, "{entries:?}");
    let resumed = run(1, &resuming(one_rank(4), &ckpt), Seeds::Shared).unwrap();
    assert_eq!(resumed.outcome.first_step, 2);
    // two ranks seeded apart: refused, in one line saying how to resume
    run(2, &writing(config(2), &ckpt), Seeds::PerRank).unwrap();
    let e = run(1, &resuming(one_rank(4), &ckpt), Seeds::PerRank)
        .err()
        .expect("refused")
        .to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    assert!(
        e.contains("dropout generators of 2 ranks") && e.contains("resume on 2 ranks"),
        "{e}"
    );
}
