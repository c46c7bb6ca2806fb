//! A user's one-file `fn main` (`examples/own_policy.rs`) runs the whole command line with its
//! own policy added. This test binary plays that program: its `plays_the_user_program` test,
//! run alone in a child process, hands the child's arguments to `brigade_cli::run_with` with
//! the example's registry and exits with its status.

use std::process::{Command, Output};

use serde_json::Value;

use crate::common::brigade;

#[allow(dead_code)]
#[path = "../../examples/own_policy.rs"]
mod own_policy;

/// The arguments the child runs, separated by the unit separator.
const ARGS: &str = "BRIGADE_USER_MAIN_ARGS";

#[test]
fn plays_the_user_program() {
    // the parent's run of this test does nothing
    let Ok(args) = std::env::var(ARGS) else { return };
    let args = std::iter::once("brigade".to_string()).chain(args.split('\u{1f}').map(String::from));
    std::process::exit(brigade_cli::run_with(own_policy::policies(), args).into());
}

/// The example's program run on `args`.
fn user_main(args: &[&str]) -> Output {
    Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--exact",
            "user_main::plays_the_user_program",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ARGS, args.join("\u{1f}"))
        .output()
        .expect("run the user's program")
}

const RUN: [&str; 17] = [
    "train",
    "--steps",
    "3",
    "--json",
    "--quiet",
    "--model",
    "mlp",
    "--widths",
    "16,32,4",
    "--optimizer",
    "sgd",
    "--world-size",
    "2",
    "--batch-size",
    "8",
    "--threads-per-rank",
    "1",
];

/// The JSON summary of a run's stdout (the child's test harness writes around it, on its line too).
fn summary(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| serde_json::from_str::<Value>(&l[l.find('{')?..]).ok())
        .unwrap_or_else(|| panic!("no JSON summary in {stdout}"))
}

#[test]
fn a_users_main_runs_the_cli_with_its_policy_added() {
    let mine = summary(&user_main(&[&RUN[..], &["--policy", "mean:2"]].concat()));
    assert_eq!(mine["policy"], "mean:2");
    // an averaging all-reduce under another name: the built-in allreduce's run, bit for bit
    let builtin = brigade(&[&RUN[..], &["--policy", "allreduce"]].concat());
    let builtin = summary(&builtin);
    assert_eq!(mine["last_loss"], builtin["last_loss"]);
    assert_eq!(mine["sent_bytes_total"], builtin["sent_bytes_total"]);

    // its help lists the policy; the plain binary knows nothing of it
    let help = user_main(&["train", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("mean[:ARGS]: an averaging all-reduce, of your own"),
        "{help}"
    );
    let plain = brigade(&[&RUN[..], &["--policy", "mean:2"]].concat());
    assert_eq!(plain.status.code(), Some(2));
    let e = String::from_utf8_lossy(&plain.stderr);
    assert!(e.contains("unknown policy 'mean:2'"), "{e}");
    // a name nobody registered is a usage error listing the registered one
    let bad = user_main(&[&RUN[..], &["--policy", "median"]].concat());
    assert_eq!(bad.status.code(), Some(2));
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(
        e.contains("unknown policy 'median'") && e.contains("mean[:ARGS]"),
        "{e}"
    );
}

#[test]
fn a_study_refuses_a_policy_whose_tensorboard_directory_cannot_be_named_before_any_trains() {
    let d = crate::common::dir("user-study-tb-name");
    let (out, tb) = (d.join("out"), d.join("tb"));
    // a user policy's spec is its argument as typed: 300 digits make a name longer than a
    // file name may be (NAME_MAX, 255 bytes on Linux)
    let long = format!("mean:{}2", "0".repeat(300));
    let policies = format!("allreduce,{long}");
    let args = [
        &["study"][..],
        &RUN[5..],
        &["--steps", "4", "--net-gbps", "1", "--target-loss", "1"],
        &["--out", out.to_str().unwrap(), "--tensorboard", tb.to_str().unwrap()],
        &["--policy", &policies],
    ]
    .concat();
    let run = user_main(&args);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("run directory") && stderr.contains("cannot be made"),
        "{stderr}"
    );
    assert!(!tb.join("allreduce").exists(), "allreduce trained before the refusal");
}
