//! `brigade study`: every policy trains, its table and CSVs agree with its run's losses, and
//! the chart is written.

use serde_json::Value;

use crate::common::{dir, fails, numbers, ok, s, without};

const RUN: &[&str] = &[
    "study",
    "--model",
    "mlp",
    "--widths",
    "16,32,4",
    "--world-size",
    "2",
    "--threads-per-rank",
    "1",
    "--batch-size",
    "8",
    "--optimizer",
    "sgd",
    "--lr",
    "0.1",
    "--steps",
    "12",
    "--policy",
    "allreduce,fp16",
];

/// The link the runs train on and the study predicts for.
const LINK: &[&str] = &["--net-gbps", "1", "--net-latency-us", "20"];

/// Steps run up to and including the first whose loss is at most `target`.
fn first_at_most(losses: &[f64], target: f64) -> Option<usize> {
    losses.iter().position(|&l| l <= target).map(|i| i + 1)
}

#[test]
fn a_studys_steps_to_each_target_are_its_runs_first_step_at_or_below_it() {
    let d = dir("study");
    let out = d.to_str().unwrap();
    // a target every run reaches at once, one none reaches, and one between
    let json = ok(&[
        RUN,
        LINK,
        &[
            "--target-loss",
            "1e9,1e-6,1.3",
            "--predict-world-sizes",
            "4",
            "--out",
            out,
            "--json",
        ],
    ]
    .concat());
    let results: Vec<Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(results.len(), 2);
    let curves = std::fs::read_to_string(d.join("study.csv")).unwrap();
    let summary = std::fs::read_to_string(d.join("study_summary.csv")).unwrap();
    for r in &results {
        let policy = r["policy"].as_str().unwrap();
        let losses = numbers(&r["losses"]);
        assert_eq!(losses.len(), 12, "{policy}");
        // the CSV behind the chart holds the run's losses, in order
        let csv: Vec<f64> = curves
            .lines()
            .filter(|l| l.starts_with(&format!("{policy},")))
            .map(|l| l.split(',').nth(4).unwrap().parse().unwrap())
            .collect();
        assert_eq!(csv.len(), losses.len(), "{policy}");
        for (a, b) in csv.iter().zip(&losses) {
            assert!((a - b).abs() <= 1e-6, "{policy}: csv {a}, run {b}");
        }
        let here = &r["predictions"][0];
        assert_eq!(here["world_size"], 2);
        let step_s = here["step_s"].as_f64().expect("allreduce and fp16 are predicted");
        assert!(step_s > 0.0);
        for t in here["reached"].as_array().unwrap() {
            let target = t["target"].as_f64().unwrap();
            let steps = t["steps"].as_u64().map(|n| n as usize);
            assert_eq!(steps, first_at_most(&losses, target), "{policy} to {target}");
            match steps {
                Some(n) => assert!((t["seconds"].as_f64().unwrap() - n as f64 * step_s).abs() <= 1e-9),
                None => assert!(t["seconds"].is_null()),
            }
        }
        assert_eq!(first_at_most(&losses, 1e9), Some(1));
        // the prediction at 4 ranks, from the same profiles, and the own-profile band
        assert_eq!(r["predictions"][1]["world_size"], 4);
        assert!(r["predictions"][1]["step_s"].as_f64().unwrap() > 0.0);
        assert!(r["own_band"]["low"].as_f64().unwrap() <= r["own_band"]["high"].as_f64().unwrap());
        assert!(r["wire_bytes_per_step"].as_f64().unwrap() > 0.0);
        // the summary's row at the trained world says the same steps
        let row: Vec<&str> = summary
            .lines()
            .find(|l| l.starts_with(&format!("{policy},2,")))
            .unwrap()
            .split(',')
            .collect();
        let steps_col = |target: f64| first_at_most(&losses, target).map_or("-".to_string(), |n| n.to_string());
        assert_eq!(row[2], "2", "{policy}: the steps' world");
        assert_eq!(row[10], steps_col(1e9), "{policy}");
        assert_eq!(row[12], steps_col(1e-6), "{policy}");
        assert_eq!(row[14], steps_col(1.3), "{policy}");
        // at 4 ranks the step alone: the steps to a target are the trained world's, not 4's
        let header = summary.lines().next().unwrap().split(',').count();
        let row4: Vec<&str> = summary
            .lines()
            .find(|l| l.starts_with(&format!("{policy},4,")))
            .unwrap()
            .split(',')
            .collect();
        assert_eq!(row4.len(), header, "{policy}: {summary}");
        assert_eq!(row4[2], "2", "{policy}");
        assert!(row4[5] != "-", "{policy}: its step is predicted");
        assert!(row4[10..].iter().all(|c| *c == "-"), "{policy}: {row4:?}");
        // nor what was measured at 2 ranks: the measured step, its band and the bytes sent
        assert!(row[6..10].iter().all(|c| *c != "-"), "{policy}: {row:?}");
        assert!(row4[6..10].iter().all(|c| *c == "-"), "{policy}: {row4:?}");
    }
    // fp16 sends half of allreduce's bytes
    let wire = |i: usize| results[i]["wire_bytes_per_step"].as_f64().unwrap();
    assert!((wire(1) / wire(0) - 0.5).abs() < 0.01, "{} {}", wire(0), wire(1));
    let svg = std::fs::read_to_string(d.join("study.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("allreduce") && svg.contains("fp16"));
}

#[test]
fn a_study_without_a_link_to_predict_for_is_one_usage_error() {
    let d = dir("study-no-link");
    let e = fails(&[RUN, &["--target-loss", "0.5", "--out", d.to_str().unwrap()]].concat());
    assert!(e.contains("say which link to predict for"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
}

/// The run's flags without the command and its policy: a small MLP at 2 ranks.
const SMALL: &[&str] = &[
    "--model",
    "mlp",
    "--widths",
    "16,32,4",
    "--world-size",
    "2",
    "--threads-per-rank",
    "1",
    "--batch-size",
    "8",
    "--optimizer",
    "sgd",
    "--momentum",
    "0.9",
    "--lr",
    "0.1",
    "--steps",
    "10",
];

#[test]
fn a_run_on_the_simulated_link_loses_the_studys_losses_bit_for_bit() {
    // the study trains on the machine's own link and predicts for 1 Gb/s, 20 us; the same
    // runs on the simulated link are only delayed: the same losses, to the bit, so that a
    // study's prediction and the measured run differ in their time axis alone
    let d = dir("study-bits");
    let policies = ["allreduce", "topk:0.25", "diloco:2"];
    let json = ok(&[
        &["study"],
        SMALL,
        &[
            "--policy",
            &policies.join(","),
            "--predict-gbps",
            "1",
            "--predict-latency-us",
            "20",
            "--target-loss",
            "1",
            "--out",
            d.to_str().unwrap(),
            "--json",
        ],
    ]
    .concat());
    let results: Vec<Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(results.len(), policies.len());
    for (policy, r) in policies.iter().zip(&results) {
        assert_eq!(r["predictions"][0]["net_latency_us"].as_f64(), Some(20.0), "{policy}");
        let run: Value = serde_json::from_str(&ok(&[
            &["train"],
            SMALL,
            &[
                "--policy",
                policy,
                "--net-gbps",
                "1",
                "--net-latency-us",
                "20",
                "--json",
                "--quiet",
            ],
        ]
        .concat()))
        .unwrap();
        let (studied, measured) = (numbers(&r["losses"]), numbers(&run["loss"]));
        assert_eq!(measured.len(), 10, "{policy}");
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&studied), bits(&measured), "{policy}");
        // and each step's wall time, for the time to a target
        let ms = numbers(&run["step_ms"]);
        assert_eq!(ms.len(), 10, "{policy}");
        assert!(ms.iter().all(|&m| m > 0.0), "{policy}: {ms:?}");
    }
}

#[test]
fn a_latency_for_links_not_given_is_one_usage_error() {
    let d = dir("study-latency");
    let out = d.to_str().unwrap();
    let run = [
        &["study"],
        SMALL,
        &["--policy", "allreduce", "--target-loss", "1", "--out", out],
    ]
    .concat();
    let e = fails(&[&run[..], &["--net-gbps", "1", "--predict-latency-us", "5"]].concat());
    assert!(e.contains("give --predict-gbps too"), "{e}");
    let e = fails(&[&run[..], &["--predict-gbps", "1,2,3", "--predict-latency-us", "5,6"]].concat());
    assert!(e.contains("one per link"), "{e}");
}

#[test]
fn a_profile_records_the_steps_agreement_on_the_loss_with_the_time_it_held_the_link() {
    // the step's own all-reduce of the loss (three f32: the loss, non-finite, stop) crosses the
    // link the run has: on the simulated link it held the ring's time, on the machine's own
    // none the replay could price apart
    let d = dir("study-control");
    for (link, want) in [(LINK, 2.0 * 20e-6 + 12.0 / 125e6), (&[][..], 0.0)] {
        let p = d.join("p.json");
        ok(&[&["train"], SMALL, link, &["--profile", p.to_str().unwrap(), "--quiet"]].concat());
        let profile: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        for rank in profile["ranks"].as_array().unwrap() {
            let control = rank["control"].as_array().expect("the step's control collectives");
            assert_eq!(control.len(), 1, "{control:?}");
            assert_eq!(control[0]["op"], "all_reduce");
            assert_eq!(control[0]["bytes"], 12);
            let held = control[0]["link_s"].as_f64().unwrap();
            assert!(
                (held - want).abs() < 1e-12,
                "held {held} s, the ring's time is {want} s"
            );
        }
    }
}

/// The study's flags but its policies: a small MLP on 2 ranks over a simulated link.
fn small(policy: &str, more: &[&str], out: &str) -> Vec<String> {
    let base = [
        "study",
        "--model",
        "mlp",
        "--widths",
        "16,32,32,4",
        "--world-size",
        "2",
        "--net-gbps",
        "10",
        "--policy",
        policy,
        "--out",
        out,
    ];
    base.iter().chain(more).map(|s| s.to_string()).collect()
}

#[test]
fn accumulating_into_the_shard_is_checked_against_the_studys_policies() {
    let d = dir("study_accum_shard");
    let out = d.to_str().unwrap();
    let more = [
        "--steps",
        "4",
        "--accum",
        "2",
        "--accum-into-shard",
        "--target-loss",
        "1.36",
        "--json",
    ];
    let args = small("zero2,zero3", &more, out);
    let json = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let results: Vec<Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(results.len(), 2);
    // a policy of the list that keeps no gradient shard is named
    let args = small("zero3,fp16", &more, out);
    let e = fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(e.contains("--policy fp16") && !e.contains("allreduce"), "{e}");
}

#[test]
fn a_predicted_policy_without_an_error_band_is_not_called_unpredicted() {
    // 3 steps, 2 of warm-up: the one profiled step of a policy that syncs every second step
    // sends nothing, so there is no link to replay its own step on; its step on the study's
    // link is still predicted
    let d = dir("study_no_band");
    let out = d.to_str().unwrap();
    let more = ["--steps", "3", "--target-loss", "1.37", "--predict-world-sizes", "3"];
    let args = small("diloco:2", &more, out);
    let text = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let summary = std::fs::read_to_string(d.join("study_summary.csv")).unwrap();
    let rows: Vec<Vec<&str>> = summary.lines().skip(1).map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 2, "{summary}");
    assert!(rows.iter().all(|r| r[5] != "-"), "its step is predicted: {summary}");
    assert_eq!(rows[0][7], "-", "no error band: {summary}");
    assert!(!text.contains("not predicted"), "{text}");
    let note = text.lines().find(|l| l.starts_with("note: diloco:2: ")).expect(&text);
    assert!(note.contains("error band"), "{note}");
}

/// The cells of `text`'s table (the lines from its header, `policy ...`, to the first line
/// that is not a row), split at whitespace.
fn table(text: &str) -> Vec<Vec<&str>> {
    let mut lines = text.lines().skip_while(|l| !l.trim_start().starts_with("policy "));
    let header: Vec<&str> = lines.next().expect(text).split_whitespace().collect();
    let mut out = vec![header.clone()];
    out.extend(
        lines
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .take_while(|r| r.len() == header.len()),
    );
    out
}

#[test]
fn a_studys_times_print_three_significant_digits_and_the_csv_all_of_them() {
    // a fast predicted link, and a target reached at the first step: a time to target of one
    // step, under a millisecond for this small MLP
    let d = dir("study_digits");
    let out = d.to_str().unwrap();
    let more = [
        "--predict-gbps",
        "100",
        "--predict-latency-us",
        "1",
        "--target-loss",
        "1e9,1.3",
        "--out",
        out,
    ];
    let text = ok(&[RUN, LINK, &more].concat());
    let summary = std::fs::read_to_string(d.join("study_summary.csv")).unwrap();
    let csv: Vec<Vec<&str>> = summary.lines().map(|l| l.split(',').collect()).collect();
    let table = table(&text);
    assert_eq!(table[0], csv[0], "{text}");
    assert_eq!(table.len(), csv.len(), "{text}\n{summary}");
    let times: Vec<usize> = (0..csv[0].len())
        .filter(|&c| csv[0][c].ends_with("_ms") || csv[0][c].starts_with("seconds_to_"))
        .collect();
    assert_eq!(times.len(), 4, "{summary}");
    for (t, c) in table.iter().zip(&csv).skip(1) {
        for &k in &times {
            if c[k] == "-" {
                assert_eq!(t[k], "-", "{}: {text}", csv[0][k]);
                continue;
            }
            let (shown, exact): (f64, f64) = (t[k].parse().unwrap(), c[k].parse().unwrap());
            assert!(exact > 0.0, "{}: {summary}", csv[0][k]);
            assert!(
                (shown - exact).abs() <= 5e-3 * exact,
                "{}: the table shows {shown}, the CSV {exact}: {text}",
                csv[0][k]
            );
        }
        // the CSV's time to a target is its steps at the predicted step, every digit kept
        let step_ms: f64 = c[5].parse().unwrap();
        for k in times
            .iter()
            .copied()
            .filter(|&k| csv[0][k].starts_with("seconds_to_") && c[k] != "-")
        {
            let steps: f64 = c[k - 1].parse().unwrap();
            let seconds: f64 = c[k].parse().unwrap();
            assert!(
                (seconds - steps * step_ms / 1e3).abs() <= 1e-9 * seconds,
                "{}: {seconds} s for {steps} steps of {step_ms} ms",
                csv[0][k]
            );
        }
    }
}

#[test]
fn a_negative_target_loss_is_read_as_a_value_and_refused_in_one_line() {
    let d = dir("study_negative_target");
    let out = d.to_str().unwrap();
    for targets in ["-1", "-1,0.5", "0.5,-0.25", "-1e-3"] {
        let e = fails(&[RUN, LINK, &["--target-loss", targets, "--out", out]].concat());
        assert!(
            e.contains("--target-loss") && e.contains("never negative"),
            "{targets}: {e}"
        );
    }
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "nothing is written");
}

#[test]
fn an_empty_policy_says_so_and_lists_the_forms_once() {
    let d = dir("study_empty_policy");
    let out = d.to_str().unwrap();
    let run = without(RUN, "--policy");
    for policies in ["", "allreduce,,fp16", "9lives"] {
        let e = fails(
            &[
                &run,
                LINK,
                &["--policy", policies, "--target-loss", "0.5", "--out", out],
            ]
            .concat(),
        );
        assert_eq!(e.matches("topk:RATIO").count(), 1, "{policies:?}: {e}");
        if policies != "9lives" {
            assert!(e.contains("empty"), "{policies:?}: {e}");
        }
    }
}

#[test]
fn a_study_out_that_is_a_file_is_refused_as_the_studys() {
    let d = dir("study_out_file");
    let file = d.join("taken.csv");
    std::fs::write(&file, "kept").unwrap();
    let e = fails(&[RUN, LINK, &["--target-loss", "0.5", "--out", file.to_str().unwrap()]].concat());
    assert!(e.contains("study's files") && !e.contains("sweep"), "{e}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "kept");
}

#[test]
fn a_studys_bad_numbers_name_their_own_flag_and_no_policy() {
    let d = dir("study_bad_numbers");
    let out = d.to_str().unwrap();
    let cases: [(&[&str], &str); 6] = [
        (&["--predict-gbps", "-1"], "--predict-gbps must be"),
        (
            &["--predict-gbps", "1", "--predict-latency-us", "-5"],
            "--predict-latency-us must be",
        ),
        (
            &["--predict-gbps", "1,2", "--predict-latency-us", "1,2e9"],
            "--predict-latency-us must be",
        ),
        (&["--net-gbps", "0"], "--net-gbps must be"),
        (&["--target-loss", "nan"], "--target-loss"),
        (&["--target-loss", "1e400"], "--target-loss"),
    ];
    for (flags, says) in cases {
        let mut args = [RUN, flags, &["--out", out]].concat();
        if !flags.contains(&"--target-loss") {
            args.extend(["--target-loss", "0.5"]);
        }
        let e = fails(&args);
        assert!(e.contains(says) && !e.contains("--policy"), "{flags:?}: {e}");
    }
}

#[test]
fn a_study_at_one_rank_says_rank() {
    let d = dir("study_one_rank");
    let out = d.to_str().unwrap();
    let run = without(RUN, "--world-size");
    let text = ok(&[&run, LINK, &["--world-size", "1", "--target-loss", "0.5", "--out", out]].concat());
    assert!(text.contains("trained and measured at 1 rank\n"), "{text}");
    let svg = std::fs::read_to_string(d.join("study.svg")).unwrap();
    assert!(svg.contains("1 rank,") && !svg.contains("1 ranks"), "{svg}");
}

#[test]
fn a_flag_after_target_loss_is_not_read_as_its_value() {
    let d = dir("study_target_then_flag");
    let out = d.to_str().unwrap();
    // `--out` (or `--json`) right after `--target-loss` is the next flag, not a target
    for next in [&["--out", out][..], &["--json", "--out", out]] {
        let e = fails(&[RUN, LINK, &["--target-loss"], next].concat());
        assert!(e.contains("a value is required for '--target-loss"), "{next:?}: {e}");
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    }
    // a list that starts with a negative number is still read as the flag's value, on any
    // flag that takes a list
    let e = fails(
        &[
            RUN,
            LINK,
            &[
                "--target-loss",
                "0.5",
                "--predict-gbps",
                "1,2",
                "--predict-latency-us",
                "-1,5",
                "--out",
                out,
            ],
        ]
        .concat(),
    );
    assert!(e.contains("--predict-latency-us must be"), "{e}");
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "nothing is written");
}

#[test]
fn a_policy_listed_twice_is_refused_in_one_line_before_anything_runs() {
    let d = dir("study_policy_twice");
    let (out, tb) = (d.join("out"), d.join("tb"));
    let run = without(RUN, "--policy");
    let e = fails(
        &[
            &run,
            LINK,
            &["--policy", "allreduce,fp16,allreduce", "--target-loss", "0.5"],
            &["--out", out.to_str().unwrap(), "--tensorboard", tb.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(e.contains("--policy lists allreduce twice (entries 1 and 3)"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    // and a sweep of policies alike
    let sweep = [&["sweep"], &run[1..]].concat();
    let e = fails(
        &[
            &sweep[..],
            &["--policy", "allreduce,fp16,allreduce"],
            &["--out", out.to_str().unwrap(), "--tensorboard", tb.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(e.contains("--policy lists allreduce twice (entries 1 and 3)"), "{e}");
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "nothing is written");
}

#[test]
fn a_flag_the_study_would_not_read_or_would_read_twice_is_refused_before_anything_runs() {
    let d = dir("study_unread");
    let out = d.join("out");
    let run = without(RUN, "--policy");
    let study = |extra: &[&str]| {
        fails(
            &[
                &run[..],
                &["--policy", "allreduce,fp16", "--out", out.to_str().unwrap()],
                extra,
            ]
            .concat(),
        )
    };
    for (extra, says) in [
        (
            &["--net-gbps", "1", "--target-loss", "0.5", "--zero", "1"][..],
            "--zero 1 with --policy: name zero1 in --policy instead",
        ),
        (
            &["--net-gbps", "1", "--target-loss", "0.5", "--comm-hook", "fp16"],
            "--comm-hook fp16 with --policy",
        ),
        (
            &["--net-gbps", "1", "--target-loss", "0.5,0.3,0.5"],
            "--target-loss lists 0.5 twice (entries 1 and 3)",
        ),
        (
            &[
                "--net-gbps",
                "1",
                "--target-loss",
                "0.5",
                "--predict-world-sizes",
                "4,8,4",
            ],
            "--predict-world-sizes lists 4 twice (entries 1 and 3)",
        ),
        (
            &[
                "--net-gbps",
                "1",
                "--target-loss",
                "0.5",
                "--predict-world-sizes",
                "100000000",
            ],
            "--predict-world-sizes must each be between 1 and",
        ),
        (
            &["--net-gbps", "1", "--target-loss", "0.5", "--predict-gbps", "10,1"],
            "--predict-gbps 1 at 0 µs repeats the link of --net-gbps",
        ),
    ] {
        let e = study(extra);
        assert!(e.contains(says), "{extra:?}: {e}");
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    }
    // one bandwidth at two latencies is two links
    let e = study(&[
        "--net-gbps",
        "1",
        "--target-loss",
        "0.5",
        "--predict-gbps",
        "1",
        "--predict-latency-us",
        "100",
        "--zero",
        "2",
    ]);
    assert!(e.contains("--zero 2 with --policy"), "{e}");
    assert!(!out.exists(), "nothing is written");
}

/// A study of `policies` on the small MLP of 10 classes at `lr`, 6 steps on 2 ranks, into `out`.
fn at_lr(policies: &str, lr: &str, out: &str) -> Vec<String> {
    [
        "study",
        "--model",
        "mlp",
        "--widths",
        "16,32,10",
        "--batch-size",
        "8",
        "--world-size",
        "2",
        "--steps",
        "6",
        "--net-gbps",
        "1",
        "--target-loss",
        "2.45",
        "--lr",
        lr,
        "--policy",
        policies,
        "--out",
        out,
    ]
    .map(String::from)
    .to_vec()
}

/// The rows of `summary` (a study_summary.csv) by column name: `column(row, name)`.
fn cell<'a>(summary: &'a str, policy: &str, name: &str) -> &'a str {
    let header: Vec<&str> = summary.lines().next().unwrap().split(',').collect();
    let k = header.iter().position(|h| *h == name).expect(summary);
    let row = summary
        .lines()
        .find(|l| l.starts_with(&format!("{policy},")))
        .expect(summary);
    row.split(',').nth(k).unwrap()
}

#[test]
fn a_diverged_policy_is_named_reaches_no_target_and_the_others_are_kept() {
    // at this learning rate allreduce's loss overflows at step 5 of 6; top-k's, which sends 1%
    // of the gradient, grows slower and stays finite (both orders of magnitude from the edge)
    let d = dir("study_diverged");
    let out = d.to_str().unwrap();
    let args = at_lr("allreduce,topk:0.01", "2e5", out);
    let run = crate::common::brigade(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let (text, err) = (
        String::from_utf8_lossy(&run.stdout).into_owned(),
        String::from_utf8_lossy(&run.stderr).into_owned(),
    );
    assert!(run.status.success(), "one policy finished: {err}");
    let notes: Vec<&str> = err.lines().filter(|l| l.contains("diverged")).collect();
    assert_eq!(notes.len(), 1, "{err}");
    assert!(
        notes[0].starts_with("note: allreduce: ") && notes[0].contains("diverged at step 5"),
        "{err}"
    );
    let summary = std::fs::read_to_string(d.join("study_summary.csv")).unwrap();
    let curves = std::fs::read_to_string(d.join("study.csv")).unwrap();
    let chart = std::fs::read_to_string(d.join("study.svg")).unwrap();
    for (name, t) in [
        ("stdout", &text),
        ("summary", &summary),
        ("curves", &curves),
        ("chart", &chart),
    ] {
        assert!(!t.to_lowercase().contains("nan"), "{name}: {t}");
    }
    assert_eq!(cell(&summary, "allreduce", "diverged_at_step"), "5", "{summary}");
    assert_eq!(cell(&summary, "allreduce", "steps_to_2.45"), "-", "{summary}");
    assert_eq!(cell(&summary, "topk:0.01", "diverged_at_step"), "-", "{summary}");
    assert_eq!(cell(&summary, "topk:0.01", "steps_to_2.45"), "1", "{summary}");
    // the steps before the divergence are kept
    assert_eq!(
        curves.lines().filter(|l| l.starts_with("allreduce,")).count(),
        5,
        "{curves}"
    );
}

#[test]
fn a_study_whose_every_policy_diverged_fails_in_one_line_after_writing_its_rows() {
    let d = dir("study_all_diverged");
    let out = d.to_str().unwrap();
    let args = at_lr("allreduce,fp16", "1e30", out);
    let run = crate::common::brigade(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert_eq!(run.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains("every policy diverged"), "{err}");
    for policy in ["allreduce", "fp16"] {
        assert!(
            err.lines()
                .any(|l| l.starts_with(&format!("note: {policy}: ")) && l.contains("diverged at step 1")),
            "{err}"
        );
    }
    let summary = std::fs::read_to_string(d.join("study_summary.csv")).unwrap();
    assert!(!summary.to_lowercase().contains("nan"), "{summary}");
    assert_eq!(cell(&summary, "fp16", "diverged_at_step"), "1", "{summary}");
    assert_eq!(cell(&summary, "fp16", "steps_to_2.45"), "-", "{summary}");
    // a run that trains on past a non-finite loss diverged there all the same
    let mut args = args;
    args.push("--allow-nonfinite".into());
    let run = crate::common::brigade(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert_eq!(run.status.code(), Some(1), "{err}");
    let summary = std::fs::read_to_string(d.join("study_summary.csv")).unwrap();
    let curves = std::fs::read_to_string(d.join("study.csv")).unwrap();
    for t in [&summary, &curves] {
        assert!(!t.to_lowercase().contains("nan"), "{t}");
    }
    assert_eq!(cell(&summary, "allreduce", "diverged_at_step"), "1", "{summary}");
    assert_eq!(cell(&summary, "allreduce", "steps_to_2.45"), "-", "{summary}");
}

#[test]
fn an_interrupted_study_writes_the_policies_that_finished_and_exits_130() {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    let d = dir("study_interrupted");
    let out = d.join("out");
    let policies = "allreduce,fp16,bf16,int8,powersgd:1,powersgd:2,zero1,zero2";
    // a study writes nothing until it ends, so whether a policy has finished when the signal
    // comes is the machine's pace: a try where none had (the study says so, exits 130 and
    // writes nothing) is made again with twice the wait, so that a loaded machine makes the
    // test slower, not failed
    for wait_ms in [1500, 3000, 6000, 12000, 24000, 48000] {
        let mut cmd = Command::new(crate::common::bin());
        // SAFETY: `signal` is async-signal-safe, which is all a pre-exec hook may call.
        unsafe {
            cmd.pre_exec(|| {
                crate::common::default_disposition();
                Ok(())
            });
        }
        let args = small(
            policies,
            &["--steps", "3000", "--target-loss", "1.3"],
            out.to_str().unwrap(),
        );
        let mut child = cmd
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start brigade");
        std::thread::sleep(std::time::Duration::from_millis(wait_ms));
        crate::common::send_signal(&child, "INT");
        let (status, err) = crate::common::wait_to_end(&mut child);
        assert_eq!(status.code(), Some(130), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        match std::fs::read_to_string(out.join("study_summary.csv")) {
            Ok(summary) => {
                // one row per policy that finished (one link, one world)
                let rows = summary.lines().skip(1).count();
                assert!((1..8).contains(&rows), "{summary}");
                assert!(
                    err.contains(&format!("interrupted after {rows} of 8 policies")),
                    "{err}"
                );
                assert!(out.join("study.csv").exists() && out.join("study.svg").exists());
                return;
            }
            Err(_) => assert!(err.contains("nothing was written"), "{err}"),
        }
    }
    panic!("no policy of the study finished within 48 s, in six tries");
}

#[test]
fn a_studys_outputs_are_checked_before_its_first_policy_trains() {
    let d = dir("study_outputs_first");
    let (out, tb) = (d.join("out"), d.join("tb"));
    let run = |more: &[&str]| {
        let mut args = small(
            "allreduce,fp16",
            &["--steps", "3", "--target-loss", "1.3"],
            out.to_str().unwrap(),
        );
        args.extend(more.iter().map(|s| s.to_string()));
        fails(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    // nothing trained: no policy wrote its TensorBoard events
    let trained = || tb.join("allreduce").exists();
    // one of --out's files is a directory
    std::fs::create_dir_all(out.join("study.svg")).unwrap();
    let e = run(&["--tensorboard", tb.to_str().unwrap()]);
    assert!(
        e.contains("--out") && e.contains("study.svg") && e.lines().count() == 1,
        "{e}"
    );
    assert!(!trained(), "{e}");
    std::fs::remove_dir(out.join("study.svg")).unwrap();
    // a policy's TensorBoard entry is a file
    std::fs::create_dir_all(&tb).unwrap();
    std::fs::write(tb.join("fp16"), "not a directory").unwrap();
    let e = run(&["--tensorboard", tb.to_str().unwrap()]);
    assert!(
        e.contains("--tensorboard") && e.contains("fp16") && e.lines().count() == 1,
        "{e}"
    );
    assert!(!trained() && !out.join("study.csv").exists(), "{e}");
    std::fs::remove_file(tb.join("fp16")).unwrap();
    // --tensorboard is one of --out's files
    let inside = out.join("study.csv");
    let e = run(&["--tensorboard", inside.to_str().unwrap()]);
    assert!(
        e.contains("--tensorboard") && e.contains("--out") && e.lines().count() == 1,
        "{e}"
    );
    assert!(!inside.join("allreduce").exists(), "{e}");
}

#[test]
fn a_study_refused_after_its_outputs_were_checked_removes_the_tensorboard_directories_it_made() {
    let d = dir("study_refused_tensorboard");
    let tb = d.join("tb").join("runs");
    // two steps are the study's warm-up alone: the library refuses them, after the outputs'
    // checks made --tensorboard's directories
    let args = small(
        "allreduce,fp16",
        &[
            "--steps",
            "2",
            "--target-loss",
            "1.3",
            "--tensorboard",
            tb.to_str().unwrap(),
        ],
        d.join("out").to_str().unwrap(),
    );
    let e = fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(e.contains("warm-up steps") && e.trim_end().lines().count() == 1, "{e}");
    assert!(!d.join("tb").exists(), "{e}");
}

#[test]
fn a_diloco_that_never_synced_says_so_in_the_studys_notes() {
    // diloco:10 first syncs after 10 steps, streaming-diloco:10:2 after 5 (fragment 1's
    // offset): a 4-step run reaches neither, and each prediction prices a sync never measured
    let d = dir("study_never_synced");
    let args = small(
        "diloco:10,streaming-diloco:10:2",
        &["--steps", "4", "--target-loss", "1.3"],
        d.to_str().unwrap(),
    );
    let text = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    for (policy, first) in [("diloco:10", 10), ("streaming-diloco:10:2", 5)] {
        let note = text
            .lines()
            .find(|l| l.starts_with(&format!("note: {policy}: ")))
            .expect(&text);
        assert!(
            note.contains(&format!(
                "{policy} never synced in 4 steps (its first sync comes after {first})"
            )) && note.contains("prices the sync from its wire model"),
            "{note}"
        );
    }
}

#[test]
fn a_policy_that_never_did_its_thing_says_so_in_the_studys_notes() {
    // PowerSGD from iteration 100 in a 3-step run never compresses: the study says so, as
    // `train` and `sweep` do
    let d = dir("study_never_compressed");
    let out = d.to_str().unwrap();
    let args = small(
        "allreduce,powersgd:4@100",
        &["--steps", "3", "--target-loss", "1.3"],
        out,
    );
    let text = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let notes: Vec<&str> = text.lines().filter(|l| l.starts_with("note: ")).collect();
    assert!(
        notes.len() == 1 && notes[0].starts_with("note: powersgd:4@100: ") && notes[0].contains("never compressed"),
        "{text}"
    );
}

#[test]
fn a_policy_whose_syncs_all_run_behind_later_steps_is_told_why_it_has_no_band() {
    // streaming DiLoCo sends nothing in its buckets; each fragment's sync overlaps the next
    // step, so no profiled step holds a whole collective to fit its link to
    let d = dir("study_overlapped_band");
    let out = d.to_str().unwrap();
    let args = small("streaming-diloco:2:2", &["--steps", "8", "--target-loss", "1.3"], out);
    let text = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let notes: Vec<&str> = text.lines().filter(|l| l.starts_with("note: ")).collect();
    assert!(
        notes.len() == 1 && notes[0].contains("run behind the next steps") && notes[0].contains("no error band"),
        "{text}"
    );
}

#[test]
fn a_study_on_the_machines_own_link_says_what_its_measured_step_is_and_where_validation_went() {
    let d = dir("study-own-link-notes");
    let args = [
        "study",
        "--model",
        "mlp",
        "--widths",
        "16,32,32,4",
        "--world-size",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "3",
        "--policy",
        "allreduce",
        "--target-loss",
        "1",
        "--predict-gbps",
        "1,10",
        "--val-fraction",
        "0.25",
        "--eval-every",
        "1",
        "--out",
        d.to_str().unwrap(),
    ];
    let out = ok(&args);
    assert!(
        out.contains("note: measured_step_ms is each policy's step on this machine's own link"),
        "{out}"
    );
    assert!(out.contains("--tensorboard DIR writes it (train/val_loss)"), "{out}");
    // on a simulated link the measured step is that link's: no note
    let out = ok(&[&args[..], &["--net-gbps", "5"]].concat());
    assert!(!out.contains("own link"), "{out}");
}

#[test]
fn a_policy_that_cannot_run_on_the_model_is_refused_before_any_policy_trains() {
    let d = dir("study-refused");
    let (out, tb) = (d.join("out"), d.join("tb"));
    // the MLP has 4 parameters: 8 fragments cannot be made, found when the policy is built
    let line = fails(
        &[
            &without(RUN, "--policy")[..],
            LINK,
            &["--target-loss", "1", "--out", s(&out), "--tensorboard", s(&tb)],
            &["--policy", "allreduce,streaming-diloco:8:8"],
        ]
        .concat(),
    );
    assert!(
        line.contains("streaming-diloco:8:8") && line.contains("8 fragments"),
        "{line}"
    );
    assert!(line.contains("before any trains"), "{line}");
    // nothing trained: no policy's events, no outputs
    assert!(!tb.join("allreduce").exists(), "allreduce trained before the refusal");
    assert!(std::fs::read_dir(&out).map_or(true, |mut e| e.next().is_none()));
}

#[test]
fn a_policy_spec_of_a_tiny_number_names_its_tensorboard_directory_in_exponent_form() {
    let d = dir("study-tb-exponent");
    let (out, tb) = (d.join("out"), d.join("tb"));
    let json = ok(&[
        &without(RUN, "--policy")[..],
        LINK,
        &[
            "--target-loss",
            "1",
            "--out",
            s(&out),
            "--tensorboard",
            s(&tb),
            "--json",
        ],
        &["--policy", "topk:1e-300"],
    ]
    .concat());
    let results: Vec<Value> = serde_json::from_str(&json).unwrap();
    // 1e-300 in Rust's plain form is 302 characters, longer than a file name may be
    assert_eq!(results[0]["policy"], "topk:1e-300");
    assert!(tb.join("topk:1e-300").is_dir());
}

#[test]
fn a_refused_study_leaves_no_directory_it_made() {
    let d = dir("study_refused_out");
    let out = d.join("new").join("out");
    let tb = d.join("tb").join("runs");
    // refused by the library's check of the request, after --out and --tensorboard are made:
    // 1 step is no step past the warm-up
    let run = without(RUN, "--steps");
    let e = fails(
        &[
            &run,
            LINK,
            &[
                "--steps",
                "1",
                "--target-loss",
                "0.5",
                "--out",
                s(&out),
                "--tensorboard",
                s(&tb),
            ],
        ]
        .concat(),
    );
    assert!(e.contains("warm-up"), "{e}");
    assert_eq!(
        std::fs::read_dir(&d).unwrap().count(),
        0,
        "nothing is left in {}",
        d.display()
    );
    // a directory that was there stays
    std::fs::create_dir(d.join("was")).unwrap();
    fails(
        &[
            &run,
            LINK,
            &["--steps", "1", "--target-loss", "0.5", "--out", s(&d.join("was"))],
        ]
        .concat(),
    );
    assert!(d.join("was").is_dir());
}

#[test]
fn a_powersgd_run_that_never_compressed_is_predicted_as_the_all_reduce_it_ran_at_every_world() {
    // at one rank nothing crosses a link, so the profiled buckets cannot tell a plain step from
    // a compressed one: the run's own word that it never compressed prices it plainly at 64
    let d = dir("study_never_compressed_at_one_rank");
    let out = d.to_str().unwrap();
    let mut args = small(
        "allreduce,powersgd:2@10",
        &[
            "--steps",
            "4",
            "--target-loss",
            "0",
            "--predict-world-sizes",
            "64",
            "--json",
        ],
        out,
    );
    for (flag, value) in [("--world-size", "1"), ("--net-gbps", "0.001")] {
        let i = args.iter().position(|a| a == flag).unwrap();
        args[i + 1] = value.into();
    }
    let json = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let results: Vec<Value> = serde_json::from_str(&json).unwrap();
    let at_64 = |r: &Value| {
        let p = r["predictions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["world_size"] == 64);
        p.and_then(|p| p["step_s"].as_f64()).expect("predicted at 64")
    };
    let (plain, psgd) = (at_64(&results[0]), at_64(&results[1]));
    // the link's bytes dominate both steps at 1 Mb/s: the same bytes, within the compute's noise
    assert!(
        psgd > 0.8 * plain && psgd < 1.25 * plain,
        "powersgd {psgd} s, allreduce {plain} s"
    );
    let note = results[1]["note"].as_str().unwrap();
    assert!(
        note.contains("never compressed") && note.contains("plain all-reduce it ran"),
        "{note}"
    );
}

#[test]
fn the_trained_world_listed_among_the_worlds_to_predict_at_is_refused_as_a_repeated_link_is() {
    let d = dir("study_trained_world_again");
    let e = fails(
        &[
            RUN,
            LINK,
            &[
                "--predict-world-sizes",
                "4,2",
                "--target-loss",
                "0.5",
                "--out",
                d.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(
        e.contains("--predict-world-sizes 2 is the world the study trains at (--world-size 2)"),
        "{e}"
    );
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
}
