//! `brigade::study` with a TensorBoard directory: one run directory per policy, named by its
//! spec, and a write that fails kept per policy while the study goes on.

use brigade::launch::{net_model, LaunchConfig};
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::policies::Registry;
use brigade::study::{study, PolicyStudy, StudyConfig};
use brigade::{OptimizerConfig, TrainConfig};

use crate::common::tmp;

/// A study of `allreduce` and `fp16` over 4 steps of a small MLP on 2 thread ranks, writing
/// its events in `tensorboard`.
fn run(tensorboard: std::path::PathBuf) -> Vec<PolicyStudy> {
    run_of(&["allreduce", "fp16"], tensorboard).unwrap()
}

/// A study of `policies` as [`run`]'s.
fn run_of(policies: &[&str], tensorboard: std::path::PathBuf) -> brigade::Result<Vec<PolicyStudy>> {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.05,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    let sc = StudyConfig {
        tensorboard: Some(tensorboard),
        ..StudyConfig::new(vec![net_model(1.0, 20.0)], vec![0.5])
    };
    let policies: Vec<String> = policies.iter().map(|p| p.to_string()).collect();
    study(
        &LaunchConfig::threads(2),
        &TrainConfig::new(4, 16, sgd),
        &Registry::new(),
        &policies,
        &sc,
        |_world| Dataset::teacher(512, 8, 3, 0).map_err(Into::into),
        |_ctx| Ok(Box::new(Mlp::new(MlpConfig::new(vec![8, 16, 3]), 0)?)),
    )
    .and_then(|s| s.stopped.map_or(Ok(s.policies), Err))
}

/// How many records an event file holds (each: a `u64` length, 4 bytes of CRC, the data, 4
/// bytes of CRC).
fn records(bytes: &[u8]) -> usize {
    let (mut at, mut n) = (0, 0);
    while at + 8 <= bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        at += 16 + len;
        n += 1;
    }
    assert_eq!(at, bytes.len(), "whole records");
    n
}

#[test]
fn a_study_writes_one_event_file_per_policy_in_a_directory_named_by_its_spec() {
    let scratch = tmp("study-tensorboard", "written");
    let dir = scratch.join("tb");
    let results = run(dir.clone());
    assert_eq!(results.len(), 2);
    for r in &results {
        assert_eq!(r.tensorboard_failure, None, "{}", r.policy);
        let files: Vec<_> = std::fs::read_dir(dir.join(&r.policy)).unwrap().collect();
        assert_eq!(files.len(), 1, "{}: one event file", r.policy);
        let file = files[0].as_ref().unwrap();
        let name = file.file_name();
        assert!(name.to_string_lossy().starts_with("events.out.tfevents."), "{name:?}");
        // the file's version, the run's start, then each of the 4 steps' scalars as it ran and
        // its predictions after the run
        assert_eq!(records(&std::fs::read(file.path()).unwrap()), 2 + 2 * 4, "{}", r.policy);
    }
}

#[test]
fn a_tensorboard_directory_that_cannot_be_made_is_kept_per_policy_and_the_study_goes_on() {
    let scratch = tmp("study-tensorboard", "under-a-file");
    let file = scratch.join("taken");
    std::fs::write(&file, b"x").unwrap();
    let results = run(file.join("tb"));
    assert_eq!(results.len(), 2, "every policy still trains");
    for r in &results {
        assert_eq!(r.losses.len(), 4);
        let e = r.tensorboard_failure.as_deref().expect("the directory cannot be made");
        assert!(e.contains(&r.policy), "names the policy's directory: {e}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

#[test]
fn a_policy_listed_twice_is_refused_before_any_run_or_directory() {
    let scratch = tmp("study-tensorboard", "twice");
    let dir = scratch.join("tb");
    let e = run_of(&["allreduce", "fp16", "allreduce"], dir.clone())
        .unwrap_err()
        .to_string();
    assert!(e.contains("allreduce") && e.contains("twice (entries 1 and 3)"), "{e}");
    assert!(!dir.exists(), "no TensorBoard directory is made");
}
