//! `brigade train` end to end: parity of sharding and accumulation, resume, files,
//! and clear errors for bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use brigade_models::{load_safetensors, save_safetensors};
use brigade_tensor::{DType, Rng, Tensor};

fn brigade(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_brigade"))
        .args(args)
        .output()
        .expect("run brigade")
}

fn ok(args: &[&str]) -> String {
    let out = brigade(args);
    assert!(
        out.status.success(),
        "brigade {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The error line of a run that must fail cleanly: non-zero exit, one `error:` line, no panic.
fn fails(args: &[&str]) -> String {
    let out = brigade(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "brigade {args:?} should fail");
    assert!(!err.contains("panicked"), "a panic instead of an error: {err}");
    assert!(err.starts_with("error: "), "{err}");
    err
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("brigade-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn losses(path: &Path) -> Vec<(usize, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| {
            let (s, v) = l.split_once(',').unwrap();
            (s.parse().unwrap(), v.parse().unwrap())
        })
        .collect()
}

fn params(path: &Path) -> Vec<(String, Vec<f64>)> {
    load_safetensors(path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_f64_vec().unwrap()))
        .collect()
}

fn assert_close(a: &[(usize, f64)], b: &[(usize, f64)], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for ((sa, la), (sb, lb)) in a.iter().zip(b) {
        assert_eq!(sa, sb);
        assert!(
            (la - lb).abs() <= tol * la.abs().max(1.0),
            "{what} step {sa}: {la} vs {lb}"
        );
    }
}

fn assert_params_close(a: &Path, b: &Path, tol: f64, what: &str) {
    let (pa, pb) = (params(a), params(b));
    assert_eq!(pa.len(), pb.len());
    for ((na, va), (nb, vb)) in pa.iter().zip(&pb) {
        assert_eq!(na, nb);
        let d = va.iter().zip(vb).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(d <= tol, "{what}: parameter {na} differs by {d}");
    }
}

const MLP: &[&str] = &["--model", "mlp", "--widths", "16,32,32,4", "--lr", "0.05", "--quiet"];
const GPT: &[&str] = &[
    "--model",
    "gpt",
    "--d-model",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--d-ff",
    "64",
    "--context",
    "16",
    "--lr",
    "0.003",
    "--quiet",
];

/// A data file for the small MLP: 64 rows of 16 inputs, labelled by the largest of the
/// first 4 inputs (learnable).
fn mlp_data() -> PathBuf {
    let path = tmp("mlp-data.safetensors");
    let mut rng = Rng::new(9);
    let x = Tensor::randn(&[64, 16], 1.0, DType::F32, &mut rng);
    let xv = x.to_vec::<f32>().unwrap();
    let labels: Vec<i64> = xv
        .chunks(16)
        .map(|r| (0..4).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as i64)
        .collect();
    let y = Tensor::from_vec(labels, &[64]).unwrap();
    save_safetensors(&path, &[("inputs".into(), x), ("targets".into(), y)], None).unwrap();
    path
}

fn run_variant(model: &[&str], extra: &[&str], tag: &str) -> (PathBuf, PathBuf) {
    let (l, p) = (tmp(&format!("{tag}.csv")), tmp(&format!("{tag}.safetensors")));
    let mut args = vec!["train"];
    args.extend_from_slice(model);
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--losses", l.to_str().unwrap(), "--save", p.to_str().unwrap()]);
    ok(&args);
    (l, p)
}

/// `--world-size 2 --batch-size B` == `--world-size 1 --batch-size 2B` == `--batch-size B --accum 2`.
fn sharding_and_accumulation_parity(model: &[&str], extra: &[&str], tag: &str) {
    let mut base = vec!["--steps", "5", "--threads-per-rank", "1"];
    base.extend_from_slice(extra);
    fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
        base.iter().chain(more).copied().collect()
    }
    let (l1, p1) = run_variant(
        model,
        &with(&base, &["--world-size", "1", "--batch-size", "8"]),
        &format!("{tag}-w1"),
    );
    let (l2, p2) = run_variant(
        model,
        &with(&base, &["--world-size", "2", "--batch-size", "4"]),
        &format!("{tag}-w2"),
    );
    let (la, pa) = run_variant(
        model,
        &with(&base, &["--world-size", "1", "--batch-size", "4", "--accum", "2"]),
        &format!("{tag}-acc"),
    );
    let (l4, p4) = run_variant(
        model,
        &with(&base, &["--world-size", "2", "--batch-size", "2", "--accum", "2"]),
        &format!("{tag}-w2acc"),
    );
    let (l8, p8) = run_variant(
        model,
        &with(&base, &["--world-size", "4", "--batch-size", "2"]),
        &format!("{tag}-w4"),
    );
    let reference = losses(&l1);
    // not vacuous: the steps change the model, so the losses move
    assert!(reference.windows(2).all(|w| w[0].1 != w[1].1), "{tag}: {reference:?}");
    assert_close(&losses(&l2), &reference, 1e-5, &format!("{tag} world 2"));
    assert_close(&losses(&la), &reference, 1e-5, &format!("{tag} accum 2"));
    assert_close(&losses(&l4), &reference, 1e-5, &format!("{tag} world 2 accum 2"));
    assert_close(&losses(&l8), &reference, 1e-5, &format!("{tag} world 4"));
    for (p, what) in [
        (&p2, "world 2"),
        (&pa, "accum 2"),
        (&p4, "world 2 accum 2"),
        (&p8, "world 4"),
    ] {
        assert_params_close(p, &p1, 2e-5, &format!("{tag} {what}"));
    }
}

#[test]
fn mlp_shards_and_microbatches_match_the_whole_batch() {
    let data = mlp_data();
    let init = tmp("mlp-init.safetensors");
    // an --init written by another seed: every variant starts from the same file
    ok(&[
        &["train"],
        MLP,
        &["--steps", "0", "--seed", "5", "--save", init.to_str().unwrap()],
    ]
    .concat());
    for opt in ["sgd", "adamw"] {
        let extra = [
            "--data",
            data.to_str().unwrap(),
            "--init",
            init.to_str().unwrap(),
            "--optimizer",
            opt,
        ];
        sharding_and_accumulation_parity(MLP, &extra, &format!("mlp-{opt}"));
    }
}

#[test]
fn gpt_shards_and_microbatches_match_the_whole_batch() {
    for opt in ["sgd", "adamw"] {
        sharding_and_accumulation_parity(GPT, &["--optimizer", opt], &format!("gpt-{opt}"));
    }
}

#[test]
fn resuming_gives_the_losses_of_an_uninterrupted_run() {
    for opt in ["sgd", "adamw"] {
        let ck = tmp(&format!("ck-{opt}.safetensors"));
        let common: Vec<&str> = [MLP, &["--world-size", "2", "--batch-size", "4", "--optimizer", opt]].concat();
        let (full_l, full_p) = run_variant(&common, &["--steps", "6"], &format!("full-{opt}"));
        ok(&[
            &["train"],
            common.as_slice(),
            &["--steps", "3", "--checkpoint", ck.to_str().unwrap()],
        ]
        .concat());
        let (res_l, res_p) = run_variant(
            &common,
            &["--steps", "6", "--resume", ck.to_str().unwrap()],
            &format!("resumed-{opt}"),
        );
        let full = losses(&full_l);
        let resumed = losses(&res_l);
        assert_eq!(
            resumed.first().map(|s| s.0),
            Some(3),
            "the resumed run starts at step 3"
        );
        assert_close(&resumed, &full[3..], 1e-6, &format!("resume {opt}"));
        assert_params_close(&res_p, &full_p, 1e-6, &format!("resume {opt}"));
    }
}

#[test]
fn same_seed_same_losses_and_the_summary_json() {
    let a = ok(&[&["train"], MLP, &["--steps", "4", "--json", "--world-size", "2"]].concat());
    let b = ok(&[&["train"], MLP, &["--steps", "4", "--json", "--world-size", "2"]].concat());
    let (ja, jb): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(a.trim()).unwrap(),
        serde_json::from_str(b.trim()).unwrap(),
    );
    assert_eq!(ja["first_loss"], jb["first_loss"]);
    assert_eq!(ja["last_loss"], jb["last_loss"]);
    assert_eq!(ja["world_size"], 2);
    for k in ["median_step_ms", "min_step_ms", "samples_per_s"] {
        assert!(ja[k].as_f64().unwrap() > 0.0, "{k}: {ja}");
    }
}

#[test]
fn timeline_has_compute_and_comm_tracks_for_every_rank() {
    let tl = tmp("tl.json");
    ok(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "3",
            "--world-size",
            "2",
            "--bucket-mb",
            "0.001",
            "--first-bucket-mb",
            "0.001",
            "--timeline",
            tl.to_str().unwrap(),
        ],
    ]
    .concat());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tl).unwrap()).unwrap();
    let spans: Vec<&serde_json::Value> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    for rank in 0..2 {
        let names: Vec<&str> = spans
            .iter()
            .filter(|e| e["pid"] == rank)
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert!(names.contains(&"forward") && names.contains(&"optimizer"), "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("backward layers.")), "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("all_reduce `bucket0`")), "{names:?}");
        assert!(
            !names.iter().any(|n| n.contains("losses")),
            "only the last step: {names:?}"
        );
    }
    let svg = std::fs::read_to_string(tl.with_extension("svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("comm stream") && svg.contains("bucket0"));
}

#[test]
fn bad_input_gets_one_clear_line() {
    let missing = tmp("does-not-exist.safetensors");
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--init", missing.to_str().unwrap()]].concat());
    assert!(e.contains("does-not-exist"), "{e}");
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--data", missing.to_str().unwrap()]].concat());
    assert!(e.contains("does-not-exist"), "{e}");
    // parameters of another architecture: the first mismatch is named
    let other = tmp("other-init.safetensors");
    ok(&[
        "train",
        "--model",
        "mlp",
        "--widths",
        "16,8,4",
        "--steps",
        "0",
        "--quiet",
        "--save",
        other.to_str().unwrap(),
    ]);
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--init", other.to_str().unwrap()]].concat());
    assert!(e.contains("layers.0.weight"), "{e}");
    let corrupt = tmp("corrupt.safetensors");
    std::fs::write(&corrupt, b"definitely not safetensors").unwrap();
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--init", corrupt.to_str().unwrap()]].concat());
    assert!(e.contains("corrupt"), "{e}");
    fails(&[&["train"], MLP, &["--world-size", "0"]].concat());
    fails(&[&["train"], MLP, &["--bucket-mb", "1,2"]].concat());
    fails(&[&["train"], MLP, &["--lr", "-1"]].concat());
    let e = fails(
        &[
            &["train"],
            MLP,
            &["--steps", "1", "--batch-size", "100", "--world-size", "1"],
            &["--data", mlp_data().to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(e.contains("rows"), "{e}");
    if !cfg!(feature = "mpi") {
        let e = fails(&[&["train"], MLP, &["--backend", "mpi"]].concat());
        assert!(e.contains("--features mpi"), "{e}");
    }
    // a checkpoint for another optimizer
    let ck = tmp("ck-sgd-only.safetensors");
    ok(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "1",
            "--optimizer",
            "sgd",
            "--checkpoint",
            ck.to_str().unwrap(),
        ],
    ]
    .concat());
    let e = fails(
        &[
            &["train"],
            MLP,
            &["--steps", "2", "--optimizer", "adamw", "--resume", ck.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(e.contains("optimizer"), "{e}");
}

#[test]
fn sweep_writes_the_table_the_chart_and_a_timeline_per_bucket_size() {
    let out = tmp("sweep");
    let model: Vec<&str> = MLP.iter().copied().filter(|a| *a != "--quiet").collect();
    let stdout = ok(&[
        &["sweep"],
        model.as_slice(),
        &[
            "--world-size",
            "2",
            "--steps",
            "3",
            "--bucket-mb",
            "0.001,1",
            "--net-gbps",
            "20",
            "--out",
            out.to_str().unwrap(),
        ],
    ]
    .concat());
    assert!(stdout.contains("bucket_MiB"), "{stdout}");
    let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 3, "{csv}");
    let buckets: Vec<usize> = rows[1..]
        .iter()
        .map(|r| r.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    assert!(buckets[0] > buckets[1], "smaller caps make more buckets: {buckets:?}");
    assert!(out.join("sweep.svg").exists());
    assert!(out.join("timeline_0.001MiB.json").exists() && out.join("timeline_1MiB.svg").exists());
}
