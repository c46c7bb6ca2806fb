//! One policy flag: `train --policy SPEC`, `sweep --policy LIST` of the same specs (one spec with
//! several caps is the caps' sweep under it), and `--comm-hook` as a hidden spelling that says
//! the flag's name.

use crate::common;

use common::{brigade, dir, ok, s};
use serde_json::Value;

const MLP: [&str; 12] = [
    "--model",
    "mlp",
    "--widths",
    "16,32,32,4",
    "--optimizer",
    "sgd",
    "--world-size",
    "2",
    "--batch-size",
    "8",
    "--threads-per-rank",
    "1",
];

fn train_json(extra: &[&str]) -> (Value, String) {
    let mut args = vec!["train", "--steps", "3", "--json", "--quiet"];
    args.extend(MLP);
    args.extend_from_slice(extra);
    let out = brigade(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "brigade {args:?} failed:\n{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(stdout.lines().last().expect("one JSON line")).expect("JSON summary");
    (json, stderr)
}

#[test]
fn train_policy_is_the_flag_and_comm_hook_a_hidden_spelling_that_names_it() {
    let (plain, _) = train_json(&[]);
    let (policy, quiet) = train_json(&["--policy", "fp16"]);
    let (hook, note) = train_json(&["--comm-hook", "fp16"]);
    assert_eq!(policy["policy"], "fp16");
    assert_eq!(hook["policy"], "fp16");
    let total = |v: &Value| v["sent_bytes_total"].as_u64().expect("sent_bytes_total");
    assert!(total(&policy) < total(&plain), "fp16 sends fewer bytes than allreduce");
    assert_eq!(total(&hook), total(&policy), "--comm-hook fp16 is --policy fp16");
    assert!(!quiet.contains("--comm-hook"), "{quiet}");
    assert!(
        note.contains("note: --comm-hook is spelled --policy (here --policy fp16)"),
        "{note}"
    );

    let help = ok(&["train", "--help"]);
    assert!(help.contains("--policy <POLICY>"), "{help}");
    assert!(!help.contains("--comm-hook"), "the old spelling is hidden: {help}");
    let help = ok(&["sweep", "--help"]);
    assert_eq!(help.matches("--policy <").count(), 1, "sweep has one --policy: {help}");
    assert!(!help.contains("--comm-hook"), "{help}");
}

/// The bytes rank 0's bucket collectives put in the recorded step of `timeline`.
fn bucket_bytes(timeline: &std::path::Path) -> u64 {
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(timeline).unwrap()).unwrap();
    trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "comm" && e["pid"] == 0)
        .filter(|e| !e["args"]["kind"]["Collective"]["tag"].is_null())
        .map(|e| e["args"]["bytes"].as_u64().unwrap())
        .sum()
}

#[test]
fn sweep_policy_of_one_spec_sweeps_the_caps_under_it() {
    let sweep = |tag: &str, extra: &[&str]| {
        let out = dir(tag);
        let mut args = vec!["sweep", "--steps", "2", "--bucket-mb", "1,4", "--out", s(&out)];
        args.extend(MLP);
        args.extend_from_slice(extra);
        ok(&args);
        out
    };
    let plain = sweep("policy-flag-plain", &[]);
    let fp16 = sweep("policy-flag-fp16", &["--policy", "fp16"]);
    assert!(!fp16.join("policies.csv").exists(), "a sweep of caps, not of policies");
    let csv = std::fs::read_to_string(fp16.join("sweep.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "a header and one row per cap: {csv}");
    for cap in ["1", "4"] {
        let name = format!("timeline_{cap}MiB.json");
        let (half, full) = (bucket_bytes(&fp16.join(&name)), bucket_bytes(&plain.join(&name)));
        assert!(full > 0, "{name}: the plain sweep reduced its buckets");
        assert_eq!(2 * half, full, "{name}: fp16 all-reduces half the bytes");
    }
}
