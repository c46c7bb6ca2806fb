//! `brigade study`: every policy trains, its table and CSVs agree with its run's losses, and
//! the chart is written.

use serde_json::Value;

use crate::common::{dir, fails, ok};

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
            "1e9,-1,1.3",
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
        let losses: Vec<f64> = r["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_f64().unwrap())
            .collect();
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
        assert_eq!(row[9], steps_col(1e9), "{policy}");
        assert_eq!(row[11], steps_col(-1.0), "{policy}");
        assert_eq!(row[13], steps_col(1.3), "{policy}");
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
