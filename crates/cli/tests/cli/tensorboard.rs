//! `--tensorboard DIR` read back by TensorBoard's own reader (its Python package's
//! `EventAccumulator`): the tags, steps and values a run wrote equal its `--losses` file and
//! `--json` summary within f32 rounding (TensorBoard's scalars are f32). The reader is the
//! `python3` of `$BRIGADE_TB_PYTHON` (CI installs `tensorboard` into `.venv-tb`: `.ci/run`), or
//! the `python3` on the path; without the package these tests say they skipped, except under
//! `CI=true`, where they fail.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::common::{self, cat, s, MLP};

/// The small MLP of `MLP`, for `sweep` (which has no progress bar to quiet).
const SWEEP_MLP: &[&str] = &["--model", "mlp", "--widths", "16,32,32,4", "--lr", "0.05"];

/// What TensorBoard reads from a log directory: for each run (a directory holding event files,
/// by its path under the log directory; `.` for the log directory itself), each tag's
/// `(step, value)` in order.
type Runs = BTreeMap<String, BTreeMap<String, Vec<(u64, f64)>>>;

/// Reads every run under `logdir` the way `tensorboard --logdir` finds them.
const READER: &str = r#"
import json, os, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
logdir = sys.argv[1]
runs = {}
for d, _, files in sorted(os.walk(logdir)):
    if any("tfevents" in f for f in files):
        ea = EventAccumulator(d, size_guidance={"scalars": 0})
        ea.Reload()
        runs[os.path.relpath(d, logdir)] = {
            t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]
        }
print(json.dumps(runs))
"#;

/// The python that has TensorBoard: `$BRIGADE_TB_PYTHON`, else `python3`; `None` (the test
/// skips, saying so) when it cannot import `tensorboard`, which fails the test under CI.
fn tensorboard_python(test: &str) -> Option<String> {
    let python = std::env::var("BRIGADE_TB_PYTHON").unwrap_or_else(|_| "python3".into());
    let found = Command::new(&python)
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        return Some(python);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!(
            "{test}: CI=true but {python} cannot import tensorboard: .ci/run installs it into .venv-tb and sets \
             BRIGADE_TB_PYTHON; this test must not skip in CI"
        );
    }
    // the real stderr (not the captured one), so that a plain `cargo test` shows it
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: {python} cannot import tensorboard (python3 -m venv .venv-tb && .venv-tb/bin/pip install \
         tensorboard, then BRIGADE_TB_PYTHON=.venv-tb/bin/python, as .ci/run does)"
    );
    None
}

/// Every run under `logdir`, as TensorBoard's reader gives them.
fn read(python: &str, logdir: &Path) -> Runs {
    let out = Command::new(python).args(["-c", READER, s(logdir)]).output().unwrap();
    assert!(
        out.status.success(),
        "TensorBoard's reader failed on {}: {}",
        logdir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let runs: BTreeMap<String, BTreeMap<String, Vec<(f64, f64)>>> = serde_json::from_slice(&out.stdout).unwrap();
    runs.into_iter()
        .map(|(run, tags)| {
            let tags = tags
                .into_iter()
                .map(|(tag, points)| (tag, points.into_iter().map(|(s, v)| (s as u64, v)).collect()))
                .collect();
            (run, tags)
        })
        .collect()
}

/// `tb` is `want` rounded to f32 (within one f32 rounding of it: `want` may itself be a
/// decimal rounding of the run's f64).
fn f32_equal(tb: f64, want: f64, what: &str) {
    let tol = f64::from(f32::EPSILON) * want.abs() + 1e-9;
    assert!(
        (tb - want).abs() <= tol,
        "{what}: TensorBoard read {tb}, the run's value is {want}"
    );
}

/// The steps of a tag's points.
fn steps(points: &[(u64, f64)]) -> Vec<u64> {
    points.iter().map(|(s, _)| *s).collect()
}

/// The `--losses` file's rows: step, loss, lr, grad_norm, val_loss (empty cells `None`).
fn losses_rows(path: &Path) -> Vec<Vec<Option<f64>>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(|c| c.parse().ok()).collect())
        .collect()
}

#[test]
fn train_tensorboard_holds_every_steps_scalars_as_its_losses_file_and_summary() {
    let Some(python) = tensorboard_python("train_tensorboard_holds_every_steps_scalars") else {
        return;
    };
    let dir = common::dir("tensorboard-train");
    let (logdir, losses) = (dir.join("runs").join("mlp"), dir.join("losses.csv"));
    let n = 6;
    let out = common::ok(&cat(&[
        &["train"],
        MLP,
        &["--world-size", "2", "--steps", "6", "--json"],
        &["--clip-grad-norm", "1.0", "--eval-every", "2", "--val-fraction", "0.1"],
        &["--losses", s(&losses), "--tensorboard", s(&logdir)],
    ]));
    let summary: Value = serde_json::from_str(out.trim()).unwrap();
    let runs = read(&python, &dir.join("runs"));
    assert_eq!(runs.keys().collect::<Vec<_>>(), ["mlp"], "one run, its directory's");
    let run = &runs["mlp"];
    assert_eq!(
        run.keys().map(String::as_str).collect::<Vec<_>>(),
        [
            "train/bytes_sent",
            "train/grad_norm",
            "train/loss",
            "train/lr",
            "train/step_ms",
            "train/val_loss"
        ]
    );
    let rows = losses_rows(&losses);
    assert_eq!(rows.len(), n);
    let all: Vec<u64> = (0..n as u64).collect();
    for (tag, column) in [("train/loss", 1), ("train/lr", 2), ("train/grad_norm", 3)] {
        assert_eq!(steps(&run[tag]), all, "{tag}");
        for ((step, v), row) in run[tag].iter().zip(&rows) {
            f32_equal(*v, row[column].unwrap(), &format!("{tag} at step {step}"));
        }
    }
    // evaluated after steps 1, 3 and 5 (--eval-every 2)
    let evaluated: Vec<(u64, f64)> = rows.iter().filter_map(|r| Some((r[0]? as u64, r[4]?))).collect();
    assert_eq!(steps(&run["train/val_loss"]), [1, 3, 5]);
    assert_eq!(steps(&run["train/val_loss"]), steps(&evaluated));
    for ((step, v), (_, want)) in run["train/val_loss"].iter().zip(&evaluated) {
        f32_equal(*v, *want, &format!("train/val_loss at step {step}"));
    }
    // the payload of each step, as --json gives it (integers, exact in f32 at this size)
    let sent = common::numbers(&summary["sent_bytes_by_step"]);
    assert_eq!(steps(&run["train/bytes_sent"]), all);
    assert_eq!(
        run["train/bytes_sent"].iter().map(|(_, v)| *v).collect::<Vec<_>>(),
        sent
    );
    assert!(sent.iter().all(|&b| b > 0.0), "two ranks send gradients: {sent:?}");
    // the step times are the summary's: its fastest step is theirs
    assert_eq!(steps(&run["train/step_ms"]), all);
    let fastest = run["train/step_ms"]
        .iter()
        .map(|(_, v)| *v)
        .fold(f64::INFINITY, f64::min);
    f32_equal(
        fastest,
        summary["min_step_ms"].as_f64().unwrap(),
        "the fastest train/step_ms",
    );
}

#[test]
fn a_resumed_run_in_the_same_directory_replaces_the_steps_after_its_checkpoint() {
    let Some(python) = tensorboard_python("a_resumed_run_in_the_same_directory_replaces_the_steps") else {
        return;
    };
    let dir = common::dir("tensorboard-resume");
    let (logdir, losses) = (dir.join("tb"), dir.join("losses.csv"));
    let ck = dir.join("ck-{step}.ckpt");
    let base = cat(&[&["train"], MLP, &["--world-size", "2", "--steps", "8"]]);
    // the whole run, checkpointed at step 4 and at its end
    common::ok(&cat(&[
        &base,
        &["--checkpoint", s(&ck), "--checkpoint-every", "4"],
        &["--losses", s(&losses), "--tensorboard", s(&logdir)],
    ]));
    // steps 4 to 7 again, from the checkpoint at step 4, into the same directory
    let ck4 = dir.join("ck-4.ckpt");
    common::ok(&cat(&[&base, &["--resume", s(&ck4), "--tensorboard", s(&logdir)]]));
    let files = std::fs::read_dir(&logdir).unwrap().count();
    assert_eq!(files, 2, "each run writes its own file");
    let runs = read(&python, &logdir);
    let loss = &runs["."]["train/loss"];
    // without the resume's start event TensorBoard keeps both runs' steps 4 to 7 (12 points)
    assert_eq!(steps(loss), (0..8).collect::<Vec<u64>>(), "{loss:?}");
    // a resume continues bit for bit: the curve is the straight run's
    for ((step, v), (_, want)) in loss.iter().zip(common::losses(&losses)) {
        f32_equal(*v, want, &format!("train/loss at step {step}"));
    }
}

#[test]
fn a_sweep_writes_one_run_per_policy_and_per_bucket_cap_with_its_prediction() {
    let Some(python) = tensorboard_python("a_sweep_writes_one_run_per_policy_and_per_bucket_cap") else {
        return;
    };
    let dir = common::dir("tensorboard-sweep");
    let base = cat(&[&["sweep"], SWEEP_MLP, &["--world-size", "2", "--steps", "3", "--json"]]);
    let (policies, caps) = (dir.join("policies"), dir.join("caps"));
    let out = common::ok(&cat(&[
        &base,
        &["--policy", "allreduce,fp16", "--out", s(&dir.join("p-out"))],
        &["--tensorboard", s(&policies)],
    ]));
    let rows: Value = serde_json::from_str(out.trim()).unwrap();
    let runs = read(&python, &policies);
    assert_eq!(runs.keys().collect::<Vec<_>>(), ["allreduce", "fp16"]);
    for row in rows.as_array().unwrap() {
        let run = &runs[row["policy"].as_str().unwrap()];
        assert_eq!(steps(&run["train/loss"]), [0, 1, 2]);
        f32_equal(
            run["train/loss"][2].1,
            row["final_loss"].as_f64().unwrap(),
            "final loss",
        );
        let last_sent = run["train/bytes_sent"][2].1;
        assert_eq!(last_sent, row["sent_bytes_last_step"].as_f64().unwrap());
    }
    // fp16 sends half of allreduce's bytes
    assert_eq!(
        runs["fp16"]["train/bytes_sent"][2].1 * 2.0,
        runs["allreduce"]["train/bytes_sent"][2].1
    );

    let out = common::ok(&cat(&[
        &base,
        &["--bucket-mb", "0.001,25", "--out", s(&dir.join("c-out"))],
        &["--tensorboard", s(&caps)],
    ]));
    let rows: Value = serde_json::from_str(out.trim()).unwrap();
    let runs = read(&python, &caps);
    assert_eq!(runs.keys().collect::<Vec<_>>(), ["bucket_0.001MiB", "bucket_25MiB"]);
    for row in rows.as_array().unwrap() {
        let run = &runs[&format!("bucket_{}MiB", row["bucket_mb"].as_f64().unwrap())];
        assert_eq!(
            steps(&run["train/loss"]),
            [0, 1, 2],
            "the measured run, not its baseline"
        );
        let predicted = &run["predicted/step_ms"];
        assert_eq!(steps(predicted), [2], "the cap's prediction at the last step");
        f32_equal(
            predicted[0].1,
            row["predicted_step_ms"].as_f64().unwrap(),
            "predicted/step_ms",
        );
    }
}

#[test]
fn a_tensorboard_path_that_is_a_file_is_one_line_before_step_0() {
    let dir = common::dir("tensorboard-file");
    let (file, losses) = (dir.join("taken"), dir.join("losses.csv"));
    std::fs::write(&file, b"x").unwrap();
    for under in [file.clone(), file.join("run")] {
        let err = common::fails(&cat(&[
            &["train"],
            MLP,
            &["--steps", "2", "--losses", s(&losses), "--tensorboard", s(&under)],
        ]));
        assert!(
            err.contains("--tensorboard") && err.contains("not a directory"),
            "{err}"
        );
        assert!(!losses.exists(), "refused before step 0");
        let err = common::fails(&cat(&[
            &["sweep"],
            SWEEP_MLP,
            &["--steps", "2", "--out", s(&dir.join("out")), "--tensorboard", s(&under)],
        ]));
        assert!(
            err.contains("--tensorboard") && err.contains("not a directory"),
            "{err}"
        );
        let err = common::fails(&cat(&[
            &["study"],
            SWEEP_MLP,
            &[
                "--steps",
                "3",
                "--policy",
                "allreduce",
                "--net-gbps",
                "1",
                "--target-loss",
                "0.5",
            ],
            &["--out", s(&dir.join("study-out")), "--tensorboard", s(&under)],
        ]));
        assert!(
            err.contains("--tensorboard") && err.contains("not a directory"),
            "{err}"
        );
        assert!(
            !dir.join("study-out").join("study.csv").exists(),
            "refused before a study's run"
        );
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x", "the file is left alone");
}

#[test]
fn a_failed_event_write_is_named_once_and_the_training_goes_on() {
    let dir = common::dir("tensorboard-ulimit");
    let (logdir, losses) = (dir.join("tb"), dir.join("losses.csv"));
    // 30 steps of events (112 bytes a step: over 3 kB) pass a 1-2 kB file size limit
    // (`ulimit -f 2`: blocks of 512 or 1024 bytes); the losses (about 700 bytes) do not
    let out = Command::new("sh")
        .args(["-c", "ulimit -f 2 && exec \"$0\" \"$@\""])
        .arg(common::bin())
        .args(cat(&[
            &["train"],
            MLP,
            &["--steps", "30", "--losses", s(&losses), "--tensorboard", s(&logdir)],
        ]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(
        err.contains("--tensorboard") && err.contains("file size limit"),
        "{err}"
    );
    assert_eq!(common::losses(&losses).len(), 30, "the training went on to its end");
    // what was written before the failure reads back
    if let Some(python) = tensorboard_python("a_failed_event_write_is_named_once") {
        let loss = read(&python, &logdir)["."]["train/loss"].clone();
        assert!(!loss.is_empty() && loss.len() < 30, "{loss:?}");
        assert_eq!(steps(&loss), (0..loss.len() as u64).collect::<Vec<_>>());
        for ((step, v), (_, want)) in loss.iter().zip(common::losses(&losses)) {
            f32_equal(*v, want, &format!("train/loss at step {step}"));
        }
    }
}

#[test]
fn a_study_writes_one_run_per_policy_with_its_losses_and_its_predicted_step_on_each_link() {
    let Some(python) = tensorboard_python("a_study_writes_one_run_per_policy") else {
        return;
    };
    let dir = common::dir("tensorboard-study");
    let logdir = dir.join("tb");
    let out = common::ok(&cat(&[
        &["study"],
        SWEEP_MLP,
        &["--world-size", "2", "--steps", "4", "--policy", "allreduce,fp16"],
        &[
            "--net-gbps",
            "1",
            "--net-latency-us",
            "20",
            "--predict-gbps",
            "10",
            "--predict-latency-us",
            "5",
        ],
        &["--predict-world-sizes", "4", "--target-loss", "0.5"],
        &["--out", s(&dir.join("out")), "--json", "--tensorboard", s(&logdir)],
    ]));
    let results: Vec<Value> = serde_json::from_str(out.trim()).unwrap();
    let runs = read(&python, &logdir);
    assert_eq!(
        runs.keys().collect::<Vec<_>>(),
        ["allreduce", "fp16"],
        "one run per policy"
    );
    let all: Vec<u64> = (0..4).collect();
    for r in &results {
        let run = &runs[r["policy"].as_str().unwrap()];
        // the trained world's links, one tag each; the other world size has no curve
        assert_eq!(
            run.keys().map(String::as_str).collect::<Vec<_>>(),
            [
                "predicted/step_ms_10gbps_5us",
                "predicted/step_ms_1gbps_20us",
                "train/bytes_sent",
                "train/loss",
                "train/lr",
                "train/step_ms"
            ]
        );
        let losses = common::numbers(&r["losses"]);
        assert_eq!(steps(&run["train/loss"]), all);
        for ((step, v), want) in run["train/loss"].iter().zip(&losses) {
            f32_equal(*v, *want, &format!("train/loss at step {step}"));
        }
        for (tag, p) in [("predicted/step_ms_1gbps_20us", 0), ("predicted/step_ms_10gbps_5us", 1)] {
            let want = r["predictions"][p]["step_s"].as_f64().unwrap() * 1e3;
            assert_eq!(steps(&run[tag]), all, "{tag}: every step");
            for (step, v) in &run[tag] {
                f32_equal(*v, want, &format!("{tag} at step {step}"));
            }
        }
        let sent = r["payload_bytes_per_step"].as_f64().unwrap();
        let mean = run["train/bytes_sent"].iter().map(|(_, v)| v).sum::<f64>() / 4.0;
        f32_equal(mean, sent, "the mean train/bytes_sent");
    }
}

#[test]
fn every_tag_a_help_text_names_is_a_tag_the_runs_write() {
    // the tags the tests above read back from the event files (a study's, one per link)
    let written = [
        "train/loss",
        "train/val_loss",
        "train/lr",
        "train/grad_norm",
        "train/bytes_sent",
        "train/step_ms",
        "predicted/step_ms",
        "predicted/step_ms_{G}gbps_{L}us",
    ];
    for command in ["train", "sweep", "study"] {
        let help = common::ok(&[command, "--help"]);
        let named: Vec<&str> = help
            .split(|c: char| c.is_whitespace() || "(),;`".contains(c))
            .map(|w| w.trim_end_matches(['.', ':']))
            .filter(|w| ["train/", "predicted/", "predicted_"].iter().any(|p| w.starts_with(p)) && w.len() > 6)
            .filter(|w| *w != "train/")
            .collect();
        for tag in &named {
            assert!(
                written.contains(tag),
                "brigade {command} --help names {tag}, which no run writes"
            );
        }
    }
}
