//! `brigade train` end to end: parity of sharding and accumulation, resume, files,
//! and clear errors for bad input.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use brigade_models::{load_safetensors, load_safetensors_with_metadata};
use common::{brigade, dir, fails, losses, mlp_data, ok, s, svg_texts, GPT, MLP};

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

fn run_variant(dir: &Path, model: &[&str], extra: &[&str], tag: &str) -> (PathBuf, PathBuf) {
    let (l, p) = (dir.join(format!("{tag}.csv")), dir.join(format!("{tag}.safetensors")));
    let mut args = vec!["train"];
    args.extend_from_slice(model);
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--losses", l.to_str().unwrap(), "--save", p.to_str().unwrap()]);
    ok(&args);
    (l, p)
}

/// `--world-size 2 --batch-size B` == `--world-size 1 --batch-size 2B` == `--batch-size B --accum 2`.
fn sharding_and_accumulation_parity(dir: &Path, model: &[&str], extra: &[&str], tag: &str) {
    let mut base = vec!["--steps", "5", "--threads-per-rank", "1"];
    base.extend_from_slice(extra);
    fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
        base.iter().chain(more).copied().collect()
    }
    let (l1, p1) = run_variant(
        dir,
        model,
        &with(&base, &["--world-size", "1", "--batch-size", "8"]),
        &format!("{tag}-w1"),
    );
    let (l2, p2) = run_variant(
        dir,
        model,
        &with(&base, &["--world-size", "2", "--batch-size", "4"]),
        &format!("{tag}-w2"),
    );
    let (la, pa) = run_variant(
        dir,
        model,
        &with(&base, &["--world-size", "1", "--batch-size", "4", "--accum", "2"]),
        &format!("{tag}-acc"),
    );
    let (l4, p4) = run_variant(
        dir,
        model,
        &with(&base, &["--world-size", "2", "--batch-size", "2", "--accum", "2"]),
        &format!("{tag}-w2acc"),
    );
    let (l8, p8) = run_variant(
        dir,
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
    let d = dir("mlp-parity");
    let data = mlp_data(&d, None);
    let init = d.join("mlp-init.safetensors");
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
        sharding_and_accumulation_parity(&d, MLP, &extra, &format!("mlp-{opt}"));
    }
}

#[test]
fn gpt_shards_and_microbatches_match_the_whole_batch() {
    let d = dir("gpt-parity");
    for opt in ["sgd", "adamw"] {
        sharding_and_accumulation_parity(&d, GPT, &["--optimizer", opt], &format!("gpt-{opt}"));
    }
}

/// The bytes of a file.
fn bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn resuming_gives_the_uninterrupted_run_bit_for_bit_and_keeps_the_earlier_losses() {
    let d = dir("resume");
    for opt in ["sgd", "adamw"] {
        let ck = d.join(format!("ck-{opt}.safetensors"));
        let common: Vec<&str> = [MLP, &["--world-size", "2", "--batch-size", "4", "--optimizer", opt]].concat();
        let (full_l, full_p) = run_variant(&d, &common, &["--steps", "6"], &format!("full-{opt}"));
        // the same --losses file for both halves: the resumed run keeps the rows before step 3
        let (res_l, res_p) = (
            d.join(format!("resumed-{opt}.csv")),
            d.join(format!("resumed-{opt}.safetensors")),
        );
        ok(&[
            &["train"],
            common.as_slice(),
            &["--steps", "3", "--checkpoint", s(&ck), "--losses", s(&res_l)],
        ]
        .concat());
        ok(&[
            &["train"],
            common.as_slice(),
            &[
                "--steps",
                "6",
                "--resume",
                s(&ck),
                "--losses",
                s(&res_l),
                "--save",
                s(&res_p),
            ],
        ]
        .concat());
        assert_eq!(losses(&full_l).len(), 6);
        // "exactly as if it had never stopped": the same bytes, not the same to a tolerance
        assert_eq!(
            String::from_utf8(bytes(&res_l)).unwrap(),
            String::from_utf8(bytes(&full_l)).unwrap(),
            "resume {opt}: losses"
        );
        assert!(
            bytes(&res_p) == bytes(&full_p),
            "resume {opt}: the parameters differ in some bit"
        );
    }
}

#[test]
fn resuming_from_a_periodic_checkpoint_of_a_killed_run_is_bit_identical() {
    let d = dir("periodic");
    let ck = d.join("ck.safetensors");
    let common: Vec<&str> = [MLP, &["--world-size", "2", "--batch-size", "4", "--optimizer", "adamw"]].concat();
    // a run far too long to finish, killed as soon as its first periodic checkpoint exists:
    // what it left is a checkpoint of some step k mid-run (atomic writes: never a torn one)
    let mut child = Command::new(common::bin())
        .args(
            [
                &["train"],
                common.as_slice(),
                &[
                    "--steps",
                    "100000000",
                    "--checkpoint",
                    s(&ck),
                    "--checkpoint-every",
                    "2",
                ],
            ]
            .concat(),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while !ck.exists() {
        assert!(child.try_wait().unwrap().is_none(), "the long run ended on its own");
        assert!(std::time::Instant::now() < deadline, "no checkpoint after 300 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let (_, meta) = load_safetensors_with_metadata(&ck).unwrap();
    let k: usize = meta["step"].parse().unwrap();
    assert!(
        k >= 2 && k.is_multiple_of(2),
        "a periodic checkpoint is at a multiple of 2: {k}"
    );
    let end = (k + 3).to_string();
    let (full_l, full_p) = run_variant(&d, &common, &["--steps", &end], "full");
    let (res_l, res_p) = run_variant(&d, &common, &["--steps", &end, "--resume", s(&ck)], "resumed");
    let full = std::fs::read_to_string(&full_l).unwrap();
    let resumed = std::fs::read_to_string(&res_l).unwrap();
    let full_rows: Vec<&str> = full.lines().skip(1 + k).collect();
    let resumed_rows: Vec<&str> = resumed.lines().skip(1).collect();
    assert_eq!(resumed_rows.len(), 3, "{resumed}");
    assert_eq!(resumed_rows, full_rows, "resumed from step {k}");
    assert!(
        bytes(&res_p) == bytes(&full_p),
        "resumed from step {k}: the parameters differ in some bit"
    );
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
    let d = dir("timeline");
    let tl = d.join("tl.json");
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
    // a legend says what each colour means
    for (label, rgb) in [
        ("forward", "#3498DB"),
        ("backward, per layer", "#8E44AD"),
        ("optimizer", "#27AE60"),
        ("all-reduce (comm stream)", "#E67E22"),
    ] {
        assert!(svg_texts(&svg).iter().any(|t| t == label), "legend entry {label}");
        assert!(svg.contains(rgb), "colour {rgb} of {label}");
    }
}

#[test]
fn bad_input_gets_one_clear_line() {
    let d = dir("bad-input");
    let missing = d.join("does-not-exist.safetensors");
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--init", s(&missing)]].concat());
    assert!(e.contains("does-not-exist"), "{e}");
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--data", s(&missing)]].concat());
    assert!(e.contains("does-not-exist"), "{e}");
    // parameters of another architecture: the first mismatch is named
    let other = d.join("other-init.safetensors");
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
        s(&other),
    ]);
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--init", s(&other)]].concat());
    assert!(e.contains("layers.0.weight"), "{e}");
    // the file name says nothing: the message itself must say what is wrong
    let garbage = d.join("g.safetensors");
    std::fs::write(&garbage, b"definitely not safetensors").unwrap();
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--init", s(&garbage)]].concat());
    assert!(e.contains("g.safetensors: not a usable safetensors file"), "{e}");
    fails(&[&["train"], MLP, &["--world-size", "0"]].concat());
    fails(&[&["train"], MLP, &["--bucket-mb", "1,2"]].concat());
    fails(&[&["train"], MLP, &["--lr", "-1"]].concat());
    let e = fails(
        &[
            &["train"],
            MLP,
            &["--steps", "1", "--batch-size", "100", "--world-size", "1"],
            &["--data", s(&mlp_data(&d, None))],
        ]
        .concat(),
    );
    assert!(e.contains("rows"), "{e}");
    if !cfg!(feature = "mpi") {
        let e = fails(&[&["train"], MLP, &["--backend", "mpi"]].concat());
        assert!(e.contains("--features mpi"), "{e}");
    }
    // a checkpoint for another optimizer
    let ck = d.join("ck-sgd-only.safetensors");
    ok(&[
        &["train"],
        MLP,
        &["--steps", "1", "--optimizer", "sgd", "--checkpoint", s(&ck)],
    ]
    .concat());
    let e = fails(
        &[
            &["train"],
            MLP,
            &["--steps", "2", "--optimizer", "adamw", "--resume", s(&ck)],
        ]
        .concat(),
    );
    assert!(e.contains("optimizer"), "{e}");
}

#[test]
fn sweep_writes_the_table_the_chart_and_a_timeline_per_bucket_size() {
    let d = dir("sweep");
    let out = d.join("out");
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

#[test]
fn a_step_checkpoint_path_keeps_each_checkpoint_or_the_newest_keep_last() {
    let d = dir("keep-last");
    let run = |name: &str, keep: &[&str]| {
        let path = d.join(name);
        ok(&[
            &[
                "train",
                "--steps",
                "6",
                "--checkpoint",
                s(&path),
                "--checkpoint-every",
                "2",
            ],
            MLP,
            keep,
        ]
        .concat())
    };
    let listing = || {
        let mut v: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    run("all-{step}.ckpt", &[]);
    assert_eq!(listing(), ["all-2.ckpt", "all-4.ckpt", "all-6.ckpt"]);
    assert_eq!(
        load_safetensors_with_metadata(&d.join("all-4.ckpt")).unwrap().1["step"],
        "4"
    );
    run("last-{step}.ckpt", &["--keep-last", "1"]);
    assert_eq!(listing(), ["all-2.ckpt", "all-4.ckpt", "all-6.ckpt", "last-6.ckpt"]);
    let e = fails(
        &[
            &["train", "--checkpoint", s(&d.join("one.ckpt")), "--keep-last", "2"],
            MLP,
        ]
        .concat(),
    );
    assert!(e.contains("--keep-last 2 needs {step}"), "{e}");
    let e = fails(
        &[
            &["train", "--checkpoint", s(&d.join("r-{step}.ckpt")), "--keep-last", "0"],
            MLP,
        ]
        .concat(),
    );
    assert!(e.contains("--keep-last must be at least 1"), "{e}");
}

#[test]
fn untimed_steps_leave_steps_out_of_the_timing_and_warmup_is_its_hidden_spelling() {
    let run = |flag: &str| {
        let out = brigade(&[&["train"], MLP, &["--steps", "3", "--json", flag, "2"]].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let json: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
        (json, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (new, quiet) = run("--untimed-steps");
    assert_eq!(new["flags"]["warmup"], 2, "{new}");
    assert!(quiet.is_empty(), "{quiet}");
    let (old, note) = run("--warmup");
    assert_eq!(old["flags"]["warmup"], 2, "{old}");
    assert_eq!(note.lines().count(), 1, "{note}");
    assert!(
        note.contains("--untimed-steps") && note.contains("--warmup-steps"),
        "{note}"
    );
    // the help lists the flag by its name, not the hidden spelling
    let help = ok(&["train", "--help"]);
    assert!(
        help.contains("--untimed-steps") && !help.contains("--warmup <"),
        "{help}"
    );
    let e = fails(&[&["train"], MLP, &["--steps", "3", "--untimed-steps", "3"]].concat());
    assert!(e.contains("--untimed-steps 3 leaves no step"), "{e}");
}

#[test]
fn untimed_steps_that_cover_the_steps_a_resume_has_left_are_refused_naming_the_resume() {
    let d = dir("untimed_after_resume");
    let ck = d.join("ck.safetensors");
    ok(&[&["train"], MLP, &["--steps", "2", "--checkpoint", s(&ck)]].concat());
    let resumed = |untimed: &'static str| {
        [
            &["train"],
            MLP,
            &["--steps", "4", "--untimed-steps", untimed, "--resume", s(&ck)],
        ]
        .concat()
    };
    // the resume runs steps 2 and 3: two untimed steps leave none to time
    let e = fails(&resumed("2"));
    assert!(
        e.contains("--untimed-steps 2 leaves no step to time") && e.contains("--resume continues from step 2"),
        "{e}"
    );
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    // one leaves one
    let text = ok(&[resumed("1"), vec!["--json"]].concat());
    let json: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert!(json["median_step_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{json}");
}
