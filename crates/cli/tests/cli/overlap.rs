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

/// Trains 2 ranks on a 1 Gb/s, 20 us simulated link and writes the last step's profile: its
/// directory, its path and its contents.
fn profile(tag: &str) -> (common::Scratch, std::path::PathBuf, serde_json::Value) {
    policy_profile(tag, &[])
}

#[test]
fn a_profile_records_every_ranks_step_in_order() {
    let (_, _, v) = profile("profile-shape");
    assert_eq!(v["version"], 2);
    assert_eq!(v["world_size"], 2);
    // what the policy computed itself: inside reduce, and its buckets' time on the comm stream
    for r in v["ranks"].as_array().unwrap() {
        assert!(r["policy_s"]["reduce_s"].as_f64().unwrap() > 0.0, "{r}");
        for b in r["buckets"].as_array().unwrap() {
            let link = b["link_s"].as_f64().unwrap();
            let span = b["finish_s"].as_f64().unwrap() - b["start_s"].as_f64().unwrap();
            assert!(link > 0.0 && link <= span + 1e-9, "{b}");
        }
    }
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

/// A step profile that `tests/fixtures/record_profiles.sh` recorded once with the real code
/// (see there what ran, and how to record it again): its path and its JSON. `brigade predict`
/// replays it, and the tests assert what the replay computes from its numbers, never what a
/// fresh run's wall clock says (the other tests load the same two cores); how well a replay
/// predicts a fresh run is measured by scripts/predict-validation.py.
fn fixture(name: &str) -> (String, serde_json::Value) {
    let p = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let v = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    (p, v)
}

/// `a` equals `b` up to the rounding of a few float operations.
fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-9 * b.abs().max(1e-6), "{what}: {a} against {b}");
}

/// Each bucket's (or gather's) time on the link, in a replayed row or a recorded rank.
fn link_times(list: &serde_json::Value) -> Vec<f64> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|b| b["finish_s"].as_f64().unwrap() - b["start_s"].as_f64().unwrap())
        .collect()
}

#[test]
fn predict_answers_for_caps_and_links_from_one_profile() {
    let (p, v) = fixture("profile_allreduce.json");
    let rows = |extra: &[&str]| -> Vec<serde_json::Value> {
        let mut args = vec!["predict", "--profile", &p, "--json", "--bucket-mb", "0.05,0.1,1,25"];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&args)).unwrap()
    };
    let fast = rows(&["--net-gbps", "100"]);
    let slow = rows(&["--net-gbps", "0.1", "--net-latency-us", "20"]);
    let measured = rows(&["--measured-link"]);
    // The gradients in rank 0's recorded ready order: layers.2's weight (parameter 4: 4,096
    // bytes) and bias (5: 16), layers.1's weight (2: 262,144) and bias (3: 1,024), layers.0's
    // weight (0: 65,536) and bias (1: 1,024), 333,840 bytes in all. A bucket closes once it
    // holds its cap, the first bucket's cap being the smaller of 1 MiB and the cap: 0.05 MiB
    // (52,428 bytes) makes [4 5 2] [3 0] [1]; 0.1 MiB (104,857) [4 5 2] [3 0 1], the buckets
    // the step ran; 1 and 25 MiB one bucket.
    let ready: Vec<f64> = v["ranks"][0]["grad_ready_s"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_f64().unwrap())
        .collect();
    let mut order: Vec<usize> = (0..6).collect();
    order.sort_by(|&a, &b| ready[a].total_cmp(&ready[b]));
    assert_eq!(order, [4, 5, 2, 3, 0, 1], "the fixture's ready order (re-record it?)");
    let groups: [&[&[u64]]; 4] = [
        &[&[4, 5, 2], &[3, 0], &[1]],
        &[&[4, 5, 2], &[3, 0, 1]],
        &[&[4, 5, 2, 3, 0, 1]],
        &[&[4, 5, 2, 3, 0, 1]],
    ];
    for (r, want) in fast.iter().chain(&slow).chain(&measured).zip(groups.iter().cycle()) {
        let got: Vec<Vec<u64>> = r["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                b["params"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p.as_u64().unwrap())
                    .collect()
            })
            .collect();
        assert_eq!(got, *want, "cap {}", r["bucket_cap_mb"]);
        let (e, lb) = (
            r["exposed_comm_s"].as_f64().unwrap(),
            r["lower_bound_exposed_s"].as_f64().unwrap(),
        );
        assert!(lb <= e + 1e-12, "{r}");
        assert!(r["predicted_step_s"].as_f64().unwrap() >= r["compute_step_s"].as_f64().unwrap());
    }
    // A ring all-reduce of S bytes on 2 ranks: 2 latencies and S bytes over the link. At
    // 100 Gb/s without latency every cap's buckets take 333,840 B / 12.5e9 B/s = 26.7072 us;
    // at 0.1 Gb/s and 20 us, buckets x 40 us + 333,840 B / 12.5e6 B/s = 26.7072 ms.
    for ((f, s), want) in fast.iter().zip(&slow).zip(&groups) {
        close(f["comm_s"].as_f64().unwrap(), 26.7072e-6, "100 Gb/s");
        let buckets = want.len() as f64;
        close(s["comm_s"].as_f64().unwrap(), buckets * 40e-6 + 26.7072e-3, "0.1 Gb/s");
        assert!(f["exposed_comm_s"].as_f64().unwrap() < s["exposed_comm_s"].as_f64().unwrap());
    }
    // The measured link is the line duration = a + b x bytes fitted to rank 0's two recorded
    // buckets: through both points when the larger one took longer (which the fixture holds),
    // so at the recorded caps each bucket takes on it what it took in the recorded step.
    let recorded = link_times(&v["ranks"][0]["buckets"]);
    let bytes: Vec<f64> = v["ranks"][0]["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["bytes"].as_f64().unwrap())
        .collect();
    let slope = (recorded[0] - recorded[1]) / (bytes[0] - bytes[1]);
    assert!(
        slope > 0.0 && recorded[1] - slope * bytes[1] >= 0.0,
        "the fixture's buckets: {recorded:?} s for {bytes:?} bytes (re-record it)"
    );
    let replayed = link_times(&measured[1]["buckets"]);
    assert_eq!(replayed.len(), 2);
    for (k, (a, b)) in replayed.iter().zip(&recorded).enumerate() {
        close(*a, *b, &format!("bucket {k} on the measured link"));
    }
}

#[test]
fn predict_refuses_what_it_cannot_answer_in_one_line() {
    let (p, _) = fixture("profile_allreduce.json");
    let p = p.as_str();
    assert!(common::fails(&["predict", "--profile", p]).contains("--measured-link"));
    assert!(common::fails(&["predict", "--profile", p, "--net-gbps", "1", "--measured-link"]).contains("pick one"));
    assert!(
        common::fails(&["predict", "--profile", "/nonexistent/p.json", "--measured-link"])
            .contains("/nonexistent/p.json")
    );
    let junk_dir = dir("predict-junk");
    let junk = junk_dir.join("junk.json");
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
fn policy_profile(tag: &str, policy: &[&str]) -> (common::Scratch, std::path::PathBuf, serde_json::Value) {
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
    (d, p, v)
}

#[test]
fn predict_replays_fp16_powersgd_zero1_and_int8_profiles_under_their_own_collectives() {
    for (spec, flags) in [
        ("fp16", &["--comm-hook", "fp16"][..]),
        (
            "powersgd:1@2",
            &["--comm-hook", "powersgd", "--powersgd-start-iter", "2"][..],
        ),
        ("zero1", &["--zero", "1"][..]),
        ("int8", &["--policy", "int8"][..]),
    ] {
        let (_d, p, v) = policy_profile(&format!("predict-{}", spec.replace([':', '@'], "-")), flags);
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
    let (_d, p, mut v) = policy_profile("predict-user", &[]);
    // as a user's policy that declares no wire model records itself
    v["policy"] = serde_json::json!({ "name": "int8", "wire": null });
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
    let e = common::fails(&["predict", "--profile", p.to_str().unwrap(), "--measured-link"]);
    assert!(e.contains("'int8'") && e.contains("wire model"), "{e}");
}

#[test]
fn a_zero3_profile_records_each_units_gathers_for_forward_and_backward() {
    let (_, _, v) = policy_profile("profile-zero3", &["--zero", "3"]);
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
        // forward: each unit in turn (the MLP's loss runs in the last one's gather); backward:
        // the reverse
        assert_eq!(of("forward"), ["layers.0", "layers.1", "layers.2"]);
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
    let (_, _, plain) = profile("profile-no-gathers");
    assert!(plain["ranks"][0].get("gathers").is_none());
}

#[test]
fn predict_replays_a_zero3_step_with_its_gathers_on_the_measured_and_on_another_link() {
    let (p, v) = fixture("profile_zero3.json");
    let row = |extra: &[&str]| -> serde_json::Value {
        let args = [&["predict", "--profile", &p, "--json", "--bucket-mb", "25"][..], extra].concat();
        let rows: Vec<serde_json::Value> = serde_json::from_str(&ok(&args)).unwrap();
        rows[0].clone()
    };
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    let units = |gathers: &serde_json::Value| -> Vec<(String, String, u64)> {
        gathers
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                let s = |k: &str| g[k].as_str().unwrap().to_string();
                (s("unit"), s("phase"), g["bytes"].as_u64().unwrap())
            })
            .collect()
    };
    // layers.0 holds 256 x 64 + 256 floats (66,560 bytes), layers.1 256 x 256 + 256 (263,168),
    // layers.2 4 x 256 + 4 (4,112; 1,028 floats, even: no padding for 2 ranks). Forward
    // gathers each unit in turn, the head twice (recorded when the MLP's loss entered the head's
    // scope a second time); backward
    // the reverse. ZeRO-3's buckets are its units' gradients, whatever the cap.
    let (l0, l1, l2) = (66_560, 263_168, 4_112);
    let expected = [
        ("layers.0", "forward", l0),
        ("layers.1", "forward", l1),
        ("layers.2", "forward", l2),
        ("layers.2", "forward", l2),
        ("layers.2", "backward", l2),
        ("layers.1", "backward", l1),
        ("layers.0", "backward", l0),
    ]
    .map(|(u, ph, b)| (u.to_string(), ph.to_string(), b));
    assert_eq!(units(&v["ranks"][0]["gathers"]), expected, "the fixture");
    let measured = row(&["--measured-link"]);
    assert_eq!(measured["policy"], "zero3");
    assert_eq!(units(&measured["gathers"]), expected, "{measured}");
    let buckets: Vec<serde_json::Value> = measured["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["params"].clone())
        .collect();
    assert_eq!(buckets, [[5, 4], [3, 2], [1, 0]].map(|b| serde_json::json!(b)));
    // On 2 ranks an all-gather of a unit of S bytes (each rank's shard S/2) takes one latency
    // and S/2 bytes on the link, and so does the reduce-scatter of its S bytes of gradients:
    // on the link the step had (0.25 Gb/s = 31.25e6 B/s, 20 us) 20 us + S/2 / B = 1084.96 us
    // (layers.0), 4230.688 us (layers.1), 85.792 us (layers.2); at 0.1 Gb/s (12.5e6 B/s)
    // 2682.4 us, 10546.72 us, 184.48 us.
    let at = |gbps: &str| row(&["--net-gbps", gbps, "--net-latency-us", "20"]);
    let (recorded_link, slow) = (at("0.25"), at("0.1"));
    for (r, [t0, t1, t2]) in [
        (&recorded_link, [1084.96e-6, 4230.688e-6, 85.792e-6]),
        (&slow, [2682.4e-6, 10546.72e-6, 184.48e-6]),
    ] {
        let by_unit = |u: &str| {
            [("layers.0", t0), ("layers.1", t1), ("layers.2", t2)]
                .iter()
                .find(|x| x.0 == u)
                .unwrap()
                .1
        };
        for (g, t) in expected.iter().zip(link_times(&r["gathers"])) {
            close(t, by_unit(&g.0), &format!("the gather of {} ({})", g.0, g.1));
        }
        for (want, t) in [t2, t1, t0].into_iter().zip(link_times(&r["buckets"])) {
            close(t, want, "a unit's reduce-scatter");
        }
    }
    // The first forward gather, the head's second one and its backward one were issued the
    // moment the compute needed them (on both ranks, as recorded): each holds the compute up
    // for at least its whole time on the link, while the others can hide behind the units
    // before them. So the compute waits at least 1084.96 + 2 x 85.792 = 1256.544 us a step at
    // 0.25 Gb/s and 2682.4 + 2 x 184.48 = 3051.36 us at 0.1 Gb/s (0 if the replay left the
    // gathers out).
    for r in v["ranks"].as_array().unwrap() {
        for k in [0, 3, 4] {
            let g = &r["gathers"][k];
            let t = |k: &str| g[k].as_f64().unwrap();
            assert!(t("issued_s") >= t("needed_s"), "the fixture: {g}");
        }
    }
    assert!(
        f(&recorded_link, "exposed_gather_s") >= 1256.544e-6 - 1e-12,
        "{recorded_link}"
    );
    assert!(f(&slow, "exposed_gather_s") >= 3051.36e-6 - 1e-12, "{slow}");
    // a slower link: a longer step, more of it waiting for the gathers
    assert!(
        f(&slow, "predicted_step_s") > f(&recorded_link, "predicted_step_s"),
        "{slow}"
    );
    assert!(
        f(&slow, "exposed_gather_s") > f(&recorded_link, "exposed_gather_s"),
        "{slow}"
    );
    // the table says what the gathers cost: in the recorded step, each rank's sum of
    // (finish - needed) where positive, the mean over the ranks; and the row's prediction
    let waited: f64 = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["gathers"].as_array().unwrap())
        .map(|g| (g["finish_s"].as_f64().unwrap() - g["needed_s"].as_f64().unwrap()).max(0.0))
        .sum::<f64>()
        / 2.0;
    let table = ok(&["predict", "--profile", &p, "--measured-link", "--bucket-mb", "25"]);
    let line = format!(
        "parameter gathers: 7 per step; the compute waited {:.2} ms for them in the recorded step, \
         predicted per row: {:.2} ms",
        waited * 1e3,
        f(&measured, "exposed_gather_s") * 1e3
    );
    assert!(table.contains(&line), "{line} not in:\n{table}");
}

#[test]
fn a_version_1_profile_that_names_no_policy_replays_as_the_default_policy() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/profile_allreduce.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    assert_eq!(v["version"], 1, "the fixture is a version 1 profile");
    v.as_object_mut().unwrap().remove("policy");
    let d = dir("predict-v1-no-policy");
    let p = d.join("profile.json");
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_str(&ok(&[
        "predict",
        "--profile",
        p.to_str().unwrap(),
        "--json",
        "--net-gbps",
        "1",
    ]))
    .unwrap();
    assert_eq!(rows[0]["policy"], "allreduce");
    assert!(rows[0]["predicted_step_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn the_predict_table_shows_the_after_step_sync_so_each_row_adds_up() {
    // On a 0.01 Gb/s link DiLoCo's outer sync (every 2 steps) is most of the predicted step,
    // and it belongs to no bucket: the table gives it a column of its own.
    let d = dir("predict-sync-column");
    for policy in ["diloco:2", "streaming-diloco:4:2"] {
        let p = d.join(format!("{}.json", policy.replace(':', "-")));
        let p = p.to_str().unwrap();
        ok(&[
            "train",
            "--model",
            "mlp",
            "--widths",
            "16,32,32,4",
            "--policy",
            policy,
            "--world-size",
            "2",
            "--steps",
            "4",
            "--profile",
            p,
        ]);
        let args = ["predict", "--profile", p, "--net-gbps", "0.01", "--bucket-mb", "25"];
        let rows: Vec<serde_json::Value> = serde_json::from_str(&ok(&[&args[..], &["--json"]].concat())).unwrap();
        let sync_ms = rows[0]["after_step_comm_s"].as_f64().unwrap() * 1e3;
        assert!(sync_ms > 0.1, "{policy}: {sync_ms} ms");
        let table = ok(&args);
        let mut lines = table.lines().skip_while(|l| !l.contains("bucket_MiB"));
        let head: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        let col = |name: &str| -> f64 {
            let i = head
                .iter()
                .position(|h| *h == name)
                .unwrap_or_else(|| panic!("no {name} in {table}"));
            row[i].parse().unwrap()
        };
        assert!((col("sync_ms") - sync_ms).abs() <= 0.006, "{policy}: {table}");
        // the step is its compute, the exposed bucket time and the sync (within the rounding
        // of the printed columns and the agreement collective's share)
        let parts = col("compute_ms") + col("exposed_ms") + col("sync_ms");
        assert!(
            (col("step_ms") - parts).abs() <= 0.05,
            "{policy}: {parts} ms of parts:\n{table}"
        );
    }
}

#[test]
fn the_predict_table_has_no_sync_column_without_an_after_step_sync() {
    let d = dir("predict-no-sync-column");
    let p = d.join("allreduce.json");
    let p = p.to_str().unwrap();
    ok(&[&["train"], RUN, &["--profile", p]].concat());
    let table = ok(&["predict", "--profile", p, "--net-gbps", "1", "--bucket-mb", "25"]);
    assert!(table.contains("exposed_ms") && !table.contains("sync_ms"), "{table}");
}

#[test]
fn the_lower_bound_is_below_the_exposed_time_of_every_row_at_any_world_size() {
    // A bucket's fixed costs (ZeRO's padding to a multiple of the ranks, qgZ's scale per
    // block, int8's scale, top-k's count) are paid once per bucket, not once per parameter:
    // the bound no cap can beat stays below what each cap's replay exposes.
    for (i, policy) in ["zero1", "zero3:qgz", "int8", "topk:0.1"].into_iter().enumerate() {
        let (_d, p, _) = policy_profile(&format!("predict-bound-{i}"), &["--policy", policy]);
        for world in ["64", "1048576"] {
            let out = ok(&[
                "predict",
                "--profile",
                p.to_str().unwrap(),
                "--json",
                "--net-gbps",
                "10",
                "--bucket-mb",
                "0.1,1,25",
                "--world-size",
                world,
            ]);
            let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
            for r in &rows {
                let (bound, exposed) = (
                    r["lower_bound_exposed_s"].as_f64().unwrap(),
                    r["exposed_comm_s"].as_f64().unwrap(),
                );
                assert!(
                    bound <= exposed + 1e-12,
                    "{policy} at {world} ranks, cap {}: bound {bound} > exposed {exposed}",
                    r["bucket_cap_mb"]
                );
            }
        }
    }
}

#[test]
fn the_predict_table_shows_the_loss_agreement_so_each_row_adds_up() {
    // Every step the ranks all-reduce their loss: on 64 ranks at 100 us a message that is
    // 2·63·0.1 ms = 12.6 ms, in no bucket; the table gives it a column of its own.
    let (d, _, mut v) = profile("predict-agreement-column");
    // rank 1 as rank 0: the ranks' spread at backward's end (a loaded machine's) would part the
    // mean step from the exposed time, which counts from the last rank's backward
    let mut twin = v["ranks"][0].clone();
    twin["rank"] = 1.into();
    v["ranks"][1] = twin;
    let p = d.join("twins.json");
    std::fs::write(&p, v.to_string()).unwrap();
    let args = [
        "predict",
        "--profile",
        p.to_str().unwrap(),
        "--net-gbps",
        "1",
        "--net-latency-us",
        "100",
        "--bucket-mb",
        "1",
        "--world-size",
        "64",
    ];
    let rows: Vec<serde_json::Value> = serde_json::from_str(&ok(&[&args[..], &["--json"]].concat())).unwrap();
    let agree_ms = rows[0]["agreement_comm_s"].as_f64().unwrap() * 1e3;
    assert!((12.6..13.0).contains(&agree_ms), "{agree_ms} ms");
    let table = ok(&args);
    let mut lines = table.lines().skip_while(|l| !l.contains("bucket_MiB"));
    let head: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let col = |name: &str| -> f64 {
        let i = head
            .iter()
            .position(|h| *h == name)
            .unwrap_or_else(|| panic!("no {name} in {table}"));
        row[i].parse().unwrap()
    };
    // the step is its compute, the exposed bucket time and the agreement (within the rounding
    // of the printed columns)
    let parts = col("compute_ms") + col("exposed_ms") + col("agree_ms");
    assert!((col("step_ms") - parts).abs() <= 0.02, "{parts} ms of parts:\n{table}");
}

#[test]
fn a_run_that_stops_before_its_profile_window_says_the_window_was_not_reached() {
    // --lr 1e30 diverges the run at step 1: steps 5..10 are never run
    let d = dir("profile-window-not-reached");
    let p = d.join("p.json");
    let out = common::brigade(&[
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
        "10",
        "--lr",
        "1e30",
        "--quiet",
        "--profile-steps",
        "5..10",
        "--profile",
        p.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the run stopped after step 0, before --profile-steps 5..10"),
        "{err}"
    );
    assert!(!err.contains("no synchronized step"), "{err}");
    assert!(!p.exists());
}
