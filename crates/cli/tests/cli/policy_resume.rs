//! `brigade train` checkpoints the reducer policy's state: a PowerSGD run stopped by SIGINT
//! after its start iteration resumes exactly (losses and every tensor of the final checkpoint,
//! the policy's state included, equal a straight run's), and a checkpoint resumes only under the
//! policy it was written with.

use crate::common::{self, brigade, cat, fails, ok, s, MLP};

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use brigade_models::load_safetensors_with_metadata;

/// PowerSGD of rank 1 from iteration 2, on two ranks: the first periodic checkpoint (step 3)
/// is after the start iteration.
const POWERSGD: &[&str] = &[
    "--comm-hook",
    "powersgd",
    "--powersgd-rank",
    "1",
    "--powersgd-start-iter",
    "2",
    "--world-size",
    "2",
];

/// Every tensor of a checkpoint by name, and its metadata's policy.
fn tensors(path: &Path) -> (Vec<(String, Vec<f64>)>, Option<String>) {
    let (tensors, meta) = load_safetensors_with_metadata(path).unwrap();
    let mut out: Vec<_> = tensors.into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    (out, meta.get("policy").cloned())
}

#[test]
fn powersgd_stopped_by_sigint_resumes_exactly() {
    let dir = common::dir("policy-resume-sigint");
    let (ck, l1) = (dir.join("ck.safetensors"), dir.join("l1.csv"));
    let mut child = Command::new(common::bin());
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
        .args(POWERSGD)
        .args(["--steps", "100000000", "--checkpoint-every", "3"])
        .args(["--checkpoint", s(&ck), "--losses", s(&l1)])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start brigade");
    let (status, err) = common::signal_after_first_checkpoint(&mut child, &ck, "INT");
    assert_eq!(status.code(), Some(130), "{err}");
    let first = common::losses(&l1);
    let n = first.len();
    assert!(n >= 3, "{first:?}");
    let (saved, policy) = tensors(&ck);
    assert_eq!(policy.as_deref(), Some("powersgd:1@2"));
    for r in 0..2 {
        let prefix = format!("policy.rank{r}/");
        assert!(saved.iter().any(|(k, _)| k.starts_with(&prefix)), "rank {r}'s state");
    }

    // resume to n + 4 steps, against n + 4 straight steps
    let end = (n + 4).to_string();
    let (ck2, l2, ck3, l3) = (
        dir.join("ck2.safetensors"),
        dir.join("l2.csv"),
        dir.join("ck3.safetensors"),
        dir.join("l3.csv"),
    );
    ok(&cat(&[
        &["train"],
        MLP,
        POWERSGD,
        &[
            "--steps",
            &end,
            "--resume",
            s(&ck),
            "--checkpoint",
            s(&ck2),
            "--losses",
            s(&l2),
        ],
    ]));
    ok(&cat(&[
        &["train"],
        MLP,
        POWERSGD,
        &["--steps", &end, "--checkpoint", s(&ck3), "--losses", s(&l3)],
    ]));
    let mut resumed = first;
    resumed.extend(common::losses(&l2));
    assert_eq!(resumed, common::losses(&l3), "losses, bit for bit");
    assert!(
        tensors(&ck2) == tensors(&ck3),
        "every tensor of the final checkpoints, bit for bit"
    );
}

#[test]
fn a_resume_under_another_policy_is_one_error_line_naming_both() {
    let dir = common::dir("policy-resume-other");
    let ck = dir.join("ck.safetensors");
    ok(&cat(&[
        &["train"],
        MLP,
        POWERSGD,
        &["--steps", "3", "--checkpoint", s(&ck)],
    ]));
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--world-size",
            "2",
            "--comm-hook",
            "fp16",
            "--steps",
            "5",
            "--resume",
            s(&ck),
        ],
    ]));
    assert!(e.contains("'powersgd:1@2'") && e.contains("'fp16'"), "{e}");
    // the same policy resumes
    let out = brigade(&cat(&[
        &["train"],
        MLP,
        POWERSGD,
        &["--steps", "5", "--resume", s(&ck)],
    ]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn int8_resumed_on_the_buckets_ddp_regrouped_is_the_straight_run() {
    // a half-MiB cap: the ready order after step 0 moves a bias to the other bucket, and int8
    // quantizes each bucket with one scale
    let dir = common::dir("policy-resume-int8");
    let base: &[&str] = &[
        "train",
        "--model",
        "mlp",
        "--widths",
        "128,512,512,10",
        "--world-size",
        "2",
        "--policy",
        "int8",
        "--bucket-mb",
        "0.5",
        "--optimizer",
        "sgd",
        "--momentum",
        "0.9",
        "--quiet",
    ];
    let (ck, l1, l2, straight) = (
        dir.join("ck.safetensors"),
        dir.join("l1.csv"),
        dir.join("l2.csv"),
        dir.join("straight.csv"),
    );
    ok(&cat(&[
        base,
        &["--steps", "30", "--checkpoint", s(&ck), "--losses", s(&l1)],
    ]));
    ok(&cat(&[
        base,
        &["--steps", "60", "--resume", s(&ck), "--losses", s(&l2)],
    ]));
    ok(&cat(&[base, &["--steps", "60", "--losses", s(&straight)]]));
    let mut resumed = common::losses(&l1);
    resumed.extend(common::losses(&l2));
    assert_eq!(resumed.len(), 60);
    assert_eq!(resumed, common::losses(&straight), "losses, bit for bit");
}

#[test]
fn a_resume_under_the_autotuner_continues_its_checks_and_buckets_as_the_straight_run() {
    // auto starts at 25 MiB (one bucket) and must adopt its only candidate, half a MiB (several
    // buckets), at its first check whatever the recorded step predicts (a gain of -1e9), then
    // re-checks every 4 steps (after steps 0, 4, 8). The checkpoint at step 6 stands between
    // two checks: the resume must run on the half-MiB buckets and check after step 8 only.
    let dir = common::dir("policy-resume-autotune");
    let base: &[&str] = &[
        "train",
        "--model",
        "mlp",
        "--widths",
        "128,512,512,10",
        "--world-size",
        "2",
        "--bucket-mb",
        "auto",
        "--autotune-caps",
        "0.5",
        "--autotune-min-gain",
        "-1e9",
        "--autotune-every",
        "4",
        "--optimizer",
        "sgd",
        "--momentum",
        "0.9",
        "--quiet",
        "--json",
    ];
    let checks = |json: &str| -> Vec<u64> {
        let summary: serde_json::Value = serde_json::from_str(json).unwrap();
        let decisions = summary["autotune"]["decisions"].as_array().unwrap().clone();
        decisions.iter().map(|d| d["after_step"].as_u64().unwrap()).collect()
    };
    let (ck, l, straight) = (dir.join("ck.safetensors"), dir.join("l.csv"), dir.join("straight.csv"));
    let (ck_resumed, ck_straight) = (
        dir.join("end-resumed.safetensors"),
        dir.join("end-straight.safetensors"),
    );
    ok(&cat(&[
        base,
        &["--steps", "6", "--checkpoint", s(&ck), "--losses", s(&l)],
    ]));
    let resumed = ok(&cat(&[
        base,
        &["--steps", "12", "--resume", s(&ck), "--losses", s(&l)],
        &["--checkpoint", s(&ck_resumed)],
    ]));
    assert_eq!(checks(&resumed), [8], "the resume checks where the straight run does");
    let whole = ok(&cat(&[
        base,
        &[
            "--steps",
            "12",
            "--losses",
            s(&straight),
            "--checkpoint",
            s(&ck_straight),
        ],
    ]));
    assert_eq!(checks(&whole), [0, 4, 8]);
    assert_eq!(common::losses(&l).len(), 12);
    assert_eq!(common::losses(&l), common::losses(&straight), "losses, bit for bit");
    // the final checkpoints: the same tensors, buckets, caps and checks
    let (end, end_straight) = (
        load_safetensors_with_metadata(&ck_resumed).unwrap().1,
        load_safetensors_with_metadata(&ck_straight).unwrap().1,
    );
    for key in [
        "buckets",
        "bucket_caps_mb",
        "bucket_generation",
        "autotune_checks",
        "autotune_since_check",
    ] {
        assert!(end.contains_key(key), "{key}: {end:?}");
        assert_eq!(end.get(key), end_straight.get(key), "{key}");
    }
    assert_eq!(end["autotune_checks"], "3");
    assert_eq!(end["autotune_since_check"], "3");
    assert!(
        tensors(&ck_resumed) == tensors(&ck_straight),
        "every tensor, bit for bit"
    );
}

#[test]
fn diloco_and_streaming_diloco_resume_exactly_at_a_sync_and_mid_period() {
    // H = 4: DiLoCo syncs after steps 4 and 8; streaming DiLoCo issues fragment 0 after steps 4
    // and 8 and fragment 1 after steps 2, 6 and 10, each merged one step later: the checkpoint
    // after step 4 is at a sync (streaming: fragment 0 in flight), after step 6 mid-period
    // (streaming: fragment 1 in flight)
    let dir = common::dir("policy-resume-diloco");
    for policy in ["diloco:4", "streaming-diloco:4:2"] {
        let base: &[&str] = &[
            "train",
            "--model",
            "mlp",
            "--widths",
            "16,32,32,4",
            "--world-size",
            "2",
            "--policy",
            policy,
            "--optimizer",
            "sgd",
            "--momentum",
            "0.9",
            "--quiet",
        ];
        let (straight, ck_straight) = (dir.join("straight.csv"), dir.join("end-straight.safetensors"));
        ok(&cat(&[
            base,
            &[
                "--steps",
                "10",
                "--losses",
                s(&straight),
                "--checkpoint",
                s(&ck_straight),
            ],
        ]));
        for at in ["4", "6"] {
            let (ck, l1, l2, ck_end) = (
                dir.join(format!("ck{at}.safetensors")),
                dir.join("l1.csv"),
                dir.join("l2.csv"),
                dir.join("end.safetensors"),
            );
            ok(&cat(&[
                base,
                &["--steps", at, "--checkpoint", s(&ck), "--losses", s(&l1)],
            ]));
            let (saved, recorded) = tensors(&ck);
            assert_eq!(recorded.as_deref(), Some(policy));
            for r in 0..2 {
                let snapshot = format!("policy.rank{r}/snapshot.0");
                assert!(
                    saved.iter().any(|(k, _)| *k == snapshot),
                    "{policy}: rank {r}'s snapshot"
                );
            }
            ok(&cat(&[
                base,
                &["--steps", "10", "--resume", s(&ck), "--losses", s(&l2)],
                &["--checkpoint", s(&ck_end)],
            ]));
            let mut resumed = common::losses(&l1);
            resumed.extend(common::losses(&l2));
            assert_eq!(
                resumed,
                common::losses(&straight),
                "{policy} resumed at {at}: losses, bit for bit"
            );
            assert!(
                tensors(&ck_end) == tensors(&ck_straight),
                "{policy} resumed at {at}: every tensor of the final checkpoints, bit for bit"
            );
        }
    }
}

#[test]
fn a_resume_under_other_bucket_caps_notes_that_the_policys_state_is_regrouped() {
    let dir = common::dir("policy-resume-regrouped");
    let ck = dir.join("ck.safetensors");
    let int8 = [
        "--policy",
        "int8",
        "--world-size",
        "2",
        "--bucket-mb",
        "0.01",
        "--first-bucket-mb",
        "0.01",
    ];
    ok(&cat(&[
        &["train"],
        MLP,
        &int8,
        &["--steps", "2", "--checkpoint", s(&ck)],
    ]));
    let resume = |caps: &[&str]| {
        let out = brigade(&cat(&[
            &["train"],
            MLP,
            &[
                "--policy",
                "int8",
                "--world-size",
                "2",
                "--steps",
                "4",
                "--resume",
                s(&ck),
            ],
            caps,
        ]));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let note = "regroup them, and the policy's state with them, so the run is not the uninterrupted run's bit for bit";
    let same = resume(&["--bucket-mb", "0.01", "--first-bucket-mb", "0.01"]);
    assert!(!same.contains(note), "{same}");
    let other = resume(&["--bucket-mb", "25", "--first-bucket-mb", "1"]);
    let line = other
        .lines()
        .find(|l| l.contains(note))
        .unwrap_or_else(|| panic!("{other}"));
    assert!(
        line.starts_with("note: ")
            && line.contains("grouped under --bucket-mb 0.01 and --first-bucket-mb 0.01")
            && line.contains("this run's --bucket-mb 25 and --first-bucket-mb 1"),
        "{line}"
    );
}
