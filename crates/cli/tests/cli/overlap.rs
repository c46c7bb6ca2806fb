//! The simulated network as the sweep measures it: with ranks as threads every rank shares one
//! link, so each bucket's time on the link is the ring model's, whatever the threads' skew.

use crate::common;

use common::{dir, ok};

/// The run both tests record: the small MLP on 2 ranks (1 thread each) over a simulated 1 Gb/s,
/// 20 us link, 4 steps of 8 rows per rank.
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
    "--steps",
    "4",
    "--net-gbps",
    "1",
    "--net-latency-us",
    "20",
];

#[test]
fn the_sweeps_bucket_times_add_up_to_the_ring_model_of_the_gradient() {
    // mlp 64,256,256,4: 83,460 f32 parameters = 333,840 bytes. 2 ranks on a 1 Gb/s, 20 us link:
    // each bucket costs 2·20 us + S / 125e6 B/s, so the buckets together cost
    // buckets·40 us + 333,840 / 125e6 s = buckets·0.04 ms + 2.67072 ms.
    let out = dir("sweep-link");
    let json = ok(&[
        &["sweep"],
        RUN,
        &[
            "--warmup",
            "1",
            "--bucket-mb",
            "0.05,1",
            "--first-bucket-mb",
            "0.05",
            "--json",
            "--out",
            out.to_str().unwrap(),
        ],
    ]
    .concat());
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        let buckets = r["buckets"].as_f64().unwrap();
        let want = buckets * 0.04 + 333_840.0 / 125e6 * 1e3;
        let got = r["comm_ms"].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 0.01 * want,
            "cap {}: {got} ms on the link, the ring model says {want} ms",
            r["bucket_mb"]
        );
    }
}

/// Trains 2 ranks on a 1 Gb/s, 20 us simulated link and writes the last step's profile.
fn profile(tag: &str) -> (std::path::PathBuf, serde_json::Value) {
    policy_profile(tag, &[])
}

#[test]
fn a_profile_records_every_ranks_step_in_order() {
    let (_, v) = profile("profile-shape");
    assert_eq!(v["version"], 1);
    assert_eq!(v["world_size"], 2);
    let params = v["params"].as_array().unwrap();
    assert_eq!(params.len(), 6);
    assert_eq!(params[0]["name"], "layers.0.weight");
    assert_eq!(params[0]["bytes"], 64 * 256 * 4);
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        let f = |k: &str| r[k].as_f64().unwrap();
        let (b0, b1) = (f("backward_start_s"), f("backward_end_s"));
        assert!(b0 < b1 && b1 <= f("optimizer_start_s") && f("optimizer_start_s") <= f("optimizer_end_s"));
        assert!(f("optimizer_end_s") <= f("step_end_s"));
        for t in r["grad_ready_s"].as_array().unwrap() {
            let t = t.as_f64().unwrap();
            assert!(
                b0 <= t && t <= b1,
                "a gradient ready at {t} outside backward {b0}..{b1}"
            );
        }
        let buckets = r["buckets"].as_array().unwrap();
        assert!(buckets.len() >= 2, "{} buckets", buckets.len());
        let mut previous_start = 0.0;
        for b in buckets {
            let g = |k: &str| b[k].as_f64().unwrap();
            assert!(
                g("ready_s") <= g("launch_s") + 1e-6 && g("launch_s") <= g("start_s") + 1e-6,
                "{b}"
            );
            // in launch order on the link (a bucket's finish includes its hook's last step, which
            // can run a little after the next bucket took the link)
            assert!(g("start_s") >= previous_start && g("finish_s") >= g("start_s"), "{b}");
            previous_start = g("start_s");
        }
    }
}

#[test]
fn predict_answers_for_caps_and_links_from_one_profile() {
    let (p, v) = profile("predict");
    let p = p.to_str().unwrap();
    let rows = |extra: &[&str]| -> Vec<serde_json::Value> {
        let mut args = vec!["predict", "--profile", p, "--json", "--bucket-mb", "0.05,0.1,1,25"];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&args)).unwrap()
    };
    let fast = rows(&["--net-gbps", "100"]);
    let slow = rows(&["--net-gbps", "0.1", "--net-latency-us", "20"]);
    let measured = rows(&["--measured-link"]);
    for r in fast.iter().chain(&slow).chain(&measured) {
        let (e, lb) = (
            r["exposed_comm_s"].as_f64().unwrap(),
            r["lower_bound_exposed_s"].as_f64().unwrap(),
        );
        assert!(lb <= e + 1e-12, "{r}");
        assert!(r["predicted_step_s"].as_f64().unwrap() >= r["compute_step_s"].as_f64().unwrap());
    }
    for (f, s) in fast.iter().zip(&slow) {
        assert!(f["exposed_comm_s"].as_f64().unwrap() < s["exposed_comm_s"].as_f64().unwrap());
    }
    // at the recorded cap, on the fitted link, the buckets take what the recorded ones took
    let recorded: f64 = v["ranks"][0]["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["finish_s"].as_f64().unwrap() - b["start_s"].as_f64().unwrap())
        .sum();
    let predicted = measured[1]["comm_s"].as_f64().unwrap();
    assert!(
        (predicted - recorded).abs() <= 0.05 * recorded,
        "predicted {predicted} s on the link, recorded {recorded} s"
    );
}

#[test]
fn predict_refuses_what_it_cannot_answer_in_one_line() {
    let (p, _) = profile("predict-errors");
    let p = p.to_str().unwrap();
    assert!(common::fails(&["predict", "--profile", p]).contains("--measured-link"));
    assert!(common::fails(&["predict", "--profile", p, "--net-gbps", "1", "--measured-link"]).contains("pick one"));
    assert!(
        common::fails(&["predict", "--profile", "/nonexistent/p.json", "--measured-link"])
            .contains("/nonexistent/p.json")
    );
    let junk = dir("predict-junk").join("junk.json");
    std::fs::write(&junk, "{\"version\": 7}").unwrap();
    assert!(
        common::fails(&["predict", "--profile", junk.to_str().unwrap(), "--measured-link"])
            .contains("not a step profile")
    );
    let link = ["--net-gbps", "1"];
    let with = |extra: &[&str]| common::fails(&[&["predict", "--profile", p][..], &link, extra].concat());
    assert!(with(&["--bucket-mb", "1,1"]).contains("lists 1 twice"));
    assert!(with(&["--bucket-mb", "1e300"]).contains("got 1e300"));
    assert!(with(&["--world-size", "18446744073709551615"]).contains("--world-size must be between"));
    let e = common::fails(&["predict", "--profile", p, "--measured-link", "--net-latency-us", "5"]);
    assert!(e.contains("goes with --net-gbps"), "{e}");
}

/// [`profile`] under `policy` (its flags).
fn policy_profile(tag: &str, policy: &[&str]) -> (std::path::PathBuf, serde_json::Value) {
    let d = dir(tag);
    let p = d.join("profile.json");
    let args = [
        &["train"],
        RUN,
        &[
            "--bucket-mb",
            "0.1",
            "--first-bucket-mb",
            "0.05",
            "--quiet",
            "--profile",
            p.to_str().unwrap(),
        ],
        policy,
    ]
    .concat();
    ok(&args);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    (p, v)
}

#[test]
fn predict_replays_fp16_powersgd_and_zero1_profiles_under_their_own_collectives() {
    for (spec, flags) in [
        ("fp16", &["--comm-hook", "fp16"][..]),
        (
            "powersgd:1@2",
            &["--comm-hook", "powersgd", "--powersgd-start-iter", "2"][..],
        ),
        ("zero1", &["--zero", "1"][..]),
    ] {
        let (p, v) = policy_profile(&format!("predict-{}", spec.replace([':', '@'], "-")), flags);
        assert_eq!(v["policy"]["name"], spec, "the profile names its policy");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&ok(&[
            "predict",
            "--profile",
            p.to_str().unwrap(),
            "--json",
            "--measured-link",
            "--bucket-mb",
            "0.1",
            "--first-bucket-mb",
            "0.05",
        ]))
        .unwrap();
        assert_eq!(rows[0]["policy"], spec);
        // at the recorded caps the replay sends, bucket by bucket, what the step sent
        let wire = |buckets: &serde_json::Value| -> Vec<f64> {
            buckets
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["wire_bytes"].as_f64().unwrap())
                .collect()
        };
        let (predicted, recorded) = (wire(&rows[0]["buckets"]), wire(&v["ranks"][0]["buckets"]));
        assert_eq!(predicted.len(), recorded.len(), "{spec}");
        for (a, b) in predicted.iter().zip(&recorded) {
            assert!(
                (a - b).abs() <= 1e-9 * b.max(1.0),
                "{spec}: predicted {predicted:?}, recorded {recorded:?}"
            );
        }
    }
}

#[test]
fn predict_refuses_a_user_policy_without_a_wire_model_in_one_line() {
    let (p, mut v) = policy_profile("predict-user", &[]);
    // as a user's policy that declares no wire model records itself
    v["policy"] = serde_json::json!({ "name": "int8", "wire": null });
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
    let e = common::fails(&["predict", "--profile", p.to_str().unwrap(), "--measured-link"]);
    assert!(e.contains("'int8'") && e.contains("wire model"), "{e}");
}

#[test]
fn a_zero3_profile_records_each_units_gathers_for_forward_and_backward() {
    let (_, v) = policy_profile("profile-zero3", &["--zero", "3"]);
    assert_eq!(v["policy"]["name"], "zero3");
    for r in v["ranks"].as_array().unwrap() {
        let f = |k: &str| r[k].as_f64().unwrap();
        let gathers = r["gathers"].as_array().expect("a zero3 profile lists its gathers");
        let of = |phase: &str| -> Vec<&str> {
            gathers
                .iter()
                .filter(|g| g["phase"] == phase)
                .map(|g| g["unit"].as_str().unwrap())
                .collect()
        };
        // forward: each unit in turn, the head twice (the MLP's loss runs in its scope);
        // backward: the reverse
        assert_eq!(of("forward"), ["layers.0", "layers.1", "layers.2", "layers.2"]);
        assert_eq!(of("backward"), ["layers.2", "layers.1", "layers.0"]);
        // in this step as in the first, each forward gather after the first is issued ahead
        // of its unit (prefetched while the unit before it computes)
        let forward: Vec<&serde_json::Value> = gathers.iter().filter(|g| g["phase"] == "forward").collect();
        for g in &forward[1..3] {
            assert!(
                g["issued_s"].as_f64().unwrap() < g["needed_s"].as_f64().unwrap(),
                "prefetched: {g}"
            );
        }
        let mut previous_issue = 0.0;
        for g in gathers {
            let t = |k: &str| g[k].as_f64().unwrap();
            assert!(t("issued_s") >= previous_issue, "in issue order: {g}");
            previous_issue = t("issued_s");
            assert!(
                t("issued_s") <= t("start_s") + 1e-6 && t("start_s") <= t("finish_s"),
                "{g}"
            );
            let needed = t("needed_s");
            // the compute needs a forward gather before backward begins, a backward one inside it
            if g["phase"] == "forward" {
                assert!(needed <= f("backward_start_s"), "{g}");
            } else {
                assert!(f("backward_start_s") <= needed && needed <= f("backward_end_s"), "{g}");
            }
            assert_eq!(g["bytes"].as_u64().unwrap() % (2 * 4), 0, "padded to the world: {g}");
        }
    }
    // plain DDP records none
    let (_, plain) = profile("profile-no-gathers");
    assert!(plain["ranks"][0].get("gathers").is_none());
}

/// A `--zero 3` profile of [`RUN`] over a simulated link of `gbps`.
fn zero3_profile(tag: &str, gbps: &str) -> (std::path::PathBuf, serde_json::Value) {
    let d = dir(tag);
    let p = d.join("profile.json");
    let mut run: Vec<&str> = RUN.to_vec();
    let at = run.iter().position(|a| *a == "--net-gbps").unwrap();
    run[at + 1] = gbps;
    ok(&[
        &["train"],
        &run[..],
        &["--zero", "3", "--quiet", "--profile", p.to_str().unwrap()],
    ]
    .concat());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    (p, v)
}

/// The recorded step: the mean over the ranks of their step's end.
fn recorded_step_s(v: &serde_json::Value) -> f64 {
    let ranks = v["ranks"].as_array().unwrap();
    ranks.iter().map(|r| r["step_end_s"].as_f64().unwrap()).sum::<f64>() / ranks.len() as f64
}

/// What the compute waited for the gathers in the recorded step (mean over the ranks).
fn recorded_gather_wait_s(v: &serde_json::Value) -> f64 {
    let ranks = v["ranks"].as_array().unwrap();
    let waited = |g: &serde_json::Value| (g["finish_s"].as_f64().unwrap() - g["needed_s"].as_f64().unwrap()).max(0.0);
    ranks
        .iter()
        .map(|r| r["gathers"].as_array().unwrap().iter().map(waited).sum::<f64>())
        .sum::<f64>()
        / ranks.len() as f64
}

#[test]
fn predict_replays_a_zero3_step_with_its_gathers_on_the_measured_and_on_another_link() {
    // at 0.25 Gb/s the link, not the shared cores' noise, makes most of the step
    let (p, v) = zero3_profile("predict-zero3", "0.25");
    let p = p.to_str().unwrap();
    let row = |extra: &[&str]| -> serde_json::Value {
        let args = [&["predict", "--profile", p, "--json", "--bucket-mb", "25"][..], extra].concat();
        let rows: Vec<serde_json::Value> = serde_json::from_str(&ok(&args)).unwrap();
        rows[0].clone()
    };
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    // the recorded step, replayed on the link it had
    let measured = row(&["--measured-link"]);
    assert_eq!(measured["policy"], "zero3");
    assert_eq!(measured["gathers"].as_array().unwrap().len(), 7, "{measured}");
    let recorded = recorded_step_s(&v);
    let predicted = f(&measured, "predicted_step_s");
    // The tolerances are for one recorded step of wall time on 2 shared cores while the other
    // tests run (a stall the replay does not have shows as -25%); the model's accuracy is
    // measured in scripts/plan-validation.py and docs/BENCHMARKS.md. Without the gathers in
    // the replay the predicted wait is 0 and the 0.1 Gb/s step is off by 37%.
    assert!(
        (predicted - recorded).abs() <= 0.35 * recorded,
        "predicted {predicted} s, recorded {recorded} s"
    );
    let (waited, predicted_wait) = (recorded_gather_wait_s(&v), f(&measured, "exposed_gather_s"));
    assert!(waited > 0.0, "the gathers at 0.25 Gb/s are not all hidden");
    assert!(
        (predicted_wait - waited).abs() <= 0.5 * waited,
        "predicted {predicted_wait} s waited for gathers, recorded {waited} s"
    );
    // a slower link: a longer step, more of it waiting for gathers, and what a run on that link
    // records
    let slow = row(&["--net-gbps", "0.1", "--net-latency-us", "20"]);
    assert!(f(&slow, "predicted_step_s") > predicted, "{slow}");
    assert!(f(&slow, "exposed_gather_s") > 2.0 * predicted_wait, "{slow}");
    let (_, run_slow) = zero3_profile("predict-zero3-slow", "0.1");
    let (recorded_slow, predicted_slow) = (recorded_step_s(&run_slow), f(&slow, "predicted_step_s"));
    assert!(
        (predicted_slow - recorded_slow).abs() <= 0.3 * recorded_slow,
        "predicted {predicted_slow} s at 0.1 Gb/s, a run there recorded {recorded_slow} s"
    );
    // the table says what the gathers cost
    let table = ok(&["predict", "--profile", p, "--measured-link"]);
    assert!(table.contains("parameter gathers: 7 per step"), "{table}");
}
