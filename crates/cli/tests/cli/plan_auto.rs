//! `brigade train --plan auto --memory-budget MB`: calibrate, plan, then train from step 0 under
//! the choice, which equals its flags given directly, is said in one line and in `--json`,
//! and is kept by a resume; what it cannot plan for is one error line.

use super::common::{cat, dir, fails, losses, ok, s, GPT, MLP};

/// The JSON summary of a `--json` run.
fn summary(out: &str) -> serde_json::Value {
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// The flags the plan chose, as `brigade train` takes them.
fn chosen_flags(plan: &serde_json::Value) -> Vec<String> {
    let mut f = vec![
        "--policy".to_string(),
        plan["policy"].as_str().unwrap().to_string(),
        "--bucket-mb".into(),
        plan["bucket_mb"].to_string(),
        "--first-bucket-mb".into(),
        plan["first_bucket_mb"].to_string(),
    ];
    let every = plan["activation_checkpointing"].as_u64().unwrap();
    if every > 0 {
        f.extend(["--activation-checkpointing".into(), every.to_string()]);
    }
    f
}

/// Trains `model` under `--plan auto` and then under the flags it chose, given directly:
/// the same losses bit for bit (one machine, one build), and the run really ran the choice.
fn plan_then_direct(name: &str, model: &[&str], calibrations: u64) {
    let d = dir(name);
    let (planned, direct) = (d.join("planned.csv"), d.join("direct.csv"));
    let base = cat(&[
        &["train"],
        model,
        &["--world-size", "2", "--batch-size", "4", "--steps", "4"],
    ]);
    let out = ok(&cat(&[
        &base,
        &[
            "--plan",
            "auto",
            "--memory-budget",
            "512",
            "--json",
            "--losses",
            s(&planned),
        ],
    ]));
    let json = summary(&out);
    let plan = &json["plan"];
    assert_eq!(plan["calibration_runs"], calibrations, "{plan}");
    assert!(plan["eligible"].as_u64().unwrap() >= 1, "{plan}");
    assert!(
        plan["predicted_peak_bytes"].as_u64().unwrap() <= 512 << 20,
        "the choice fits the budget: {plan}"
    );
    // the run trained what the plan chose, from step 0
    assert_eq!(json["policy"], plan["policy"], "{out}");
    assert_eq!(json["flags"]["bucket_mb"], plan["bucket_mb"], "{out}");
    assert_eq!(json["first_step"], 0);
    let flags = chosen_flags(plan);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    ok(&cat(&[&base, &flags, &["--losses", s(&direct)]]));
    assert_eq!(
        losses(&planned),
        losses(&direct),
        "--plan auto == {flags:?} given directly"
    );
    assert_eq!(
        losses(&planned).len(),
        4,
        "the calibration steps are not part of the run"
    );
}

#[test]
fn the_mlp_trains_under_the_plan_exactly_as_under_its_flags_given_directly() {
    // allreduce, fp16, bf16, powersgd, zero1, zero2, zero3
    plan_then_direct("plan-auto-mlp", MLP, 7);
}

#[test]
fn the_gpt_trains_under_the_plan_exactly_as_under_its_flags_given_directly() {
    // and allreduce with every block checkpointed
    plan_then_direct("plan-auto-gpt", GPT, 8);
}

#[test]
fn the_plan_is_said_in_one_line_and_a_resume_keeps_it_without_calibrating() {
    let d = dir("plan-auto-resume");
    let ck = d.join("run.ckpt");
    let base = cat(&[
        &["train"],
        MLP,
        &["--world-size", "2", "--batch-size", "4", "--plan", "auto"],
    ]);
    let out = ok(&cat(&[
        &base,
        &["--memory-budget", "256", "--steps", "2", "--checkpoint", s(&ck)],
    ]));
    let line: Vec<&str> = out.lines().filter(|l| l.starts_with("plan: ")).collect();
    assert_eq!(line.len(), 1, "{out}");
    assert!(
        line[0].contains("--policy ") && line[0].contains("calibration runs"),
        "{out}"
    );
    // the resume takes the recorded choice: no calibration, the same flags
    let resumed = summary(&ok(&cat(&[
        &base,
        &["--memory-budget", "256", "--steps", "4", "--resume", s(&ck), "--json"],
    ])));
    assert_eq!(resumed["plan"]["calibration_runs"], 0, "{resumed}");
    assert_eq!(resumed["first_step"], 2);
    let chosen = line[0].split_whitespace().nth(2).unwrap();
    assert_eq!(resumed["policy"], chosen, "{resumed}");
    // under another budget the line weighs the kept plan against this run's
    let out = ok(&cat(&[
        &base,
        &["--memory-budget", "300", "--steps", "3", "--resume", s(&ck)],
    ]));
    let line: Vec<&str> = out.lines().filter(|l| l.starts_with("plan: ")).collect();
    assert!(
        line.len() == 1 && line[0].contains("of 300 MB") && line[0].contains("kept from the checkpoint"),
        "{out}"
    );
    // a checkpoint of a run without a plan says so
    let plain = d.join("plain.ckpt");
    ok(&cat(&[
        &["train"],
        MLP,
        &["--world-size", "2", "--steps", "2", "--checkpoint", s(&plain)],
    ]));
    let e = fails(&cat(&[
        &base,
        &["--memory-budget", "256", "--steps", "4", "--resume", s(&plain)],
    ]));
    assert!(e.contains("records no plan"), "{e}");
}

#[test]
fn what_the_plan_cannot_choose_for_is_one_error_line() {
    let base = cat(&[&["train"], MLP, &["--steps", "2", "--plan", "auto"]]);
    let two = ["--world-size", "2"];
    for (extra, says) in [
        (&["--world-size", "2"][..], "--memory-budget"),
        (&["--memory-budget", "64"][..], "--world-size 2"),
        (
            &[&two[..], &["--memory-budget", "64", "--policy", "zero2"]].concat()[..],
            "drop --policy",
        ),
        (
            &[&two[..], &["--memory-budget", "64", "--zero", "1"]].concat()[..],
            "drop --policy",
        ),
        (
            &[&two[..], &["--memory-budget", "64", "--bucket-mb", "auto"]].concat()[..],
            "not auto",
        ),
        // no configuration fits a budget of a few bytes: the smallest is named
        (
            &[&two[..], &["--memory-budget", "0.00001"]].concat()[..],
            "no configuration fits",
        ),
    ] {
        let e = fails(&cat(&[&base, extra]));
        assert!(e.contains(says), "{extra:?}: {e}");
    }
    let gpt = cat(&[
        &["train"],
        GPT,
        &["--steps", "2", "--plan", "auto", "--world-size", "2"],
    ]);
    let e = fails(&cat(&[&gpt, &["--memory-budget", "64", "--activation-checkpointing"]]));
    assert!(e.contains("drop --activation-checkpointing"), "{e}");
    // a bad flag is its own one line, before any calibration runs
    let e = fails(&cat(&[&base, &two, &["--memory-budget", "64", "--batch-size", "0"]]));
    assert!(e.contains("--batch-size") && !e.contains("calibrat"), "{e}");
}

/// Stdout and stderr of a run that must succeed.
fn run_ok(args: &[&str]) -> (String, String) {
    let out = super::common::brigade(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "brigade {args:?} failed:\n{stderr}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
}

#[test]
fn the_plan_keeps_the_memory_models_margin_under_the_budget_and_a_run_over_it_says_by_how_much() {
    let base = cat(&[&["train"], MLP, &["--world-size", "2", "--steps", "3", "--json"]]);
    // plain DDP's predicted peak, and a budget just above it: inside the model's 10%
    let plain = summary(&ok(&base));
    let predicted = plain["memory"]["predicted_peak_bytes"].as_u64().unwrap();
    let budget_kib = predicted * 102 / 100 / 1024;
    let mb = format!("{}", budget_kib as f64 / 1024.0);
    let (stdout, stderr) = run_ok(&cat(&[&base, &["--plan", "auto", "--memory-budget", &mb]]));
    let json = summary(&stdout);
    let budget = budget_kib * 1024;
    let chosen = json["plan"]["predicted_peak_bytes"].as_u64().unwrap();
    assert!(
        chosen as f64 * 1.1 <= budget as f64,
        "the plan keeps 10% under {budget} B: {}",
        json["plan"]
    );
    let peak = json["memory"]["peak_bytes"].as_u64().unwrap();
    assert_eq!(
        stderr.contains("passed --memory-budget"),
        peak > budget,
        "a peak of {peak} B against {budget} B: {stderr}"
    );
    // a budget under plain DDP's measured peak (and over its prediction, so the run starts):
    // the run says by how much its peak passed it
    let measured = plain["memory"]["peak_bytes"].as_u64().unwrap();
    let budget_kib = (measured - 1) / 1024;
    assert!(budget_kib * 1024 >= predicted, "{plain}");
    let mb = format!("{}", budget_kib as f64 / 1024.0);
    let (stdout, stderr) = run_ok(&cat(&[&base, &["--memory-budget", &mb]]));
    assert_eq!(summary(&stdout)["memory"]["peak_bytes"], measured);
    let over = measured - budget_kib * 1024;
    assert!(
        stderr.contains(&format!("passed --memory-budget {mb} MB by {over} B")),
        "{stderr}"
    );
}
