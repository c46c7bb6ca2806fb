//! `brigade sweep --repeat` (the table it writes, not its timings) and `brigade train
//! --bucket-mb auto` (the same losses as a fixed cap, and the cap it reports).

use crate::common;

use common::{dir, fails, ok, s};

/// The small MLP of the overlap tests (333,840 bytes of gradients) on 2 ranks, 1 thread each,
/// over a simulated 1 Gb/s, 20 us link.
const RUN: &[&str] = &[
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
    "--net-gbps",
    "1",
    "--net-latency-us",
    "20",
];

#[test]
fn a_repeated_sweep_writes_one_row_per_cap_with_medians_predictions_and_a_verdict() {
    let out = dir("sweep-repeat");
    let json = ok(&[
        &["sweep"],
        RUN,
        &[
            "--steps",
            "3",
            "--warmup",
            "1",
            "--repeat",
            "2",
            "--bucket-mb",
            "0.05,1",
            "--first-bucket-mb",
            "0.05",
            "--json",
            "--out",
            s(&out),
        ],
    ]
    .concat());
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(rows.len(), 2);
    let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    let header: Vec<&str> = lines[0].split(',').collect();
    assert_eq!(
        header,
        [
            "bucket_mb",
            "buckets",
            "runs",
            "step_ms",
            "step_spread_ms",
            "compute_only_ms",
            "compute_only_spread_ms",
            "comm_ms",
            "last_bucket_ms",
            "exposed_comm_ms",
            "exposed_spread_ms",
            "waited_ms",
            "predicted_wait_ms",
            "predicted_step_ms",
            "predicted_exposed_ms",
            "lower_bound_ms",
            "excess_over_bound_ms",
            "hidden_share",
            "verdict"
        ]
    );
    assert_eq!(lines.len(), 3, "{csv}");
    for (line, row) in lines[1..].iter().zip(&rows) {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells.len(), header.len(), "{line}");
        let at = |c: &str| cells[header.iter().position(|h| *h == c).unwrap()];
        assert_eq!(at("runs"), "2");
        assert_eq!(row["runs"], 2);
        // the model's columns are filled: a profile was recorded by every run
        for c in [
            "waited_ms",
            "predicted_wait_ms",
            "predicted_step_ms",
            "predicted_exposed_ms",
            "lower_bound_ms",
        ] {
            let v: f64 = at(c).parse().unwrap_or_else(|_| panic!("{c} in {line}"));
            assert!(v >= 0.0, "{c} in {line}");
        }
        assert!(["at bound", "above bound"].contains(&at("verdict")), "{line}");
        // (that the predicted wait is the model's, never below the cap's own bound, is
        // checked on a recorded profile in report::sweep_stats: here the row's profiles are
        // fresh runs of two caps, whose compute a loaded machine stretches unevenly)
        let num = |c: &str| -> f64 { at(c).parse().unwrap() };
        // the predicted exposed comm is the predicted step over the measured compute-only step
        let exp = (num("predicted_step_ms") - num("compute_only_ms")).max(0.0);
        assert!((num("predicted_exposed_ms") - exp).abs() <= 2e-3, "{line}");
    }
    // the predicted curve is drawn beside the measured one
    let svg = std::fs::read_to_string(out.join("sweep.svg")).unwrap();
    let texts = common::svg_texts(&svg);
    for label in [
        "step time",
        "predicted step",
        "predicted exposed",
        "lower bound (exposed)",
    ] {
        assert!(texts.iter().any(|t| t == label), "{label} missing from {texts:?}");
    }
    assert!(out.join("timeline_0.05MiB.json").exists() && out.join("timeline_1MiB.json").exists());
}

/// `--losses` and the `--json` summary of a 6-step run with `bucket` flags.
fn train(tag: &str, bucket: &[&str]) -> (Vec<(usize, f64)>, serde_json::Value) {
    let d = dir(tag);
    let losses = d.join("losses.csv");
    let json = ok(&[
        &["train"],
        RUN,
        &[
            "--steps",
            "6",
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            "--first-bucket-mb",
            "0.05",
            "--json",
            "--losses",
            s(&losses),
        ],
        bucket,
    ]
    .concat());
    (common::losses(&losses), serde_json::from_str(&json).unwrap())
}

#[test]
fn auto_trains_as_a_fixed_cap_and_reports_the_cap_it_chose() {
    // auto starts at 25 MiB (one bucket after the first) and must adopt its only candidate,
    // 0.05 MiB (several buckets), at its first check, however much slower the model predicts
    // it from the recorded step (a gain of -1e9: a slower candidate is adopted unless it is
    // predicted a billion times slower); it re-checks after steps 2 and 4
    let (tuned, summary) = train(
        "auto",
        &[
            "--bucket-mb",
            "auto",
            "--autotune-caps",
            "0.05",
            "--autotune-min-gain",
            "-1e9",
            "--autotune-every",
            "2",
        ],
    );
    let (fixed, fixed_summary) = train("auto-fixed", &["--bucket-mb", "25"]);
    assert_eq!(tuned.len(), 6);
    for ((s, a), (_, b)) in tuned.iter().zip(&fixed) {
        assert!((a - b).abs() <= 1e-6, "step {s}: auto {a} vs fixed {b}");
    }
    let t = &summary["autotune"];
    assert_eq!(t["cap_mb"], 0.05, "{t}");
    let decisions = t["decisions"].as_array().unwrap();
    let after: Vec<u64> = decisions.iter().map(|d| d["after_step"].as_u64().unwrap()).collect();
    assert_eq!(after, [0, 2, 4], "{t}");
    assert_eq!(decisions[0]["changed"], true);
    assert_eq!(decisions[0]["from_cap_mb"], 25.0);
    assert!(t["predicted_step_ms"].as_f64().unwrap() > 0.0 && t["measured_step_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(summary["flags"]["bucket_mb"], "auto");
    // the cap changed, so the buckets did: 0.05 MiB splits what 25 MiB keeps together
    assert!(
        summary["buckets"].as_u64().unwrap() > fixed_summary["buckets"].as_u64().unwrap(),
        "{summary} vs {fixed_summary}"
    );
    assert!(fixed_summary["autotune"].is_null());
}

#[test]
fn autotune_flags_refuse_what_they_cannot_do_in_one_line() {
    let base = &[
        "train", "--model", "mlp", "--widths", "8,8,2", "--steps", "1", "--quiet",
    ];
    let err = fails(&[&base[..], &["--autotune-every", "2"]].concat());
    assert!(err.contains("--bucket-mb auto"), "{err}");
    let err = fails(&[&base[..], &["--bucket-mb", "auto", "--autotune-every", "0"]].concat());
    assert!(err.contains("--autotune-every"), "{err}");
    let err = fails(&[&base[..], &["--bucket-mb", "auto", "--comm-hook", "powersgd"]].concat());
    assert!(err.contains("powersgd"), "{err}");
    let err = fails(&[&base[..], &["--bucket-mb", "fast"]].concat());
    assert!(err.contains("auto"), "{err}");
    let err = fails(&[&base[..], &["--bucket-mb", "auto", "--autotune-caps", "1,5,1"]].concat());
    assert!(err.contains("lists 1 twice"), "{err}");
    let err = fails(&[&base[..], &["--bucket-mb", "auto", "--autotune-caps", "1e-300"]].concat());
    assert!(err.contains("at least one byte"), "{err}");
    // int8's all-gathers have a wire model: the overlap model costs them, so its cap tunes
    ok(&[
        &base[..],
        &[
            "--world-size",
            "2",
            "--autotune-every",
            "1",
            "--bucket-mb",
            "auto",
            "--policy",
            "int8",
        ],
    ]
    .concat());
    // a --policy sweep runs each policy once, with its own ZeRO stage
    for extra in [["--repeat", "3"], ["--zero", "1"]] {
        let err = fails(
            &[
                &[
                    "sweep",
                    "--model",
                    "mlp",
                    "--widths",
                    "8,8,2",
                    "--steps",
                    "2",
                    "--policy",
                    "allreduce,fp16",
                ][..],
                &extra,
                &["--out", s(&dir("policy-flags"))],
            ]
            .concat(),
        );
        assert!(err.contains(extra[0]) && err.contains("--policy"), "{err}");
    }
    let out = dir("sweep-auto");
    let err = fails(&[
        "sweep",
        "--model",
        "mlp",
        "--widths",
        "8,8,2",
        "--steps",
        "2",
        "--bucket-mb",
        "1,auto",
        "--out",
        s(&out),
    ]);
    assert!(err.contains("brigade train"), "{err}");
    let err = fails(&[
        "sweep",
        "--model",
        "mlp",
        "--widths",
        "8,8,2",
        "--steps",
        "2",
        "--repeat",
        "0",
        "--out",
        s(&out),
    ]);
    assert!(err.contains("--repeat"), "{err}");
}

#[test]
fn profile_steps_writes_each_step_of_the_range_and_predict_reads_the_list() {
    let d = dir("profile-steps");
    let p = d.join("steps.json");
    ok(&[
        &["train"],
        RUN,
        &[
            "--steps",
            "4",
            "--bucket-mb",
            "0.1",
            "--quiet",
            "--profile",
            s(&p),
            "--profile-steps",
            "1..3",
        ],
    ]
    .concat());
    let v: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(v.len(), 2, "steps 1 and 2");
    for step in &v {
        assert_eq!(step["version"], 2);
        assert_eq!(step["ranks"].as_array().unwrap().len(), 2);
    }
    // two different steps, not one step twice
    assert_ne!(v[0]["ranks"][0]["step_end_s"], v[1]["ranks"][0]["step_end_s"]);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&ok(&[
        "predict",
        "--profile",
        s(&p),
        "--measured-link",
        "--json",
        "--bucket-mb",
        "0.1,1",
    ]))
    .unwrap();
    assert_eq!(rows.len(), 2);
    let base = ["train", "--model", "mlp", "--widths", "8,8,2", "--steps", "2"];
    let err = fails(&[&base[..], &["--profile-steps", "0..1"]].concat());
    assert!(err.contains("--profile"), "{err}");
    let err = fails(&[&base[..], &["--profile", s(&p), "--profile-steps", "1..5"]].concat());
    assert!(err.contains("--steps 2"), "{err}");
    let err = fails(&[&base[..], &["--profile", s(&p), "--profile-steps", "3..3"]].concat());
    assert!(err.contains("no step"), "{err}");
}

#[test]
fn a_streaming_diloco_profile_records_its_fragments_and_the_wait_behind_an_earlier_sync() {
    // Fragment 0 (the first two layers, 98% of the elements) is issued after step 4 and
    // overlaps step 5 (DELAY 1); on a 0.005 Gb/s link its sync (about 530 ms) outlasts step 5's
    // backward (under a millisecond: the link's time leaves room for a rank thread that a
    // busy machine does not run for a while), and the ranks' agreement after it queues behind
    // the sync.
    let d = dir("streaming-profile");
    let p = d.join("steps.json");
    let mut run = RUN.to_vec();
    let gbps = run.iter().position(|a| *a == "--net-gbps").unwrap() + 1;
    run[gbps] = "0.005";
    ok(&[
        &["train"],
        &run[..],
        &[
            "--policy",
            "streaming-diloco:4:2",
            "--steps",
            "6",
            "--quiet",
            "--profile",
            s(&p),
            "--profile-steps",
            "1..6",
        ],
    ]
    .concat());
    let v: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let parts = v[0]["policy"]["after_step"]["parts"].as_array().unwrap().clone();
    let share = |k: usize| parts[k]["share"].as_f64().unwrap();
    assert_eq!(parts.len(), 2);
    assert!((share(0) + share(1) - 1.0).abs() < 1e-9 && share(0) > 0.95, "{parts:?}");
    assert_eq!(
        parts[0]["collectives"], 1,
        "one all-reduce of one flat buffer a fragment"
    );
    // step 5 is the fifth step (from 0: the list's fourth, steps 1..6)
    for r in v[3]["ranks"].as_array().unwrap() {
        let left = r["policy_s"]["in_flight_until_s"].as_f64().unwrap_or(0.0);
        let f = |k: &str| r[k].as_f64().unwrap();
        assert!(left > f("backward_end_s") && left <= f("optimizer_start_s"), "{r}");
    }
    // the steps before fragment 0 was issued waited for no sync of an earlier step
    assert!(v[0]["ranks"][0]["policy_s"]["in_flight_until_s"].is_null(), "{}", v[0]);
}
