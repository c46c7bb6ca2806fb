//! Bytes sent per step per rank, per policy (`brigade train --json` and its summary), and the
//! policy axis of `brigade sweep --policy`, against expectations computed here from the
//! model's shapes.

use crate::common;

use common::{dir, fails, ok, s};
use serde_json::Value;

/// The MLP of these tests: widths 16, 32, 32, 4; parameters `[out, in]` weights and `[out]` biases.
const WIDTHS: [usize; 4] = [16, 32, 32, 4];

/// Flags of both `train` and `sweep` (`train` adds `--quiet`).
fn mlp_flags() -> Vec<&'static str> {
    vec![
        "--model",
        "mlp",
        "--widths",
        "16,32,32,4",
        "--lr",
        "0.05",
        "--optimizer",
        "sgd",
        "--world-size",
        "2",
        "--batch-size",
        "8",
        "--threads-per-rank",
        "1",
    ]
}

/// Every parameter's shape, in registration order.
fn shapes() -> Vec<Vec<usize>> {
    WIDTHS.windows(2).flat_map(|w| [vec![w[1], w[0]], vec![w[1]]]).collect()
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// One all-reduce of every gradient in f32: 4 bytes per element.
fn all_reduce_bytes() -> u64 {
    4 * shapes().iter().map(|s| numel(s)).sum::<usize>() as u64
}

/// PowerSGD rank `r` once compressing, per PyTorch's rule: a matrix n x m (n = shape[0]) with
/// r' = min(r, n, m) is sent as P (n x r') and Q (m x r') when (n + m) r' * 2 < n m (min
/// compression rate 2); everything else is all-reduced whole. All in f32.
fn powersgd_bytes(r: usize) -> u64 {
    let elements: usize = shapes()
        .iter()
        .map(|shape| {
            let len = numel(shape);
            if shape.len() < 2 {
                return len;
            }
            let (n, m) = (shape[0], len / shape[0]);
            let r = r.min(n).min(m);
            if (n + m) * r * 2 < n * m {
                (n + m) * r
            } else {
                len
            }
        })
        .sum();
    4 * elements as u64
}

/// The one-off bucket rebuild after step 0 broadcasts rank 0's ready order: one u32 per parameter.
fn rebuild_bytes() -> u64 {
    4 * shapes().len() as u64
}

/// `brigade train --json` with `extra` flags: the summary object.
fn train_json(extra: &[&str]) -> Value {
    let mut args = vec!["train", "--steps", "4", "--json", "--quiet"];
    args.extend(mlp_flags());
    args.extend_from_slice(extra);
    let out = ok(&args);
    serde_json::from_str(out.lines().last().expect("one JSON line")).expect("JSON summary")
}

fn by_step(v: &Value) -> Vec<u64> {
    v["sent_bytes_by_step"]
        .as_array()
        .expect("sent_bytes_by_step")
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect()
}

#[test]
fn bytes_sent_per_step_are_what_each_policy_puts_on_its_collectives() {
    let full = all_reduce_bytes();
    // widths 16,32,32,4: 16*32 + 32 + 32*32 + 32 + 32*4 + 4 = 1732 gradients, 6928 bytes
    assert_eq!(full, 6928);
    let rebuild = rebuild_bytes();

    let plain = train_json(&[]);
    assert_eq!(by_step(&plain), [full + rebuild, full, full, full]);
    assert_eq!(plain["sent_bytes_last_step"].as_u64(), Some(full));
    assert_eq!(plain["sent_bytes_total"].as_u64(), Some(4 * full + rebuild));
    // world 2: an all-reduce sends 2(2-1)/2 = 1 x its buffer, the rebuild's broadcast 1/2 x
    let wire = plain["wire_bytes_per_step"].as_f64().unwrap();
    assert_eq!(wire, (4 * full) as f64 / 4.0 + rebuild as f64 / 2.0 / 4.0);

    let fp16 = train_json(&["--comm-hook", "fp16"]);
    assert_eq!(
        by_step(&fp16),
        [full / 2 + rebuild, full / 2, full / 2, full / 2],
        "half the bytes"
    );

    // rank 2: the [32,16] and [32,32] weights go as P and Q; [4,32] would not shrink by 2
    // ((4 + 32) * 2 * 2 = 144 >= 128) and goes whole with the biases
    let psgd = train_json(&[
        "--comm-hook",
        "powersgd",
        "--powersgd-rank",
        "2",
        "--powersgd-start-iter",
        "2",
    ]);
    let compressed = powersgd_bytes(2);
    assert_eq!(compressed, 4 * (32 + 32 + 4 + 4 * 32 + (32 + 16) * 2 + (32 + 32) * 2));
    assert_eq!(
        by_step(&psgd),
        [full + rebuild, full, compressed, compressed],
        "plain all-reduce before --powersgd-start-iter 2, then the factors"
    );
}

#[test]
fn the_text_summary_names_the_bytes_sent_per_rank() {
    let mut args = vec!["train", "--steps", "2", "--quiet"];
    args.extend(mlp_flags());
    args.extend_from_slice(&["--comm-hook", "bf16"]);
    let out = ok(&args);
    // bf16: 6928 / 2 = 3464 bytes = 3.38 KiB in the last step
    let line = out.lines().find(|l| l.starts_with("sent per rank:")).expect(&out);
    assert!(line.contains("last step 3.38 KiB"), "{line}");
}

#[test]
fn the_text_summary_labels_the_wire_bytes_by_the_policys_collectives_zero_included() {
    // on 4 ranks an all-gather sends (4-1) x its piece, an all-reduce 2(4-1)/4 x its buffer,
    // ZeRO's reduce-scatter (4-1)/4 x its buffer: each line says which it is, ZeRO's too
    let line = |policy: &str| {
        let mut args = vec!["train", "--steps", "2", "--quiet", "--policy", policy];
        args.extend(mlp_flags());
        let i = args.iter().position(|a| *a == "--world-size").unwrap();
        args[i + 1] = "4";
        let out = ok(&args);
        let line = out.lines().find(|l| l.starts_with("sent per rank:"));
        line.unwrap_or_else(|| panic!("{policy}: no sent line in\n{out}"))
            .to_string()
    };
    for (policy, formula) in [
        ("topk:0.1", "(all-gather: (4-1) x payload)"),
        ("efsign", "(all-gather: (4-1) x payload)"),
        ("int8", "(all-gather: (4-1) x payload)"),
        ("allreduce", "(all-reduce: 2(4-1)/4 x payload)"),
        (
            "zero2",
            "(reduce-scatter: (4-1)/4 x its buffer, all-gather: (4-1) x its shard)",
        ),
    ] {
        let l = line(policy);
        assert!(l.ends_with(formula), "{policy}: {l}");
    }
}

/// `brigade sweep --policy ... --json` with `extra` flags into a fresh directory.
fn sweep_rows(tag: &str, policies: &str, extra: &[&str]) -> (Vec<Value>, common::Scratch) {
    let out = dir(tag);
    let mut args = vec![
        "sweep",
        "--steps",
        "4",
        "--json",
        "--policy",
        policies,
        "--out",
        s(&out),
    ];
    args.extend(mlp_flags());
    args.extend_from_slice(extra);
    let stdout = ok(&args);
    let rows: Vec<Value> = serde_json::from_str(&stdout).expect("JSON rows");
    (rows, out)
}

#[test]
fn the_policy_sweep_puts_each_policy_side_by_side() {
    let (rows, out) = sweep_rows(
        "policy-sweep",
        "allreduce,fp16,powersgd:2",
        &["--powersgd-start-iter", "2"],
    );
    let names: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    // each row is named by its policy's spec: --powersgd-start-iter fills in PowerSGD's start
    assert_eq!(names, ["allreduce", "fp16", "powersgd:2@2"]);
    let last = |i: usize| rows[i]["sent_bytes_last_step"].as_u64().unwrap();
    assert_eq!(last(0), all_reduce_bytes());
    assert_eq!(last(1), all_reduce_bytes() / 2);
    assert_eq!(last(2), powersgd_bytes(2));
    for r in &rows {
        assert!(r["final_loss"].as_f64().unwrap().is_finite(), "{r}");
        assert!(r["step_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["exposed_comm_ms"].as_f64().unwrap() >= 0.0, "{r}");
    }
    let csv = std::fs::read_to_string(out.join("policies.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 4, "{csv}");
    assert!(lines[0].starts_with("policy,step_ms,compute_only_ms,exposed_comm_ms,sent_bytes_per_step"));
    assert!(lines[3].starts_with("powersgd:2@2,"), "{csv}");
    let svg = std::fs::read_to_string(out.join("policies.svg")).unwrap();
    assert!(
        svg.contains("powersgd:2@2") && svg.contains("exposed comm"),
        "the chart names the policies"
    );
}

#[test]
fn the_policy_sweep_puts_each_precision_beside_the_others() {
    let (rows, out) = sweep_rows("precision-sweep", "allreduce,zero2", &["--precisions", "f32,bf16"]);
    let names: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["policy"].as_str().unwrap(), r["precision"].as_str().unwrap()))
        .collect();
    // each policy under each precision, in that order
    assert_eq!(
        names,
        [
            ("allreduce", "f32"),
            ("allreduce", "bf16"),
            ("zero2", "f32"),
            ("zero2", "bf16")
        ]
    );
    let last = |i: usize| rows[i]["sent_bytes_last_step"].as_u64().unwrap();
    // bf16 buckets: half the bytes of f32's, under all-reduce and under ZeRO-2
    assert_eq!(last(0), all_reduce_bytes());
    assert_eq!(last(1), all_reduce_bytes() / 2);
    assert_eq!(last(3) * 2, last(2), "{rows:?}");
    let loss = |i: usize| rows[i]["final_loss"].as_f64().unwrap();
    // bf16 rounds: not f32's loss, but near it; ZeRO-2 is all-reduce's arithmetic
    assert_ne!(loss(0), loss(1));
    assert!((loss(1) - loss(0)).abs() < 0.02 * loss(0).abs(), "{rows:?}");
    assert!((loss(2) - loss(0)).abs() < 1e-6, "{rows:?}");
    let csv = std::fs::read_to_string(out.join("policies.csv")).unwrap();
    assert!(csv.lines().next().unwrap().contains(",precision,note"), "{csv}");
    assert!(
        csv.lines().nth(2).unwrap().starts_with("allreduce,") && csv.contains(",bf16,"),
        "{csv}"
    );
    let svg = std::fs::read_to_string(out.join("policies.svg")).unwrap();
    assert!(svg.contains("zero2 bf16"), "the chart names policy and precision");
    // --precisions alone: the run's own policy under each
    let out = dir("precision-sweep-alone");
    let mut args = vec![
        "sweep",
        "--steps",
        "4",
        "--json",
        "--precisions",
        "f32,fp16",
        "--out",
        s(&out),
    ];
    args.extend(mlp_flags());
    let rows: Vec<Value> = serde_json::from_str(&ok(&args)).expect("JSON rows");
    let names: Vec<&str> = rows.iter().map(|r| r["precision"].as_str().unwrap()).collect();
    assert_eq!(names, ["f32", "fp16"]);
    assert!(rows.iter().all(|r| r["policy"] == "allreduce"), "{rows:?}");
    // a precision twice is one line before any run
    let mut args = vec!["sweep", "--steps", "4", "--precisions", "bf16,bf16", "--out", s(&out)];
    args.extend(mlp_flags());
    let e = fails(&args);
    assert!(e.contains("bf16 twice"), "{e}");
    // a row its policy refuses (bf16 compression of fp16 gradients) is its one error line, and
    // the rows that finished before it are written
    let out = dir("precision-sweep-refused");
    let mut args = vec![
        "sweep",
        "--steps",
        "4",
        "--policy",
        "bf16",
        "--precisions",
        "f32,fp16",
        "--out",
        s(&out),
    ];
    args.extend(mlp_flags());
    let e = fails(&args);
    assert!(e.contains("--precision fp16") && e.contains("bf16 compression"), "{e}");
    let csv = std::fs::read_to_string(out.join("policies.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "the header and the f32 row: {csv}");
    assert!(
        csv.lines().nth(1).unwrap().starts_with("bf16,") && csv.contains(",f32,"),
        "{csv}"
    );
}

#[test]
fn the_json_summary_names_the_policy_spec_and_what_it_says() {
    let v = train_json(&["--comm-hook", "powersgd", "--powersgd-start-iter", "2"]);
    assert_eq!(v["policy"], "powersgd:1@2");
    assert_eq!(v["policy_notes"].as_array().unwrap().len(), 0, "{v}");
    // 4 steps, PowerSGD from iteration 10: it never compressed, and the summary says so
    let v = train_json(&["--comm-hook", "powersgd"]);
    assert_eq!(v["policy"], "powersgd:1");
    let notes = v["policy_notes"].as_array().unwrap();
    assert!(
        notes.len() == 1 && notes[0].as_str().unwrap().contains("never compressed"),
        "{v}"
    );
    assert_eq!(train_json(&["--zero", "2"])["policy"], "zero2");
}

#[test]
fn a_row_in_which_powersgd_never_compressed_says_so() {
    // 4 steps, PowerSGD from its default start iteration 10: it never compresses
    let (rows, out) = sweep_rows("policy-never", "allreduce,powersgd:1,powersgd:1@2", &[]);
    let note = |i: usize| rows[i]["note"].as_str().unwrap().to_string();
    assert_eq!(note(0), "");
    assert!(
        note(1).contains("never compressed") && note(1).contains("10"),
        "{}",
        note(1)
    );
    assert_eq!(note(2), "", "powersgd:1@2 compressed");
    let csv = std::fs::read_to_string(out.join("policies.csv")).unwrap();
    assert!(csv.lines().nth(2).unwrap().contains("never compressed"), "{csv}");
}

#[test]
fn bad_policies_are_one_line_before_any_run() {
    let out = dir("policy-errors");
    let run = |policies: &str, extra: &[&str]| {
        let mut args = vec!["sweep", "--steps", "4", "--out", s(&out), "--policy", policies];
        args.extend(mlp_flags());
        args.extend_from_slice(extra);
        fails(&args)
    };
    let e = run("allreduce,foo", &[]);
    assert!(e.contains("unknown policy 'foo'") && e.contains("powersgd:R"), "{e}");
    let e = run("powersgd:0", &[]);
    assert!(e.contains("powersgd:0") && e.contains(">= 1"), "{e}");
    let e = run("powersgd:two", &[]);
    assert!(e.contains("powersgd:R"), "{e}");
    let e = run("fp16,fp16", &[]);
    assert!(e.contains("fp16 twice"), "{e}");
    let e = run("powersgd,powersgd:1", &[]);
    assert!(e.contains("powersgd:1 twice"), "the default --powersgd-rank is 1: {e}");
    let e = run("zero1", &["--bucket-mb", "auto"]);
    assert!(e.contains("--bucket-mb"), "{e}");
    let e = run("allreduce,fp16", &["--bucket-mb", "1,2"]);
    assert!(e.contains("one bucket cap"), "{e}");
    let e = run("allreduce,fp16", &["--powersgd-rank", "4"]);
    assert!(e.contains("powersgd policy"), "{e}");
    let e = run("fp16", &["--comm-hook", "bf16"]);
    assert!(e.contains("--comm-hook bf16 with --policy"), "{e}");
    assert!(!out.join("policies.csv").exists(), "nothing ran, nothing was written");
}

#[test]
fn zero_rows_train_as_all_reduce_and_put_as_many_bytes_on_the_wire() {
    let (rows, _) = sweep_rows("policy-zero", "allreduce,zero1,zero2", &[]);
    let names: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["allreduce", "zero1", "zero2"]);
    let f = |i: usize, k: &str| rows[i][k].as_f64().unwrap();
    for i in 1..3 {
        // ZeRO is plain DDP's arithmetic, sharded
        assert!((f(i, "final_loss") - f(0, "final_loss")).abs() < 1e-6, "{rows:?}");
        // a reduce-scatter plus an all-gather send what one all-reduce does, padding aside
        // (under one element per bucket and rank), and plain DDP's one bucket rebuild aside
        // (its broadcast of 4 bytes per parameter in step 0, spread over the steps)
        let (wire, plain) = (f(i, "wire_bytes_per_step"), f(0, "wire_bytes_per_step"));
        assert!((wire - plain).abs() < 64.0, "{rows:?}");
        // while handing the collectives more payload: 4Ψ(1 + 1/N) against 4Ψ
        assert!(f(i, "sent_bytes_per_step") > f(0, "sent_bytes_per_step"), "{rows:?}");
    }
}

#[test]
fn a_zero3_row_trains_as_zero2_and_gathers_each_unit_twice_a_step() {
    let (rows, out) = sweep_rows("policy-zero3", "zero2,zero3", &[]);
    let names: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["zero2", "zero3"]);
    // ZeRO-3 is ZeRO-2's arithmetic, bit for bit
    assert_eq!(rows[0]["final_loss"], rows[1]["final_loss"], "{rows:?}");
    // both reduce-scatter every gradient; ZeRO-2 all-gathers the updated shards once (4Ψ/N),
    // ZeRO-3 each unit's shards before its forward and before its backward (2 · 4Ψ/N; the
    // MLP's loss runs in the head's gather)
    let last = |i: usize| rows[i]["sent_bytes_last_step"].as_u64().unwrap();
    assert_eq!(last(1) - last(0), all_reduce_bytes() / 2, "{rows:?}");
    for r in &rows {
        assert!(r["step_ms"].as_f64().unwrap() > 0.0, "{r}");
    }
    let csv = std::fs::read_to_string(out.join("policies.csv")).unwrap();
    assert!(csv.lines().nth(2).unwrap().starts_with("zero3,"), "{csv}");
}

#[test]
fn a_sweep_s_out_holds_that_sweep_alone_whichever_kind_wrote_there_before() {
    let out = dir("sweep-kinds");
    let sweep = |extra: &[&str]| {
        let mut args = vec!["sweep", "--steps", "3", "--out", s(&out)];
        args.extend(mlp_flags());
        args.extend_from_slice(extra);
        ok(&args);
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let caps = sweep(&["--bucket-mb", "0.25"]);
    assert!(caps.contains(&"sweep.csv".to_string()), "{caps:?}");
    // the policies' sweep leaves its table and chart, none of the caps' sweep's files
    assert_eq!(sweep(&["--policy", "allreduce,fp16"]), ["policies.csv", "policies.svg"]);
    // and the caps' sweep after it, its own alone again
    assert_eq!(sweep(&["--bucket-mb", "0.25"]), caps);
    // so neither kind takes an input from --out under a name the other writes (it would remove it)
    let init = out.join("timeline_0.25MiB.json");
    for kind in [&["--policy", "allreduce,fp16"][..], &["--bucket-mb", "0.25"]] {
        let mut args = vec!["sweep", "--steps", "3", "--out", s(&out), "--init", s(&init)];
        args.extend(mlp_flags());
        args.extend_from_slice(kind);
        let e = fails(&args);
        assert!(e.contains("under a name a sweep writes"), "{kind:?}: {e}");
        assert!(init.exists(), "{kind:?}: the input was removed");
    }
}

#[test]
fn a_sweep_whose_buckets_sent_nothing_prints_no_negative_zero() {
    // DiLoCo sends nothing in its buckets: the recorded comm is 0, printed as 0.00
    let out = dir("sweep_no_bucket_comm");
    let mut args = vec![
        "sweep",
        "--policy",
        "diloco:2",
        "--bucket-mb",
        "1,5",
        "--steps",
        "3",
        "--out",
        s(&out),
    ];
    args.extend(mlp_flags());
    let text = ok(&args);
    assert!(text.contains(" 0.00 ") && !text.contains("-0.00"), "{text}");
}
