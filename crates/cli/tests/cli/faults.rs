//! Faults that used to lose work, provoked with real processes and real signals: two SIGTERMs
//! 1 ms apart (what GNU `timeout` sends) are one stop request; a signal while the run starts
//! ends it at once with status 130 and nothing written; a file-size limit (`ulimit -f`) is
//! reported like a full disk, naming each output it stopped, the others kept; two runs on one
//! `--checkpoint` cannot both write it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, s};

const SIGINT: i32 = 2;
const SIGTERM: i32 = 15;

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// The small MLP of these tests (batch 8: steps of milliseconds).
const MLP: &[&str] = &[
    "--model",
    "mlp",
    "--widths",
    "16,32,32,4",
    "--batch-size",
    "8",
    "--quiet",
];

/// `brigade train ARGS`, with SIGINT and SIGTERM at their default action in the child (a shell
/// that starts this suite in the background ignores SIGINT for its children, and brigade keeps
/// an ignored signal ignored), stdout discarded and stderr piped.
fn start(args: &[&str]) -> Child {
    let mut cmd = Command::new(common::bin());
    // SAFETY: `signal` is async-signal-safe, which is all a pre-exec hook may call.
    unsafe {
        cmd.pre_exec(|| {
            common::default_disposition();
            Ok(())
        });
    }
    cmd.arg("train")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start brigade")
}

/// Sends `sig` to `child`.
fn send(child: &Child, sig: i32) {
    // SAFETY: kill(2) with a pid this test spawned and has not reaped.
    assert_eq!(unsafe { kill(child.id() as i32, sig) }, 0, "kill failed");
}

/// Waits (at most `limit`) for `child` to end: its status and its stderr.
fn finish(mut child: Child, limit: Duration) -> (ExitStatus, String) {
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("brigade still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let err = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    (status, err)
}

/// Waits (at most 120 s) until `path` exists, failing if `child` ends first.
fn wait_for_file(child: &mut Child, path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !path.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("brigade ended before writing {}: {status}", path.display());
        }
        assert!(Instant::now() < deadline, "no {} within 120 s", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The step a checkpoint was written at.
fn checkpoint_step(path: &Path) -> usize {
    let (_, meta) = brigade_models::load_safetensors_with_metadata(path).unwrap();
    meta["step"].parse().unwrap()
}

/// Kills the process `0` if the test fails before it ended (a long run must not outlive it).
struct KillOnPanic(u32);

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // SAFETY: kill(2) of a process this test spawned.
            unsafe { kill(self.0 as i32, 9) };
        }
    }
}

/// A long run that checkpoints every 3 steps, writing `ck.safetensors` and `losses.csv` in `dir`.
fn long_run(dir: &Path) -> (Child, PathBuf, PathBuf) {
    let (ck, losses) = (dir.join("ck.safetensors"), dir.join("losses.csv"));
    let mut args = MLP.to_vec();
    args.extend(["--lr", "0.01", "--steps", "100000000", "--world-size", "2"]);
    args.extend([
        "--checkpoint-every",
        "3",
        "--checkpoint",
        s(&ck),
        "--losses",
        s(&losses),
    ]);
    (start(&args), ck, losses)
}

/// Checks an interrupted long run: status 130, every finished step in the losses, the
/// checkpoint at the last of them, and no other file left in `dir` but `also`.
fn kept_its_work(status: ExitStatus, err: &str, dir: &Path, ck: &Path, losses: &Path, also: &[&str]) {
    assert_eq!(status.code(), Some(130), "{status}: {err}");
    assert!(err.contains("interrupted after step"), "{err}");
    let rows = common::losses(losses);
    assert!(
        rows.len() >= 3,
        "at least the steps before the first checkpoint: {rows:?}"
    );
    let steps: Vec<usize> = rows.iter().map(|r| r.0).collect();
    assert_eq!(steps, (0..rows.len()).collect::<Vec<_>>());
    assert_eq!(checkpoint_step(ck), rows.len(), "checkpointed after the last step done");
    let mut expected = vec!["ck.safetensors".to_string(), "losses.csv".to_string()];
    expected.extend(also.iter().map(|s| s.to_string()));
    expected.sort();
    assert_eq!(names(dir), expected, "temporary or lock files left behind");
}

#[test]
fn two_sigterms_1ms_apart_are_one_request_and_keep_the_work() {
    let dir = common::dir("faults-double-term");
    let (mut child, ck, losses) = long_run(&dir);
    let _guard = KillOnPanic(child.id());
    wait_for_file(&mut child, &ck); // trained: a periodic checkpoint exists
                                    // what GNU `timeout` does: the signal to the child, then to its process group
    send(&child, SIGTERM);
    std::thread::sleep(Duration::from_millis(1));
    send(&child, SIGTERM);
    let (status, err) = finish(child, Duration::from_secs(120));
    kept_its_work(status, &err, &dir, &ck, &losses, &[]);
}

/// Whether `pid` catches SIGTERM (its handler is installed): bit 15 of `SigCgt` in its status.
fn catches_sigterm(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (SIGTERM - 1)) != 0)
}

/// How many threads `pid` runs.
fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count())
}

#[test]
fn a_signal_while_starting_ends_the_run_at_once_with_nothing_written() {
    for (sig, name) in [(SIGTERM, "term"), (SIGINT, "int")] {
        let dir = common::dir(&format!("faults-setup-{name}"));
        let (ck, losses, save) = (
            dir.join("ck.safetensors"),
            dir.join("losses.csv"),
            dir.join("final.safetensors"),
        );
        // a model whose start (initialising and broadcasting 13M parameters) takes seconds
        let mut child = start(&[
            "--model",
            "mlp",
            "--widths",
            "16,2048,2048,2048,2048,4",
            "--batch-size",
            "8",
            "--quiet",
            "--steps",
            "5",
            "--world-size",
            "2",
            "--checkpoint",
            s(&ck),
            "--losses",
            s(&losses),
            "--save",
            s(&save),
        ]);
        let _guard = KillOnPanic(child.id());
        // signal it once its handler is installed and its two rank threads run: it is
        // starting them (building, initialising and broadcasting the model takes seconds)
        let deadline = Instant::now() + Duration::from_secs(60);
        while !(catches_sigterm(child.id()) && threads(child.id()) >= 3) {
            assert!(
                child.try_wait().unwrap().is_none(),
                "ended before installing its handler"
            );
            assert!(Instant::now() < deadline, "no signal handler within 60 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        send(&child, sig);
        let started = Instant::now();
        let (status, err) = finish(child, Duration::from_secs(60));
        assert_eq!(status.code(), Some(130), "{name}: {status}: {err}");
        assert!(err.contains("before step 0"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "not prompt: {:?}",
            started.elapsed()
        );
        assert_eq!(
            names(&dir),
            Vec::<String>::new(),
            "a run stopped while starting writes nothing"
        );
    }
}

#[test]
fn a_file_size_limit_is_reported_like_a_full_disk_and_the_other_outputs_kept() {
    let dir = common::dir("faults-ulimit");
    let (ck, losses, save) = (
        dir.join("ck.safetensors"),
        dir.join("losses.csv"),
        dir.join("final.safetensors"),
    );
    // 71k parameters: each of --save and --checkpoint is over 280 kB; the losses are bytes
    let out = Command::new("sh")
        .args(["-c", "ulimit -f 64 && exec \"$0\" \"$@\""])
        .arg(common::bin())
        .args([
            "train",
            "--model",
            "mlp",
            "--widths",
            "16,256,256,4",
            "--batch-size",
            "8",
            "--quiet",
        ])
        .args([
            "--steps",
            "2",
            "--checkpoint",
            s(&ck),
            "--losses",
            s(&losses),
            "--save",
            s(&save),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    for flag in ["--save", "--checkpoint"] {
        assert!(err.contains(flag), "{flag} not named: {err}");
    }
    assert!(err.contains("file size limit"), "{err}");
    assert!(!err.contains("writable?"), "{err}");
    assert_eq!(common::losses(&losses).len(), 2, "the losses are kept");
    assert_eq!(names(&dir), ["losses.csv"], "partial or temporary files left behind");
}

#[test]
fn a_second_run_on_one_checkpoint_refuses_naming_the_file_and_the_other_process() {
    let dir = common::dir("faults-lock");
    let (mut first, ck, losses) = long_run(&dir);
    let _guard = KillOnPanic(first.id());
    wait_for_file(&mut first, &ck);
    let other_losses = dir.join("other.csv");
    let mut args = vec!["train"];
    args.extend(MLP);
    args.extend(["--steps", "2", "--checkpoint", s(&ck), "--losses", s(&other_losses)]);
    let err = common::fails(&args);
    assert!(err.contains(s(&ck)), "the file is named: {err}");
    assert!(
        err.contains(&first.id().to_string()),
        "the other process is named: {err}"
    );
    assert!(!other_losses.exists(), "the refused run wrote nothing");
    send(&first, SIGTERM);
    let (status, err) = finish(first, Duration::from_secs(120));
    kept_its_work(status, &err, &dir, &ck, &losses, &[]);
    // the lock ended with its run: the same checkpoint can be written again
    common::ok(&args);
    assert!(other_losses.exists());
}

/// Ctrl-C on `mpirun`: it waits `odls_base_sigkill_timeout` seconds (1 by default), sends the
/// ranks SIGTERM, and SIGKILL as long after. With the time raised (docs/MPI.md), the
/// ranks finish their step and rank 0 writes every output.
#[cfg(feature = "mpi")]
mod under_mpirun {
    use super::*;

    /// Starts a long 2-rank MPI run whose steps and checkpoints take a while (4M parameters),
    /// waits for its first periodic checkpoint, sends SIGINT to `mpirun` (what Ctrl-C does to
    /// it), and checks the outputs hold every finished step.
    fn ctrl_c_keeps_the_work(sigkill_timeout_s: &str) {
        let dir = common::dir(&format!("faults-mpirun-{sigkill_timeout_s}"));
        let (ck, losses) = (dir.join("ck.safetensors"), dir.join("losses.csv"));
        let mut cmd = Command::new("mpirun");
        // SAFETY: `signal` is async-signal-safe, which is all a pre-exec hook may call.
        unsafe {
            cmd.pre_exec(|| {
                common::default_disposition();
                Ok(())
            });
        }
        let mut job = cmd
            .args(["--allow-run-as-root", "--oversubscribe"])
            .args(["--mca", "odls_base_sigkill_timeout", sigkill_timeout_s, "-np", "2"])
            .arg(common::bin())
            .args([
                "train",
                "--backend",
                "mpi",
                "--model",
                "mlp",
                "--widths",
                "16,2048,2048,4",
            ])
            .args([
                "--batch-size",
                "64",
                "--quiet",
                "--steps",
                "100000000",
                "--checkpoint-every",
                "3",
            ])
            .args(["--checkpoint", s(&ck), "--losses", s(&losses)])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun must be on the PATH (apt-get install openmpi-bin)");
        let _guard = KillOnPanic(job.id());
        wait_for_file(&mut job, &ck);
        send(&job, SIGINT);
        let (status, err) = finish(job, Duration::from_secs(120));
        let rows = if losses.exists() {
            common::losses(&losses)
        } else {
            vec![]
        };
        assert!(
            rows.len() >= 3,
            "the losses of the finished steps ({status}): {rows:?}\n{err}"
        );
        let steps: Vec<usize> = rows.iter().map(|r| r.0).collect();
        assert_eq!(steps, (0..rows.len()).collect::<Vec<_>>());
        assert_eq!(
            checkpoint_step(&ck),
            rows.len(),
            "checkpointed after the last step done"
        );
        assert_eq!(
            names(&dir),
            ["ck.safetensors", "losses.csv"],
            "temporary or lock files left"
        );
    }

    #[test]
    fn ctrl_c_on_mpirun_with_time_to_stop_keeps_every_output() {
        ctrl_c_keeps_the_work("15");
    }
}
