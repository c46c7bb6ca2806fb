//! `--comm-hook`: the reducer policies from the command line, against plain all-reduce.

use crate::common;

use common::{dir, fails, ok};

const MLP: &[&str] = &[
    "--model",
    "mlp",
    "--widths",
    "16,32,32,4",
    "--lr",
    "0.05",
    "--optimizer",
    "sgd",
    "--quiet",
];

/// Losses of a 2-rank run with `extra` flags.
fn losses(tag: &str, extra: &[&str]) -> Vec<f64> {
    let d = dir(tag);
    let path = d.join("losses.csv");
    let mut args = vec![
        "train",
        "--world-size",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "6",
        "--threads-per-rank",
        "1",
    ];
    args.extend_from_slice(MLP);
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--losses", path.to_str().unwrap()]);
    ok(&args);
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect()
}

#[test]
fn fp16_and_bf16_train_within_rounding_of_plain_all_reduce() {
    let plain = losses("hook-plain", &[]);
    for (hook, tol) in [("fp16", 1e-3), ("bf16", 1e-2)] {
        let got = losses(&format!("hook-{hook}"), &["--comm-hook", hook]);
        assert_eq!(got[0], plain[0], "{hook}: step 0's loss comes before any update");
        let worst = got
            .iter()
            .zip(&plain)
            .map(|(a, b)| (a - b).abs() / b.abs())
            .fold(0.0, f64::max);
        assert!(worst < tol, "{hook}: {got:?} vs {plain:?}");
        assert!(worst > 0.0, "{hook}: not a bit changed: the hook did not run");
    }
}

#[test]
fn powersgd_is_plain_all_reduce_until_its_start_iteration() {
    let plain = losses("psgd-plain", &[]);
    let got = losses(
        "psgd",
        &[
            "--comm-hook",
            "powersgd",
            "--powersgd-rank",
            "2",
            "--powersgd-start-iter",
            "2",
        ],
    );
    // updates 0 and 1 are plain: the losses of steps 0..=2 agree; update 2 is compressed
    assert_eq!(got[..3], plain[..3]);
    assert_ne!(got[3], plain[3]);
}

#[test]
fn bad_hook_settings_are_one_line_before_step_0() {
    let base = ["train", "--model", "mlp", "--widths", "8,4", "--steps", "1"];
    let run = |extra: &[&str]| fails(&base.iter().copied().chain(extra.iter().copied()).collect::<Vec<_>>());
    assert!(run(&["--comm-hook", "powersgd", "--powersgd-rank", "0"]).contains("at least 1"));
    // (a start iteration of 1 or 0 is fine now: PowerSGD keys its state by parameter, so DDP's
    // bucket rebuild after the first iteration does not strand it)
    assert!(run(&["--powersgd-rank", "4"]).contains("--policy powersgd"));
    assert!(run(&["--comm-hook", "topk"]).contains("topk"));
}

#[test]
fn policy_int8_trains_near_plain_all_reduce_and_policy_spells_the_other_flags() {
    let plain = losses("policy-plain", &[]);
    let got = losses("policy-int8", &["--policy", "int8"]);
    assert_eq!(got[0], plain[0], "step 0's loss comes before any update");
    let worst = got
        .iter()
        .zip(&plain)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .fold(0.0, f64::max);
    assert!(worst < 5e-2, "{got:?} vs {plain:?}");
    assert!(worst > 0.0, "not a bit changed: int8 did not run");
    assert_eq!(
        losses("comm-hook-int8", &["--comm-hook", "int8"]),
        got,
        "--comm-hook int8 is the same"
    );
    // a spec with its numbers sets the flags they stand for
    let psgd = [
        "--comm-hook",
        "powersgd",
        "--powersgd-rank",
        "2",
        "--powersgd-start-iter",
        "2",
    ];
    assert_eq!(
        losses("policy-psgd", &["--policy", "powersgd:2@2"]),
        losses("flags-psgd", &psgd)
    );
    assert_eq!(
        losses("policy-zero2", &["--policy", "zero2"]),
        losses("flags-zero2", &["--zero", "2"])
    );
    let base = ["train", "--model", "mlp", "--widths", "8,4", "--steps", "1"];
    let run = |extra: &[&str]| fails(&base.iter().copied().chain(extra.iter().copied()).collect::<Vec<_>>());
    let e = run(&["--policy", "int8", "--comm-hook", "fp16"]);
    assert!(e.contains("--policy") && e.contains("--comm-hook"), "{e}");
    let e = run(&["--policy", "int9"]);
    assert!(e.contains("int9") && e.contains("int8"), "{e}");
}

#[test]
fn a_diverged_run_under_an_outer_optimizer_names_its_outer_lr_too() {
    // diloco's outer lr of 1e30 diverges the run at its first sync: --lr is not the cause
    let base = [
        "train",
        "--model",
        "mlp",
        "--widths",
        "16,32,32,4",
        "--world-size",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--quiet",
    ];
    let e = fails(&common::cat(&[&base, &["--policy", "diloco:2:1e30"]]));
    assert!(
        e.contains("the run diverged")
            && e.contains("lower --lr or the policy's outer lr (diloco:H[:OUTER_LR[:MOMENTUM]])"),
        "{e}"
    );
    let e = fails(&common::cat(&[&base, &["--lr", "1e30"]]));
    assert!(e.contains("lower --lr,") && !e.contains("outer"), "{e}");
}
