//! SIGINT and SIGTERM against real processes: a sweep keeps the runs that finished, and a
//! second signal, later than the grace of the first, still ends a run with its outputs written
//! and its lock files gone.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::{self, bin, losses, s, send_signal, wait_for_file, wait_to_end, MLP};

/// `brigade args...` started with SIGINT and SIGTERM at their default action (a shell that
/// starts the suite in the background ignores SIGINT for its children, which brigade keeps).
fn start(args: &[&str]) -> Child {
    let mut cmd = Command::new(bin());
    // SAFETY: `signal` is async-signal-safe, which is all a pre-exec hook may call.
    unsafe {
        cmd.pre_exec(|| {
            common::default_disposition();
            Ok(())
        });
    }
    cmd.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start brigade")
}

/// Starts the sweep `args`, sends it SIGINT after a wait, and returns its stderr and the
/// `csv` it wrote of the runs that finished. A sweep writes nothing until it ends, so whether a
/// run has finished when the signal comes is the machine's pace: a try where none had (the
/// sweep says so, exits 130 and writes nothing, as it must) is made again with twice the wait,
/// so that a loaded machine makes the test slower, not failed.
fn interrupt_once_a_run_finished(args: &[&str], csv: &Path) -> (String, String) {
    for wait_ms in [1500, 3000, 6000, 12000, 24000, 48000] {
        let mut child = start(args);
        std::thread::sleep(Duration::from_millis(wait_ms));
        send_signal(&child, "INT");
        let (status, err) = wait_to_end(&mut child);
        assert_eq!(status.code(), Some(130), "{err}");
        assert!(!err.contains("panicked") && err.contains("interrupted"), "{err}");
        match std::fs::read_to_string(csv) {
            Ok(text) => return (err, text),
            Err(_) => assert!(err.contains("nothing was written"), "{err}"),
        }
    }
    panic!("no run of the sweep finished within 48 s, in six tries");
}

#[test]
fn an_interrupted_sweep_writes_the_runs_that_finished_and_exits_130() {
    let d = common::dir("signal-sweep");
    let out = d.join("out");
    // many caps, many rounds: the sweep is still running when the signal comes
    let (_, csv) = interrupt_once_a_run_finished(
        &common::cat(&[
            &["sweep"],
            &MLP[..MLP.len() - 1],
            &["--world-size", "2", "--steps", "4", "--repeat", "1000"],
            &["--bucket-mb", "0.001,0.002,0.004,0.008", "--out", s(&out)],
        ]),
        &out.join("sweep.csv"),
    );
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert!(!rows.is_empty() && rows.len() <= 4, "{csv}");
    // each row counts the runs of its cap that finished, fewer than asked
    let runs = csv
        .lines()
        .next()
        .unwrap()
        .split(',')
        .position(|c| c == "runs")
        .unwrap();
    for row in rows {
        let n: usize = row.split(',').nth(runs).unwrap().parse().unwrap();
        assert!((1..1000).contains(&n), "{row}");
    }
}

#[test]
fn a_second_sigint_after_the_grace_still_writes_the_losses_and_removes_the_locks() {
    let d = common::dir("signal-twice");
    let (ck, l) = (d.join("ck.safetensors"), d.join("losses.csv"));
    // a slow link: every message takes 0.35 s, so that after the first checkpoint the run
    // trains on for about 8 messages (2.8 s), past the signals' gap of 1.5 s
    let mut child = start(&common::cat(&[
        &["train"],
        MLP,
        &[
            "--world-size",
            "2",
            "--steps",
            "1000",
            "--net-gbps",
            "1",
            "--net-latency-us",
            "350000",
        ],
        &["--checkpoint", s(&ck), "--checkpoint-every", "1", "--losses", s(&l)],
    ]));
    wait_for_file(&mut child, &ck);
    send_signal(&child, "INT");
    std::thread::sleep(Duration::from_millis(1500));
    send_signal(&child, "INT");
    let (status, err) = wait_to_end(&mut child);
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted after step"), "{err}");
    let steps: Vec<usize> = losses(&l).iter().map(|r| r.0).collect();
    assert!(!steps.is_empty(), "{err}");
    assert_eq!(steps, (0..steps.len()).collect::<Vec<_>>());
    let mut names: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["ck.safetensors", "losses.csv"],
        "lock or temporary files left behind"
    );
}

#[test]
fn an_interrupted_policy_sweep_writes_the_policies_that_finished_and_exits_130() {
    let d = common::dir("signal-policy-sweep");
    let out = d.join("out");
    let policies = "allreduce,fp16,bf16,powersgd:1,powersgd:2,zero1,zero2";
    let (_, csv) = interrupt_once_a_run_finished(
        &common::cat(&[
            &["sweep"],
            &MLP[..MLP.len() - 1],
            // long enough that no machine finishes all seven runs before the signal (here one
            // run takes about 1 s, so one has finished after the first try's 1.5 s; a machine
            // that finished none by then is slower than that, and so after the longer waits of
            // the next tries)
            &["--world-size", "2", "--steps", "5000"],
            &["--policy", policies, "--out", s(&out)],
        ]),
        &out.join("policies.csv"),
    );
    assert!((1..7).contains(&csv.lines().skip(1).count()), "{csv}");
}
