//! `brigade` never loses finished work and never trains on bad input: output paths and
//! numeric flags are checked before step 0, non-finite inputs are refused, writes are
//! atomic and keep symbolic links, resumed runs keep what earlier runs wrote.

use crate::common;

use std::path::Path;

use brigade_models::{load_safetensors_with_metadata, save_safetensors};
use brigade_tensor::Tensor;
use common::{brigade, cat, dir, fails, losses, mlp_data, ok, s, svg_texts, without, GPT, MLP};

/// Names of the files in `d`.
fn files(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    v.sort();
    v
}

#[test]
fn every_output_path_is_checked_before_step_0() {
    let d = dir("preflight");
    let (l, t, c, p) = (
        d.join("l.csv"),
        d.join("t.json"),
        d.join("c.ckpt"),
        d.join("p.safetensors"),
    );
    // a directory no file can be created in: nothing trains, nothing is written, the path is named
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "3",
            "--save",
            "/proc/x.safetensors",
            "--losses",
            s(&l),
            "--timeline",
            s(&t),
            "--checkpoint",
            s(&c),
        ],
    ]));
    assert!(e.contains("--save /proc/x.safetensors"), "{e}");
    assert_eq!(
        files(&d),
        Vec::<String>::new(),
        "no training ran, so nothing was written"
    );
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "3",
            "--losses",
            "/nonexistent-brigade-dir/x.csv",
            "--checkpoint",
            s(&c),
        ],
    ]));
    assert!(e.contains("--losses /nonexistent-brigade-dir/x.csv"), "{e}");
    assert!(!c.exists(), "the check comes before step 0");
    // an output that is a directory
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--losses", s(&d)]]));
    assert!(e.contains("is a directory"), "{e}");
    // a path spelled as a directory that does not exist yet: its write would fail after the run
    for flag in ["--save", "--losses", "--timeline", "--checkpoint", "--profile"] {
        for spelled in [format!("{}/new/", d.display()), format!("{}/new/.", d.display())] {
            let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", flag, &spelled]]));
            assert!(e.contains(&format!("{flag} {spelled}: names a directory")), "{e}");
        }
    }
    // two outputs on one file, however spelled
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "1",
            "--save",
            s(&p),
            "--checkpoint",
            s(&d.join(".").join("p.safetensors")),
        ],
    ]));
    assert!(
        e.contains("--save") && e.contains("--checkpoint") && e.contains("same file"),
        "{e}"
    );
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--timeline", s(&t), "--save", s(&d.join("t.svg"))],
    ]));
    assert!(e.contains("--timeline (its chart)") && e.contains("--save"), "{e}");
    assert_eq!(files(&d), Vec::<String>::new());
    // all fine: every output is written
    ok(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "2",
            "--save",
            s(&p),
            "--losses",
            s(&l),
            "--timeline",
            s(&t),
            "--checkpoint",
            s(&c),
        ],
    ]));
    assert_eq!(files(&d), ["c.ckpt", "l.csv", "p.safetensors", "t.json", "t.svg"]);
}

#[test]
fn a_refused_run_leaves_no_tensorboard_directory_and_names_a_clash_with_it() {
    let d = dir("tb-refused");
    let (t, tb) = (d.join("t.json"), d.join("new").join("tb"));
    // the chart of --timeline on the path of --tensorboard
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "1",
            "--timeline",
            s(&t),
            "--tensorboard",
            s(&d.join("t.svg")),
        ],
    ]));
    assert!(
        e.contains("are the same path") && e.contains("--timeline (its chart)"),
        "{e}"
    );
    // another output refused: the directories --tensorboard made are gone again
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--losses", "/proc/x.csv", "--tensorboard", s(&tb)],
    ]));
    assert!(e.contains("--losses /proc/x.csv"), "{e}");
    assert_eq!(files(&d), Vec::<String>::new());
    // {step} is a checkpoint's; another output would keep it as a literal name
    for flag in ["--losses", "--save", "--timeline"] {
        let p = d.join("at-{step}.out");
        let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", flag, s(&p)]]));
        assert!(e.contains(&format!("{flag} {}: {{step}} names", p.display())), "{e}");
    }
    assert_eq!(files(&d), Vec::<String>::new());
}

#[test]
fn writing_through_a_symbolic_link_writes_its_target() {
    let d = dir("symlink");
    let real = d.join("real.csv");
    let link = d.join("link.csv");
    std::os::unix::fs::symlink("real.csv", &link).unwrap();
    let (preal, plink) = (d.join("real.safetensors"), d.join("link.safetensors"));
    std::os::unix::fs::symlink(&preal, &plink).unwrap();
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--losses", s(&link), "--save", s(&plink)],
    ]));
    for (link, real) in [(&link, &real), (&plink, &preal)] {
        assert!(
            std::fs::symlink_metadata(link).unwrap().file_type().is_symlink(),
            "{} is still a link",
            link.display()
        );
        assert!(real.is_file(), "{} was written", real.display());
    }
    assert_eq!(losses(&real).len(), 2);
    // a link to another output is the same file
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--losses", s(&link), "--checkpoint", s(&real)],
    ]));
    assert!(e.contains("same file"), "{e}");
}

#[test]
fn stale_temporary_files_of_a_killed_run_are_removed_by_the_next_write() {
    let d = dir("stale-tmp");
    let (l, p) = (d.join("l.csv"), d.join("p.safetensors"));
    // pid 1 is alive (its temporary may be in flight); 4294967295 is no process
    for stale in [
        ".l.csv.tmp-4294967295",
        ".l.csv.tmp-4294967295-3",
        ".p.safetensors.tmp-4294967295",
        ".l.csv.tmp-1-0",
        ".other.csv.tmp-4294967295",
    ] {
        std::fs::write(d.join(stale), b"half a file").unwrap();
    }
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--losses", s(&l), "--save", s(&p)],
    ]));
    assert_eq!(
        files(&d),
        [".l.csv.tmp-1-0", ".other.csv.tmp-4294967295", "l.csv", "p.safetensors"]
    );
}

#[test]
fn numeric_flags_are_checked_before_step_0() {
    let d = dir("flags");
    let init = d.join("init.safetensors");
    ok(&cat(&[&["train"], MLP, &["--steps", "0", "--save", s(&init)]]));
    let cases: &[(&[&str], &str)] = &[
        (&["--lr", "nan"], "--lr"),
        (&["--lr", "inf"], "--lr"),
        (&["--weight-decay", "nan"], "--weight-decay"),
        (&["--weight-decay", "-0.1"], "--weight-decay"),
        (&["--optimizer", "sgd", "--momentum", "nan"], "--momentum"),
        (&["--optimizer", "sgd", "--momentum", "1"], "--momentum"),
        (&["--optimizer", "sgd", "--momentum", "-0.5"], "--momentum"),
        (
            &["--optimizer", "adamw", "--momentum", "0.5"],
            "--momentum is for --optimizer sgd",
        ),
        (&["--timeout-s", "inf"], "--timeout-s"),
        (&["--timeout-s", "1e300"], "--timeout-s"),
        (&["--timeout-s", "0"], "--timeout-s"),
        (&["--net-gbps", "1e-300", "--world-size", "2"], "--net-gbps"),
        (&["--net-gbps", "inf"], "--net-gbps"),
        (&["--net-gbps", "1", "--net-latency-us", "1e300"], "--net-latency-us"),
        (&["--net-latency-us", "5"], "needs --net-gbps"),
        (
            &["--net-gbps", "1", "--net-latency-us", "3e6", "--timeout-s", "1"],
            "--net-latency-us 3e6 is 3 s a message, at least --timeout-s 1",
        ),
        (&["--bucket-mb", "inf"], "--bucket-mb"),
        (&["--first-bucket-mb", "nan"], "--first-bucket-mb"),
        (
            &["--checkpoint-every", "0", "--checkpoint", "/tmp/never-written.ckpt"],
            "--checkpoint-every",
        ),
        (&["--checkpoint-every", "2"], "needs --checkpoint"),
        (&["--widths", "5"], "--widths needs at least 2"),
        (&["--widths", "16,0,4"], "--widths"),
        (
            &[
                "--resume",
                "/tmp/never-read.ckpt",
                "--init",
                "/tmp/never-read.safetensors",
            ],
            "drop --init",
        ),
    ];
    // the case's value, not a second one (a list flag would append)
    let mlp = without(&without(MLP, "--lr"), "--widths");
    for (flags, want) in cases {
        let widths: &[&str] = if flags.contains(&"--widths") {
            &[]
        } else {
            &["--widths", "16,32,4"]
        };
        let e = fails(&cat(&[&["train"], &mlp, widths, &["--steps", "1"], flags]));
        assert!(e.contains(want), "{flags:?}: {e}");
    }
    // clap's own errors are one line too
    let e = fails(&["train", "--world-size", "two"]);
    assert!(e.contains("--world-size"), "{e}");
    let gpt_cases: &[(&[&str], &str)] = &[
        (&["--context", "0"], "--context must be at least 1"),
        (&["--heads", "3"], "--heads 3 must divide --d-model 32"),
        (&["--layers", "0"], "--layers"),
    ];
    for (flags, want) in gpt_cases {
        let e = fails(&cat(&[&["train"], &without(GPT, flags[0]), &["--steps", "1"], flags]));
        assert!(e.contains(want), "{flags:?}: {e}");
    }
    // --momentum defaults to 0, as torch.optim.SGD
    let run = |extra: &[&str], tag: &str| {
        let l = d.join(format!("{tag}.csv"));
        ok(&cat(&[
            &["train"],
            MLP,
            &["--steps", "3", "--optimizer", "sgd", "--losses", s(&l)],
            extra,
        ]));
        std::fs::read_to_string(l).unwrap()
    };
    let (default, zero, heavy) = (
        run(&[], "default"),
        run(&["--momentum", "0"], "zero"),
        run(&["--momentum", "0.9"], "heavy"),
    );
    assert_eq!(default, zero);
    assert_ne!(
        default, heavy,
        "momentum 0.9 changes the losses (the comparison can fail)"
    );
}

#[test]
fn nan_in_data_init_or_checkpoint_is_refused_with_the_tensor_and_index() {
    let d = dir("nan");
    let data = mlp_data(&d, Some(3 * 16 + 5));
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--batch-size", "8", "--data", s(&data)],
    ]));
    assert!(
        e.contains("mlp-data-nan.safetensors") && e.contains("'inputs'") && e.contains("[3, 5]") && e.contains("NaN"),
        "{e}"
    );
    // one NaN weight in an --init file
    let init = d.join("init.safetensors");
    ok(&cat(&[&["train"], MLP, &["--steps", "0", "--save", s(&init)]]));
    let mut tensors = brigade_models::load_safetensors(&init).unwrap();
    let (_, bias) = tensors.iter_mut().find(|(n, _)| n == "layers.1.bias").unwrap();
    let mut v = bias.to_vec::<f32>().unwrap();
    v[7] = f32::INFINITY;
    *bias = Tensor::from_vec(v, &[v_len(bias)]).unwrap();
    let bad = d.join("bad-init.safetensors");
    save_safetensors(&bad, &tensors, None).unwrap();
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--init", s(&bad)]]));
    assert!(
        e.contains("bad-init.safetensors") && e.contains("'layers.1.bias'") && e.contains("[7]") && e.contains("inf"),
        "{e}"
    );
    // one NaN in a checkpoint's optimizer state
    let ck = d.join("ck.safetensors");
    ok(&cat(&[&["train"], MLP, &["--steps", "1", "--checkpoint", s(&ck)]]));
    let (mut tensors, meta) = load_safetensors_with_metadata(&ck).unwrap();
    let (name, t) = tensors
        .iter_mut()
        .find(|(n, t)| n.starts_with("optim.") && t.dtype().is_float() && t.numel() > 1)
        .unwrap();
    let name = name.clone();
    let shape = t.shape().to_vec();
    let mut v = t.to_vec::<f32>().unwrap();
    v[1] = f32::NAN;
    *t = Tensor::from_vec(v, &shape).unwrap();
    let bad = d.join("bad-ck.safetensors");
    save_safetensors(&bad, &tensors, Some(meta)).unwrap();
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "2", "--resume", s(&bad)]]));
    assert!(
        e.contains("bad-ck.safetensors") && e.contains(&format!("'{name}'")) && e.contains("NaN"),
        "{e}"
    );
}

fn v_len(t: &Tensor) -> usize {
    t.numel()
}

#[test]
fn a_checkpoint_refuses_another_seed_other_data_and_names_its_path() {
    let d = dir("resume-checks");
    let ck = d.join("ck.safetensors");
    ok(&cat(&[&["train"], MLP, &["--steps", "1", "--checkpoint", s(&ck)]]));
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--seed", "7", "--resume", s(&ck)],
    ]));
    assert!(
        e.contains("--seed 0") && e.contains("--seed 7") && e.contains("ck.safetensors"),
        "{e}"
    );
    let data = mlp_data(&d, None);
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--data", s(&data), "--resume", s(&ck)],
    ]));
    assert!(
        e.contains("written with data 8192 rows") && e.contains("this run has data 64 rows"),
        "{e}"
    );
    // another architecture: the checkpoint's path, not `<memory>`
    let e = fails(&[
        "train",
        "--model",
        "mlp",
        "--widths",
        "16,8,4",
        "--quiet",
        "--steps",
        "2",
        "--resume",
        s(&ck),
    ]);
    assert!(
        e.contains(&format!("checkpoint {}", ck.display())) && !e.contains("<memory>"),
        "{e}"
    );
}

#[test]
fn a_run_of_no_step_says_so_and_still_writes_what_makes_sense() {
    let d = dir("zero-steps");
    let (ck, t, l, p) = (
        d.join("ck.safetensors"),
        d.join("t.json"),
        d.join("l.csv"),
        d.join("p.safetensors"),
    );
    let out = brigade(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "0",
            "--timeline",
            s(&t),
            "--checkpoint",
            s(&ck),
            "--losses",
            s(&l),
            "--save",
            s(&p),
        ],
    ]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("no step run") && !stdout.contains("NaN"), "{stdout}");
    assert!(stderr.contains("no timeline") && !t.exists(), "{stderr}");
    assert!(
        ck.exists() && p.exists(),
        "the checkpoint and the parameters are written"
    );
    assert_eq!(
        std::fs::read_to_string(&l).unwrap(),
        "step,loss,lr,grad_norm,val_loss\n"
    );
    // resumed at the step it already reached: no NaN statistics, the losses kept, a checkpoint
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--checkpoint", s(&ck), "--losses", s(&l)],
    ]));
    let before = std::fs::read_to_string(&l).unwrap();
    let ck2 = d.join("ck2.safetensors");
    let stdout = ok(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "2",
            "--resume",
            s(&ck),
            "--losses",
            s(&l),
            "--checkpoint",
            s(&ck2),
        ],
    ]));
    assert!(
        stdout.contains("no step run: the run starts at step 2") && !stdout.contains("NaN"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(&l).unwrap(),
        before,
        "the rows before the resume step are kept"
    );
    assert_eq!(load_safetensors_with_metadata(&ck2).unwrap().1["step"], "2");
    let json = ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--resume", s(&ck), "--json"],
    ]));
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    assert_eq!(
        (v["steps_run"].as_u64(), v["first_loss"].is_null()),
        (Some(0), true),
        "{v}"
    );
}

#[test]
fn the_summary_speaks_the_flags_language() {
    let stdout = ok(&cat(&[
        &["train"],
        &without(MLP, "--lr"),
        &["--steps", "0", "--optimizer", "sgd", "--lr", "1e30"],
    ]));
    assert!(
        stdout.contains("model mlp") && stdout.contains("sgd lr 1e30"),
        "{stdout}"
    );
    assert!(stdout.contains(" in 1 bucket ("), "{stdout}");
    let stdout = ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--bucket-mb", "0.001", "--first-bucket-mb", "0.001"],
    ]));
    assert!(
        stdout.contains("adamw lr 0.05") && stdout.contains(" buckets ("),
        "{stdout}"
    );
    // bench --help promises the benches that exist, and each runs
    let help = ok(&["bench", "--help"]);
    assert!(help.contains("comm") && help.contains("gemm"), "{help}");
    let help = ok(&["sweep", "--help"]);
    assert!(!help.to_lowercase().contains("resume"), "{help}");
}

#[test]
fn bench_comm_refuses_what_it_cannot_measure() {
    let e = fails(&["bench", "comm", "--iters", "0", "--sizes", "1K"]);
    assert!(e.contains("--iters"), "{e}");
    let e = fails(&["bench", "comm", "--iters", "2", "--sizes", "1K,3"]);
    assert!(e.contains("3 B") && e.contains("2 ranks"), "{e}");
}

#[test]
fn bench_comm_copies_no_more_than_its_largest_size_for_its_memcpy_yardstick() {
    let json = ok(&["bench", "comm", "--sizes", "1K,64K", "--iters", "2", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&json).expect("JSON report");
    assert_eq!(report["memcpy_bytes"], 64 * 1024, "{json}");
}

#[test]
fn a_sweep_replaces_what_an_earlier_sweep_left_and_labels_every_bucket_cap() {
    let out = dir("sweep-out");
    for old in ["timeline_7MiB.json", "timeline_7MiB.svg", "sweep.csv", "notes.txt"] {
        std::fs::write(out.join(old), b"from an earlier sweep").unwrap();
    }
    let model: Vec<&str> = MLP.iter().copied().filter(|a| *a != "--quiet").collect();
    ok(&cat(&[
        &["sweep"],
        &model,
        &[
            "--world-size",
            "2",
            "--steps",
            "2",
            "--bucket-mb",
            "0.25,1,4",
            "--out",
            s(&out),
        ],
    ]));
    assert_eq!(
        files(&out),
        [
            "notes.txt",
            "sweep.csv",
            "sweep.svg",
            "timeline_0.25MiB.json",
            "timeline_0.25MiB.svg",
            "timeline_1MiB.json",
            "timeline_1MiB.svg",
            "timeline_4MiB.json",
            "timeline_4MiB.svg"
        ]
    );
    let texts = svg_texts(&std::fs::read_to_string(out.join("sweep.svg")).unwrap());
    for cap in ["0.25", "1", "4"] {
        assert!(
            texts.iter().any(|t| t == cap),
            "the x axis labels bucket cap {cap}: {texts:?}"
        );
    }
    assert!(
        texts.iter().any(|t| t.starts_with("mlp, world size 2")),
        "lowercase model name in the caption: {texts:?}"
    );
    // one cap twice would write one timeline over the other
    let e = fails(&cat(&[
        &["sweep"],
        &model,
        &["--steps", "2", "--bucket-mb", "1,0.5,1", "--out", s(&out)],
    ]));
    assert!(e.contains("--bucket-mb lists 1 twice"), "{e}");
}

#[test]
fn an_output_on_the_file_a_run_reads_is_refused_before_step_0() {
    let d = dir("input-kept");
    let (c, w) = (d.join("c.ckpt"), d.join("w.safetensors"));
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--checkpoint", s(&c), "--save", s(&w)],
    ]));
    let before = std::fs::read(&c).unwrap();
    // the losses of a resumed run would replace the checkpoint it resumes from
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "3", "--resume", s(&c), "--losses", s(&c)],
    ]));
    assert!(e.contains("--losses") && e.contains("--resume"), "{e}");
    assert_eq!(std::fs::read(&c).unwrap(), before, "the checkpoint is untouched");
    // a timeline over the initial weights
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--init", s(&w), "--timeline", s(&w)],
    ]));
    assert!(e.contains("--timeline") && e.contains("--init"), "{e}");
    // continuing a checkpoint in place, and saving over the initial weights, stay allowed
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "3", "--resume", s(&c), "--checkpoint", s(&c)],
    ]));
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--init", s(&w), "--save", s(&w)],
    ]));
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_failing_sweep_leaves_the_earlier_sweeps_files_as_they_were() {
    let out = dir("sweep-kept");
    let model: Vec<&str> = MLP.iter().copied().filter(|a| *a != "--quiet").collect();
    let base: Vec<&str> = [
        &["sweep"][..],
        &model,
        &["--world-size", "2", "--steps", "2", "--out", s(&out)],
    ]
    .concat();
    let sweep = |extra: &[&str]| -> Vec<String> { base.iter().chain(extra).map(|a| a.to_string()).collect() };
    ok(&refs(&sweep(&["--bucket-mb", "0.25,1"])));
    let before: Vec<(String, Vec<u8>)> = files(&out)
        .into_iter()
        .map(|f| (f.clone(), std::fs::read(out.join(&f)).unwrap()))
        .collect();
    assert_eq!(before.len(), 6, "{before:?}");
    // it fails after its first runs (an input that is not there), with another cap list
    let e = fails(&refs(&sweep(&[
        "--bucket-mb",
        "4",
        "--init",
        "/nonexistent/w.safetensors",
    ])));
    assert!(e.contains("/nonexistent/w.safetensors"), "{e}");
    // and before any run
    let e = fails(&refs(&sweep(&["--bucket-mb", "4", "--repeat", "18446744073709551615"])));
    assert!(e.contains("--repeat must be between 1 and"), "{e}");
    let e = fails(&refs(&sweep(&["--policy", "allreduce,fp16", "--repeat", "0"])));
    assert!(e.contains("--repeat must be at least 1, got 0"), "{e}");
    let init = out.join("timeline_9MiB.json");
    std::fs::write(&init, b"the user's own file").unwrap();
    let e = fails(&refs(&sweep(&["--bucket-mb", "4", "--init", s(&init)])));
    assert!(e.contains("under a name a sweep writes"), "{e}");
    std::fs::remove_file(&init).unwrap();
    for (f, bytes) in &before {
        assert_eq!(&std::fs::read(out.join(f)).unwrap(), bytes, "{f} changed");
    }
    assert_eq!(files(&out).len(), before.len());
}

/// A named pipe at `path`.
fn mkfifo(path: &Path) -> std::path::PathBuf {
    assert!(std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap()
        .success());
    path.to_path_buf()
}

#[test]
fn outputs_never_replace_the_data_or_a_special_file() {
    let d = dir("data-kept");
    let data = mlp_data(&d, None);
    let bytes = std::fs::read(&data).unwrap();
    for flag in ["--save", "--losses", "--checkpoint"] {
        let e = fails(&cat(&[
            &["train"],
            MLP,
            &["--steps", "2", "--data", s(&data), flag, s(&data)],
        ]));
        assert!(e.contains("would write over the --data file"), "{flag}: {e}");
    }
    assert_eq!(std::fs::read(&data).unwrap(), bytes);
    let fifo = mkfifo(&d.join("fifo"));
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "2", "--losses", s(&fifo)]]));
    assert!(e.contains("is not a regular file"), "{e}");
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(),
        "still a pipe"
    );
}

#[test]
fn outputs_never_replace_the_text_the_eval_data_or_any_rank_s_file() {
    let d = dir("inputs-kept");
    let data = mlp_data(&d, None);
    // a file per rank: rank 1's is the one an output names, through another spelling
    let shard = |r: usize| d.join(format!("vic-{r}.safetensors"));
    for r in 0..2 {
        std::fs::copy(&data, shard(r)).unwrap();
    }
    let text = d.join("victim.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog. ".repeat(40)).unwrap();
    let kept = |p: &Path, bytes: &[u8]| assert_eq!(std::fs::read(p).unwrap(), bytes, "{} changed", p.display());
    let (text_bytes, data_bytes) = (std::fs::read(&text).unwrap(), std::fs::read(&data).unwrap());
    for flag in [
        "--losses",
        "--save",
        "--plot",
        "--timeline",
        "--checkpoint",
        "--profile",
    ] {
        // --plot draws SVG: its victim is a text file of that name
        let victim = if flag == "--plot" {
            d.join("victim.svg")
        } else {
            text.clone()
        };
        std::fs::write(&victim, &text_bytes).unwrap();
        let e = fails(&cat(&[
            &["train"],
            GPT,
            &["--steps", "1", "--text", s(&victim), flag, s(&victim)],
        ]));
        assert!(e.contains("would write over the --text file"), "{flag}: {e}");
        kept(&victim, &text_bytes);
    }
    let pattern = d.join("vic-{rank}.safetensors");
    let other_spelling = d.join(".").join("vic-1.safetensors");
    for flag in ["--save", "--losses", "--checkpoint"] {
        let e = fails(&cat(&[
            &["train"],
            MLP,
            &["--steps", "1", "--world-size", "2", "--join", "divide-initial"],
            &["--data", s(&pattern), flag, s(&other_spelling)],
        ]));
        assert!(
            e.contains("would write over the --data file") && e.contains("rank 1"),
            "{flag}: {e}"
        );
        kept(&shard(1), &data_bytes);
    }
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "1",
            "--eval-every",
            "1",
            "--eval-data",
            s(&data),
            "--save",
            s(&data),
        ],
    ]));
    assert!(e.contains("would write over the --eval-data file"), "{e}");
    kept(&data, &data_bytes);
}

#[test]
fn a_data_path_that_is_not_a_regular_file_is_one_error_line_before_it_is_read() {
    let d = dir("inputs-regular");
    let fifo = mkfifo(&d.join("fifo"));
    // a directory, a device (`/dev/zero` would be read without end), a pipe (opening it for
    // reading would wait for a writer; a format is sniffed, then read again)
    for (flag, path, what) in [
        ("--data", &*d, "is a directory"),
        ("--init", Path::new("/dev/zero"), "is not a regular file"),
        ("--resume", &*d, "is a directory"),
        ("--data", fifo.as_path(), "is not a regular file"),
    ] {
        let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", flag, s(path)]]));
        assert!(
            e.contains(&format!("{flag} {} {what}: give the path of a file", path.display())),
            "{flag} {}: {e}",
            path.display()
        );
    }
}
