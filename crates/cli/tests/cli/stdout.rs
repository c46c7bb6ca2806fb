//! A stdout that fails (a reader that went away, a full disk) costs nothing but the text: every
//! subcommand writes its files first, never panics, and says in one line what failed, except
//! for a closed pipe, which is what `brigade ... | head` does and is no error.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::common::{bin, cat, dir, ok, s, GPT, MLP};

/// Runs `brigade args` with a stdout whose reader has gone before anything is written.
fn closed_pipe(args: &[&str]) -> Output {
    let mut child = Command::new(bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run brigade");
    drop(child.stdout.take());
    child.wait_with_output().expect("wait for brigade")
}

/// Runs `brigade args` with stdout on `/dev/full` (every write fails: no space left).
fn full_disk(args: &[&str]) -> Output {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    Command::new(bin())
        .args(args)
        .stdout(full)
        .output()
        .expect("run brigade")
}

/// Checks the two ways stdout fails for `args`, with `outputs` (made afresh by each run)
/// written both times.
fn check(args: &[&str], outputs: &[&Path]) {
    let clear = || outputs.iter().for_each(|p| drop(std::fs::remove_file(p)));
    clear();
    let out = closed_pipe(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{args:?}, closed pipe: {err}");
    assert_eq!(out.status.code(), Some(0), "{args:?}, closed pipe: {err}");
    for p in outputs {
        assert!(p.exists(), "{args:?}, closed pipe: {} not written", p.display());
    }
    clear();
    let out = full_disk(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{args:?}, /dev/full: {err}");
    assert_eq!(out.status.code(), Some(1), "{args:?}, /dev/full: {err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("stdout"),
        "{args:?}, /dev/full: {err}"
    );
    for p in outputs {
        assert!(p.exists(), "{args:?}, /dev/full: {} not written", p.display());
    }
}

#[test]
fn train_writes_every_output_before_a_stdout_that_fails() {
    let d = dir("stdout-train");
    let (losses, save, plot, timeline, ck, profile) = (
        d.join("losses.csv"),
        d.join("w.safetensors"),
        d.join("loss.svg"),
        d.join("tl.json"),
        d.join("c.ckpt"),
        d.join("p.json"),
    );
    let base = cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "3",
            "--world-size",
            "2",
            "--losses",
            s(&losses),
            "--save",
            s(&save),
        ],
        &["--plot", s(&plot), "--timeline", s(&timeline), "--checkpoint", s(&ck)],
        &["--profile", s(&profile)],
    ]);
    let outputs = [&losses, &save, &plot, &timeline, &ck, &profile].map(|p| p.as_path());
    check(&base, &outputs);
    check(&cat(&[&base, &["--json"]]), &outputs);
    // what the profile predicts, printed to the same stdouts
    check(&["predict", "--profile", s(&profile), "--measured-link"], &[]);
    check(&["predict", "--profile", s(&profile), "--measured-link", "--json"], &[]);
}

#[test]
fn sweep_and_bench_end_cleanly_on_a_stdout_that_fails() {
    let d = dir("stdout-sweep");
    let model: Vec<&str> = MLP.iter().copied().filter(|a| *a != "--quiet").collect();
    let csv = d.join("sweep").join("sweep.csv");
    std::fs::create_dir_all(d.join("sweep")).unwrap();
    check(
        &cat(&[
            &["sweep"],
            &model,
            &["--world-size", "2", "--steps", "2", "--bucket-mb", "0.25,1"],
            &["--out", s(&d.join("sweep"))],
        ]),
        &[&csv],
    );
    check(
        &["bench", "comm", "--world-size", "2", "--sizes", "1K", "--iters", "2"],
        &[],
    );
    check(&["bench", "gemm", "--shapes", "8x8x8", "--reps", "1"], &[]);
}

#[test]
fn sample_ends_cleanly_on_a_stdout_that_fails() {
    let d = dir("stdout-sample");
    let ckpt = d.join("gpt.ckpt");
    ok(&cat(&[&["train"], GPT, &["--steps", "1", "--checkpoint", s(&ckpt)]]));
    check(
        &[
            "sample",
            "--checkpoint",
            s(&ckpt),
            "--prompt",
            "the ",
            "--max-new-tokens",
            "20",
        ],
        &[],
    );
}
