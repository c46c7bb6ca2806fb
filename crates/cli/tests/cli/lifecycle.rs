//! How a run ends: a non-finite loss stops every rank with one error naming the step and keeps
//! the last good checkpoint; SIGINT/SIGTERM stop after a step with every output written and
//! exit 130; zero steps and a resume at the last step still checkpoint.

use crate::common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use brigade_models::load_safetensors_with_metadata;

const MLP: &[&str] = &[
    "--model",
    "mlp",
    "--widths",
    "16,32,32,4",
    "--batch-size",
    "8",
    "--quiet",
];

fn brigade(args: &[&str]) -> Output {
    Command::new(crate::common::bin())
        .args(args)
        .output()
        .expect("run brigade")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A fresh directory for one test (tests of this binary run as threads of one process).
fn tmp_dir(test: &str) -> common::Scratch {
    static N: AtomicUsize = AtomicUsize::new(0);
    common::dir(&format!("lifecycle-{}-{test}", N.fetch_add(1, Ordering::SeqCst)))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `(step recorded in the checkpoint, every value of every tensor)`.
fn checkpoint(path: &Path) -> (usize, Vec<f64>) {
    let (tensors, meta) = load_safetensors_with_metadata(path).unwrap();
    let values = tensors.iter().flat_map(|(_, t)| t.to_f64_vec().unwrap()).collect();
    (meta["step"].parse().unwrap(), values)
}

fn loss_rows(path: &Path) -> Vec<(usize, f64)> {
    common::losses(path)
}

/// The one `error:` line of a failed run, checked to be one line with no panic.
fn one_error_line(out: &Output) -> String {
    let err = stderr(out);
    assert!(!out.status.success(), "should fail: {err}");
    assert!(!err.contains("panicked"), "{err}");
    // (a resume that changes a hyperparameter says so first, in its own note line)
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("note: resuming with"))
        .collect();
    assert_eq!(lines.len(), 1, "one error line: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    lines[0].to_string()
}

/// The step an error line names (`error: step N: ...`).
fn named_step(line: &str) -> usize {
    let rest = line
        .strip_prefix("error: step ")
        .unwrap_or_else(|| panic!("no step named: {line}"));
    rest.split(':').next().unwrap().parse().unwrap()
}

#[test]
fn a_nonfinite_loss_stops_every_rank_with_one_line_naming_the_step() {
    let dir = tmp_dir("nonfinite");
    for world in ["1", "2"] {
        let losses = dir.join(format!("losses-{world}.csv"));
        let started = Instant::now();
        let out = brigade(
            &[
                &["train"],
                MLP,
                &[
                    "--lr",
                    "1e30",
                    "--steps",
                    "50",
                    "--world-size",
                    world,
                    "--timeout-s",
                    "60",
                ],
                &["--losses", s(&losses)],
            ]
            .concat(),
        );
        let line = one_error_line(&out);
        assert!(
            line.contains("the loss") && line.contains("--allow-nonfinite"),
            "{line}"
        );
        let step = named_step(&line);
        assert!((1..50).contains(&step), "{line}");
        assert!(
            started.elapsed() < Duration::from_secs(50),
            "world {world}: a rank waited for its timeout instead of stopping"
        );
        // With the opt-out the run finishes, NaN and all.
        let out = brigade(
            &[
                &["train"],
                MLP,
                &[
                    "--lr",
                    "1e30",
                    "--steps",
                    "6",
                    "--world-size",
                    world,
                    "--allow-nonfinite",
                ],
                &["--losses", s(&losses)],
            ]
            .concat(),
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let rows = loss_rows(&losses);
        assert_eq!(rows.len(), 6);
        assert!(rows.iter().any(|(_, l)| !l.is_finite()), "{rows:?}");
    }
}

#[test]
fn divergence_never_overwrites_the_last_good_checkpoint() {
    let dir = tmp_dir("keep-checkpoint");
    let ck = dir.join("ck.safetensors");
    let sane = brigade(
        &[
            &["train"],
            MLP,
            &[
                "--lr",
                "0.01",
                "--steps",
                "2",
                "--world-size",
                "2",
                "--checkpoint",
                s(&ck),
            ],
        ]
        .concat(),
    );
    assert!(sane.status.success(), "{}", stderr(&sane));
    assert_eq!(checkpoint(&ck).0, 2);
    // Resume with a learning rate that diverges, checkpointing after every step.
    let out = brigade(
        &[
            &["train"],
            MLP,
            &["--lr", "1e30", "--steps", "50", "--world-size", "2"],
            &["--resume", s(&ck), "--checkpoint", s(&ck), "--checkpoint-every", "1"],
        ]
        .concat(),
    );
    let line = one_error_line(&out);
    let failed_at = named_step(&line);
    let (step, values) = checkpoint(&ck);
    // The state the failing step started from gave the non-finite loss: it is not good, even
    // with finite values (a periodic checkpoint is written only once its step's loss is finite).
    assert!(
        step < failed_at,
        "the checkpoint (step {step}) is the state the failing step {failed_at} started from"
    );
    assert!(
        values.iter().all(|v| v.is_finite()),
        "the checkpoint holds non-finite values after: {line}"
    );
    // and it trains on: its next step's loss is finite
    let on = brigade(
        &[
            &["train"],
            MLP,
            &["--lr", "1e30", "--steps", &(step + 1).to_string(), "--world-size", "2"],
            &["--resume", s(&ck)],
        ]
        .concat(),
    );
    assert!(on.status.success(), "resuming the kept checkpoint: {}", stderr(&on));
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["ck.safetensors"], "temporary files left behind");
}

/// Starts a long run, waits until it has provably trained (the first periodic checkpoint
/// exists), sends `signal`, and checks exit status 130 and every output.
fn interrupted_run_keeps_its_work(signal: &str, world: &str) {
    let dir = tmp_dir(&format!("signal-{signal}"));
    let (ck, losses, tl) = (dir.join("ck.safetensors"), dir.join("losses.csv"), dir.join("tl.json"));
    let mut child = Command::new(crate::common::bin());
    // brigade keeps a signal that it was started with ignored ignored (as `nohup` wants), and a
    // shell that starts this suite in the background ignores SIGINT for its children: the
    // child gets the default disposition back, so the test does not depend on how it was run.
    // SAFETY: `signal` is async-signal-safe, which is all a pre-exec hook may call.
    unsafe {
        child.pre_exec(|| {
            common::default_disposition();
            Ok(())
        });
    }
    let mut child = child
        .arg("train")
        .args(MLP)
        .args([
            "--lr",
            "0.01",
            "--steps",
            "100000000",
            "--world-size",
            world,
            "--checkpoint-every",
            "3",
        ])
        .args(["--checkpoint", s(&ck), "--losses", s(&losses), "--timeline", s(&tl)])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start brigade");
    let (status, err) = common::signal_after_first_checkpoint(&mut child, &ck, signal);
    assert_eq!(status.code(), Some(130), "SIG{signal}: {err}");
    assert!(err.contains("interrupted after step"), "{err}");
    let rows = loss_rows(&losses);
    let steps: Vec<usize> = rows.iter().map(|(s, _)| *s).collect();
    assert!(
        rows.len() >= 3,
        "at least the steps before the first checkpoint: {rows:?}"
    );
    assert_eq!(steps, (0..rows.len()).collect::<Vec<_>>(), "every step done, in order");
    assert!(rows.iter().all(|(_, l)| l.is_finite()));
    assert_eq!(
        checkpoint(&ck).0,
        rows.len(),
        "the checkpoint is taken after the last step done"
    );
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tl).unwrap()).unwrap();
    let last = format!("step {}", rows.len() - 1);
    assert!(
        trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == last.as_str()),
        "the timeline shows the last step done"
    );
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["ck.safetensors", "losses.csv", "tl.json", "tl.svg"],
        "temporary files left behind"
    );
}

#[test]
fn sigint_stops_after_a_step_and_writes_everything() {
    interrupted_run_keeps_its_work("INT", "2");
}

#[test]
fn sigterm_stops_after_a_step_and_writes_everything() {
    interrupted_run_keeps_its_work("TERM", "1");
}

#[test]
fn zero_steps_and_a_resume_at_the_last_step_still_checkpoint() {
    let dir = tmp_dir("zero-steps");
    let (ck0, ck2, ck2b, losses) = (
        dir.join("ck0.safetensors"),
        dir.join("ck2.safetensors"),
        dir.join("ck2b.safetensors"),
        dir.join("l.csv"),
    );
    let out = brigade(&[&["train"], MLP, &["--steps", "0", "--checkpoint", s(&ck0)]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(checkpoint(&ck0).0, 0);
    let out = brigade(
        &[
            &["train"],
            MLP,
            &["--steps", "2", "--world-size", "2", "--checkpoint", s(&ck2)],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = brigade(
        &[
            &["train"],
            MLP,
            &[
                "--steps",
                "2",
                "--world-size",
                "2",
                "--resume",
                s(&ck2),
                "--checkpoint",
                s(&ck2b),
                "--losses",
                s(&losses),
            ],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        checkpoint(&ck2b),
        checkpoint(&ck2),
        "nothing to run: the same state, checkpointed again"
    );
    assert!(loss_rows(&losses).is_empty());
}
