//! Checkpoints inside a run: `{step}` in the path keeps each one, `keep_last` the newest K;
//! a resume from the step-25 checkpoint of a 50-step run, and that run's final checkpoint,
//! equal the uninterrupted run bit for bit.

use std::path::{Path, PathBuf};

use brigade::checkpoint::load_model_tensors;
use brigade::config::CheckpointConfig;
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::{fit, OptimizerConfig, RunReport, TrainConfig};

use crate::common::{self, resuming};

fn config(steps: usize) -> TrainConfig {
    let mut c = TrainConfig::new(steps, 8, OptimizerConfig::adamw(1e-2, None));
    c.model.name = "mlp".into();
    c.runtime.compute_threads = Some(1);
    c
}

fn run(cfg: &TrainConfig) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(2),
        cfg,
        |_| Dataset::teacher(512, 6, 3, 2).map_err(Into::into),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![6, 16, 3]), 3)?)),
    )
}

fn every(mut cfg: TrainConfig, path: &Path, every: usize, keep_last: Option<usize>) -> TrainConfig {
    cfg.runtime.checkpoint = CheckpointConfig {
        path: Some(path.to_path_buf()),
        every: Some(every),
        keep_last,
        ..CheckpointConfig::default()
    };
    cfg
}

fn files(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// By name (a checkpoint's tensors come in name order).
fn values(params: &[(String, brigade::tensor::Tensor)]) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = params
        .iter()
        .map(|(n, t)| (n.clone(), t.to_vec::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn a_step_path_keeps_each_checkpoint_and_the_step_25_one_resumes_as_the_straight_run() {
    let d = common::tmp("checkpoints", "step-path");
    let straight = run(&config(50)).unwrap();
    let template: PathBuf = d.join("run-{step}.ckpt");
    let written = run(&every(config(50), &template, 25, None)).unwrap();
    assert_eq!(
        written.outcome.losses(),
        straight.outcome.losses(),
        "checkpoints change nothing"
    );
    // one file per checkpoint, no temporary file left behind (each write is atomic)
    assert_eq!(files(&d), ["run-25.ckpt", "run-50.ckpt"]);
    let last = load_model_tensors(&d.join("run-50.ckpt")).unwrap();
    assert_eq!(last.step, 50);
    assert_eq!(
        values(&last.params),
        values(&straight.outcome.params),
        "the final checkpoint"
    );
    assert_eq!(load_model_tensors(&d.join("run-25.ckpt")).unwrap().step, 25);
    let resumed = run(&resuming(config(50), &d.join("run-25.ckpt"))).unwrap();
    assert_eq!(resumed.outcome.first_step, 25);
    assert_eq!(
        resumed.outcome.losses(),
        straight.outcome.losses()[25..],
        "losses, bit for bit"
    );
    assert_eq!(
        values(&resumed.outcome.params),
        values(&straight.outcome.params),
        "parameters, bit for bit"
    );
}

#[test]
fn keep_last_keeps_the_newest_checkpoints_of_the_run_and_no_other_file() {
    let d = common::tmp("checkpoints", "keep-last");
    // files the template does not name stay: another prefix, no digits, a step and more; and
    // so do those it names that are not this run's checkpoints: a file that is no checkpoint,
    // an earlier run's checkpoints (another lineage), whatever their steps
    let others = [
        "other-10.ckpt",
        "run-x.ckpt",
        "run-10.ckpt.bak",
        "run-.ckpt",
        "run-3.ckpt",
    ];
    for f in others {
        std::fs::write(d.join(f), b"not mine").unwrap();
    }
    run(&every(config(36), &d.join("run-{step}.ckpt"), 12, None)).unwrap();
    run(&every(config(30), &d.join("run-{step}.ckpt"), 5, Some(2))).unwrap();
    let mut want: Vec<&str> = others.to_vec();
    want.extend([
        "run-12.ckpt",
        "run-24.ckpt",
        "run-25.ckpt",
        "run-30.ckpt",
        "run-36.ckpt",
    ]);
    want.sort();
    assert_eq!(files(&d), want);
    assert_eq!(std::fs::read(d.join("run-3.ckpt")).unwrap(), b"not mine");
}

#[test]
fn a_checkpoint_path_that_may_land_on_the_initial_parameters_names_both_fields() {
    let d = common::tmp("checkpoints", "clash");
    let init = d.join("w-4.safetensors");
    let first = run(&config(1)).unwrap();
    brigade::models::save_safetensors(&init, &first.outcome.params, None).unwrap();
    let before = std::fs::read(&init).unwrap();
    let mut cfg = every(config(4), &d.join("w-{step}.safetensors"), 2, None);
    cfg.model.init = Some(init.clone());
    let e = run(&cfg).err().expect("refused").to_string();
    assert!(
        e.contains("runtime.checkpoint.path") && e.contains("model.init") && e.contains("of step 4"),
        "{e}"
    );
    assert_eq!(std::fs::read(&init).unwrap(), before, "the initial parameters are kept");
}

#[test]
fn a_keep_last_or_step_path_that_would_do_nothing_is_refused_in_one_line() {
    let d = common::tmp("checkpoints", "refused");
    let cases = [
        (d.join("run.ckpt"), Some(2), "needs {step}"),
        (d.join("run-{step}.ckpt"), Some(0), "at least 1"),
        (d.join("{step}").join("run.ckpt"), None, "once, in the file name"),
        (d.join("run-{step}-{step}.ckpt"), Some(1), "once, in the file name"),
    ];
    for (path, keep, want) in cases {
        let e = run(&every(config(3), &path, 1, keep))
            .err()
            .expect("refused")
            .to_string();
        assert!(!e.contains('\n') && e.contains(want), "{}: {e}", path.display());
    }
    assert!(files(&d).is_empty(), "nothing written: {:?}", files(&d));
}

#[test]
fn a_brace_token_other_than_step_in_the_path_is_refused_as_no_placeholder() {
    let d = common::tmp("checkpoints", "stray-token");
    for (name, token) in [
        ("run-{STEP}.ckpt", "{STEP}"),
        ("run-{rank}.ckpt", "{rank}"),
        ("run-{step}-{}.ckpt", "{}"),
    ] {
        let e = run(&every(config(2), &d.join(name), 1, None)).err().expect("refused");
        // each rank refuses it before any work: the error names the rank
        let own = match &e {
            brigade::Error::OnRank { source, .. } => source.as_ref(),
            e => e,
        };
        assert!(
            matches!(own, brigade::Error::NotAPlaceholder { token: t, .. } if t == token),
            "{name}: {e}"
        );
        let line = e.to_string();
        assert!(
            !line.contains('\n') && line.contains("runtime.checkpoint.path") && line.contains("{step}"),
            "{line}"
        );
    }
    assert!(files(&d).is_empty(), "nothing written: {:?}", files(&d));
}
