//! `brigade plan` over profiles recorded by `brigade train --profile`: the MLP at world 2 under
//! allreduce, fp16 and ZeRO-2; its table, its `--json` and its errors, one line each.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::common::{self, dir, ok, s};

/// The small MLP on 2 ranks (1 thread each), 3 steps of 8 rows per rank, with `policy`'s
/// flags; the last step's profile.
fn record(tag: &str, policy: &[&str]) -> PathBuf {
    let p = common::shared_dir(tag).join("profile.json");
    let args = [
        &[
            "train",
            "--model",
            "mlp",
            "--widths",
            "64,256,256,4",
            "--world-size",
            "2",
            "--threads-per-rank",
            "1",
            "--batch-size",
            "8",
            "--steps",
            "3",
            "--bucket-mb",
            "0.1",
            "--quiet",
            "--profile",
            s(&p),
        ][..],
        policy,
    ]
    .concat();
    ok(&args);
    p
}

/// allreduce, fp16, ZeRO-2: recorded once for the tests here.
fn profiles() -> &'static [PathBuf] {
    static P: OnceLock<Vec<PathBuf>> = OnceLock::new();
    P.get_or_init(|| {
        vec![
            record("plan-allreduce", &[]),
            record("plan-fp16", &["--comm-hook", "fp16"]),
            record("plan-zero2", &["--zero", "2"]),
        ]
    })
}

fn plan_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["plan"];
    for p in profiles() {
        a.extend(["--profile", s(p)]);
    }
    a.extend(extra);
    a
}

fn plan_json(budget_mb: &str) -> serde_json::Value {
    let out = ok(&plan_args(&["--memory-budget", budget_mb, "--net-gbps", "1", "--json"]));
    serde_json::from_str(&out).unwrap()
}

#[test]
fn a_profile_records_the_command_that_ran_it() {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&profiles()[1]).unwrap()).unwrap();
    let run = &v["run"];
    assert_eq!(run["model"], "mlp");
    assert_eq!(run["precision"], "f32");
    assert_eq!(run["optimizer_state_per_param"], 2);
    assert!(run["memory"]["peak"].as_u64().unwrap() > 0, "{run}");
    let command: Vec<&str> = run["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(&command[..2], ["brigade", "train"]);
    assert!(command.windows(2).any(|w| w == ["--comm-hook", "fp16"]), "{command:?}");
}

#[test]
fn the_plan_ranks_what_fits_and_prints_the_winner_as_a_train_command() {
    let all = plan_json("100000");
    let candidates = all["candidates"].as_array().unwrap();
    // 3 caps x (allreduce, fp16, bf16, powersgd:1, topk:0.01, efsign, zero1, zero2, zero3,
    // diloco:10, streaming-diloco:10:2); the MLP has no blocks
    assert_eq!(candidates.len(), 33);
    let totals: Vec<u64> = candidates
        .iter()
        .map(|c| c["memory"]["total"].as_u64().unwrap())
        .collect();
    let (lo, hi) = (*totals.iter().min().unwrap(), *totals.iter().max().unwrap());
    assert!(lo < hi, "ZeRO holds less than allreduce: {totals:?}");
    // a budget between them: some fit, some do not
    let budget = (lo + hi) / 2;
    let v = plan_json(&format!("{}", budget as f64 / 1048576.0));
    let budget = v["budget_bytes"].as_u64().unwrap();
    let mut class = vec![];
    for c in v["candidates"].as_array().unwrap() {
        let total = c["memory"]["total"].as_u64().unwrap();
        let parts: u64 = [
            "parameters",
            "gradients",
            "optimizer_state",
            "activations",
            "backward",
            "policy_state",
        ]
        .iter()
        .map(|k| c["memory"][k].as_u64().unwrap())
        .sum();
        assert_eq!(parts, total, "{c}");
        assert_eq!(c["fits"].as_bool().unwrap(), total <= budget, "{c}");
        if total > budget {
            assert_eq!(c["over_budget"]["bytes"].as_u64().unwrap(), total - budget);
        }
        let predicted = !c["step"].is_null();
        assert_eq!(predicted, c["not_predicted"].is_null(), "{c}");
        if c["policy"] == "powersgd:1" || c["policy"] == "zero3" {
            assert!(!predicted, "{c}");
        }
        class.push(match (c["fits"].as_bool().unwrap(), predicted) {
            (true, true) => 0,
            (false, _) => 1,
            (true, false) => 2,
        });
    }
    assert!(class.windows(2).all(|w| w[0] <= w[1]), "{class:?}");
    assert_eq!(v["winner"], 0);
    let command: Vec<&str> = v["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let winner = &v["candidates"][0];
    assert_eq!(&command[..2], ["brigade", "train"]);
    assert!(
        command
            .windows(2)
            .any(|w| w == ["--policy", winner["policy"].as_str().unwrap()]),
        "{command:?}"
    );
    assert!(!command.contains(&"--comm-hook") && !command.contains(&"--zero") && !command.contains(&"--profile"));
    // the winner's command runs as it reads: the chosen policy, cap and world size
    ok(&command[1..]);
    // the table: the same ranking, the over-budget rows marked, the reasons, the winner
    let table = ok(&plan_args(&[
        "--memory-budget",
        &format!("{}", budget as f64 / 1048576.0),
        "--net-gbps",
        "1",
    ]));
    assert!(
        table.contains("not predicted: no profiled step under powersgd"),
        "{table}"
    );
    assert!(
        table.lines().any(|l| l.starts_with("x ") && l.contains("over by")),
        "{table}"
    );
    assert!(table.contains(&format!("winner: {}", command.join(" "))), "{table}");
}

#[test]
fn what_a_plan_cannot_answer_is_one_error_line() {
    let link = ["--net-gbps", "1"];
    let with = |extra: &[&str]| common::fails(&plan_args(&[extra, &link[..]].concat()));
    for bad in ["0", "-5", "nan", "inf"] {
        let e = with(&["--memory-budget", bad]);
        assert!(
            e.contains("--memory-budget must be a positive number of MB"),
            "{bad}: {e}"
        );
    }
    let e = with(&["--memory-budget", "0.001"]);
    assert!(e.contains("every candidate is over it; the smallest, "), "{e}");
    let e = common::fails(&plan_args(&["--memory-budget", "100"]));
    assert!(e.contains("--measured-link"), "{e}");
    let e = common::fails(&["plan", "--memory-budget", "100", "--net-gbps", "1"]);
    assert!(e.contains("--profile"), "{e}");
    // a profile from before runs were recorded, and profiles of two precisions
    let d = dir("plan-bad");
    let text = std::fs::read_to_string(&profiles()[0]).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["run"]["precision"] = "bf16".into();
    let bf16 = d.join("bf16.json");
    std::fs::write(&bf16, v.to_string()).unwrap();
    v.as_object_mut().unwrap().remove("run");
    let old = d.join("old.json");
    std::fs::write(&old, v.to_string()).unwrap();
    let run = |files: &[&PathBuf]| {
        let mut a = vec!["plan", "--memory-budget", "100", "--net-gbps", "1"];
        for f in files {
            a.extend(["--profile", s(f)]);
        }
        common::fails(&a)
    };
    let e = run(&[&old]);
    assert!(
        e.contains("re-record it with this build's brigade train --profile"),
        "{e}"
    );
    assert!(e.contains(s(&old)), "the file is named: {e}");
    let e = run(&[&profiles()[0], &bf16]);
    assert!(e.contains("precision") && e.contains(s(&bf16)), "{e}");
    let e = run(&[&d.join("missing.json")]);
    assert!(e.contains("missing.json"), "{e}");
}

#[test]
fn the_memory_budget_is_checked_one_way_by_plan_train_and_plan_auto_before_anything_runs() {
    let d = dir("plan-budget-bounds");
    // `plan` reads no profile before its flags are checked: one that does not exist
    let missing = d.join("missing.json");
    for bad in ["0", "-5", "nan", "inf", "1e15", "1e20"] {
        let lines: Vec<String> = [
            vec![
                "plan",
                "--profile",
                s(&missing),
                "--net-gbps",
                "1",
                "--memory-budget",
                bad,
            ],
            [&["train"], common::MLP, &["--steps", "1", "--memory-budget", bad]].concat(),
            [
                &["train"],
                common::MLP,
                &[
                    "--steps",
                    "1",
                    "--world-size",
                    "2",
                    "--plan",
                    "auto",
                    "--memory-budget",
                    bad,
                ],
            ]
            .concat(),
        ]
        .iter()
        .map(|args| common::fails(args))
        .collect();
        assert!(
            lines[0].contains("--memory-budget must be a positive number of MB"),
            "{bad}: {}",
            lines[0]
        );
        assert!(lines.iter().all(|l| *l == lines[0]), "{bad}: {lines:#?}");
        // before any calibration: no calibration note
        assert!(!lines[2].contains("calibrat"), "{bad}: {}", lines[2]);
    }
}

#[test]
fn a_broken_profile_names_its_field_and_an_unknown_policy_names_itself() {
    let d = dir("plan-broken-profile");
    let text = std::fs::read_to_string(&profiles()[0]).unwrap();
    let run = |name: &str, body: String| {
        let f = d.join(name);
        std::fs::write(&f, body).unwrap();
        let e = common::fails(&["plan", "--memory-budget", "100", "--net-gbps", "1", "--profile", s(&f)]);
        assert!(e.contains(s(&f)), "the file is named: {e}");
        e
    };
    // a value of the wrong type
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["run"]["rows"] = "many".into();
    let e = run("typed.json", serde_json::to_string_pretty(&v).unwrap());
    assert!(e.contains("field `run.rows`: invalid type"), "{e}");
    // a list of steps (--profile-steps) cut off in its second step: read as a list
    let list = format!("[\n{text},\n{}", &text[..text.len() / 2]);
    let e = run("cut.json", list);
    assert!(e.contains("field `[1]") && e.contains("EOF while parsing"), "{e}");
    // a policy the plan does not know
    v["run"]["rows"] = 8.into();
    v["policy"]["name"] = "myhook".into();
    let e = run("unknown.json", serde_json::to_string_pretty(&v).unwrap());
    assert!(e.contains("records policy 'myhook'"), "{e}");
}

#[test]
fn a_measured_link_plan_refuses_profiles_of_two_links_and_a_policy_profiled_twice() {
    let d = dir("plan-two-links");
    // the fp16 profile as if its run had a simulated link of 0.01 Gb/s and 500 us
    let text = std::fs::read_to_string(&profiles()[1]).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let command = v["run"]["command"].as_array_mut().unwrap();
    command.extend(["--net-gbps", "0.01", "--net-latency-us=500"].map(serde_json::Value::from));
    let slow = d.join("fp16-slow.json");
    std::fs::write(&slow, v.to_string()).unwrap();
    fn plan<'a>(link: &[&'a str], files: &[&'a PathBuf]) -> Vec<&'a str> {
        let mut a = vec!["plan", "--memory-budget", "100"];
        a.extend(link);
        for f in files {
            a.extend(["--profile", s(f)]);
        }
        a
    }
    let e = common::fails(&plan(&["--measured-link"], &[&profiles()[0], &slow]));
    assert!(
        e.contains(s(&slow)) && e.contains("0.01 Gb/s, 500 us") && e.contains("the machine's own link"),
        "{e}"
    );
    // on a link the plan names, the profiles' own links are not read
    ok(&plan(&["--net-gbps", "1"], &[&profiles()[0], &slow]));
    // one policy profiled twice: which profile would count is not the user's choice
    for link in [&["--measured-link"][..], &["--net-gbps", "1"][..]] {
        let e = common::fails(&plan(link, &[&profiles()[0], &profiles()[1], &profiles()[0]]));
        assert!(
            e.contains("records allreduce as") && e.contains("one profile per policy") && e.contains(s(&profiles()[0])),
            "{e}"
        );
    }
}

#[test]
fn a_powersgd_profile_recorded_before_its_start_step_is_noted_as_predict_notes_it() {
    // 3 steps, compression from step 10: its buckets sent the plain all-reduce's bytes, and
    // the plan prices it so and says so on stderr, in `brigade predict`'s words
    let psgd = record("plan-powersgd-late", &["--policy", "powersgd:2@10"]);
    let args = [
        "plan",
        "--profile",
        s(&profiles()[0]),
        "--profile",
        s(&psgd),
        "--memory-budget",
        "100",
        "--net-gbps",
        "1",
    ];
    let out = common::brigade(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    let notes: Vec<&str> = err.lines().filter(|l| l.starts_with("note: ")).collect();
    assert!(
        notes.len() == 1 && notes[0].contains("start step (10)") && notes[0].contains("priced as a plain all-reduce"),
        "{err}"
    );
    let predicted = common::brigade(&["predict", "--profile", s(&psgd), "--net-gbps", "1"]);
    let predict_err = String::from_utf8_lossy(&predicted.stderr);
    assert!(predict_err.lines().any(|l| l == notes[0]), "{predict_err}");
}

#[test]
fn plan_help_names_every_policy_a_plan_weighs() {
    // the help's list is the one a plan's refusal of another policy names
    let help = ok(&["plan", "--help"]);
    for name in ["topk", "efsign", "diloco and streaming-diloco", "zero3", "powersgd"] {
        assert!(help.contains(name), "{name} missing from plan --help:\n{help}");
    }
}
