//! A `{step}` checkpoint path against the run's other files: refused before step 0 where any
//! step's checkpoint would land on an input or another output, and `--keep-last` removing only
//! the checkpoints of the run's own lineage, newest (last written) kept.

use std::path::{Path, PathBuf};

use brigade_models::{load_safetensors_with_metadata, save_safetensors};

use super::common::{cat, dir, fails, mlp_data, ok, s, GPT, MLP};

/// The file names in `d`, sorted.
fn listing(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Every file of `d` with its bytes (links read through, folders left out).
fn snapshot(d: &Path) -> Vec<(String, Vec<u8>)> {
    listing(d)
        .into_iter()
        .filter(|f| !d.join(f).is_dir())
        .map(|f| (f.clone(), std::fs::read(d.join(&f)).unwrap()))
        .collect()
}

/// The step a checkpoint records.
fn step_of(path: &Path) -> String {
    load_safetensors_with_metadata(path).unwrap().1["step"].clone()
}

/// A text for the small GPT.
fn text(path: &Path) -> PathBuf {
    std::fs::write(path, "the quick brown fox jumps over the lazy dog. ".repeat(40)).unwrap();
    path.to_path_buf()
}

#[test]
fn a_step_checkpoint_path_never_lands_on_an_input_or_another_output() {
    let d = dir("step-path-files");
    let data = mlp_data(&d, None);
    for r in 0..2 {
        std::fs::copy(&data, d.join(format!("s-{r}.safetensors"))).unwrap();
    }
    std::fs::create_dir(d.join("gl")).unwrap();
    let shard = d.join("gl").join("a_1.bin");
    let t = text(&d.join("t.txt"));
    ok(&["tokenize", "--tokenizer", "bytes", "--text", s(&t), "--out", s(&shard)]);
    text(&d.join("c-2.txt"));
    text(&d.join("c-30.txt"));
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--save", s(&d.join("w-2.safetensors"))],
    ]));
    let before = snapshot(&d);
    let gl_before = snapshot(&d.join("gl"));
    let at = |name: &str| d.join(name).to_string_lossy().into_owned();
    let every = ["--checkpoint-every", "1", "--steps", "2"];
    let cases: Vec<(Vec<String>, &str)> = vec![
        // rank 1's file is the step-1 checkpoint's name
        (
            [
                &MLP[..],
                &every,
                &["--world-size", "2", "--data", &at("s-{rank}.safetensors")],
            ]
            .concat()
            .iter()
            .map(|a| a.to_string())
            .chain(["--checkpoint".into(), at("s-{step}.safetensors")])
            .collect(),
            "would write over the --data file",
        ),
        // a member of a glob
        (
            [&GPT[..], &every, &["--tokenizer", "bytes", "--data", &at("gl/a_*.bin")]]
                .concat()
                .iter()
                .map(|a| a.to_string())
                .chain(["--checkpoint".into(), at("gl/a_{step}.bin")])
                .collect(),
            "would write over the --data file",
        ),
        // the text
        (
            [&GPT[..], &every, &["--text", &at("c-2.txt")]]
                .concat()
                .iter()
                .map(|a| a.to_string())
                .chain(["--checkpoint".into(), at("c-{step}.txt")])
                .collect(),
            "would write over the --text file",
        ),
        // the initial parameters
        (
            [&MLP[..], &every, &["--init", &at("w-2.safetensors")]]
                .concat()
                .iter()
                .map(|a| a.to_string())
                .chain(["--checkpoint".into(), at("w-{step}.safetensors")])
                .collect(),
            "would write over the --init file",
        ),
        // other outputs
        (
            [&MLP[..], &every, &["--losses", &at("o-2.x"), "--save", &at("o-1.x")]]
                .concat()
                .iter()
                .map(|a| a.to_string())
                .chain(["--checkpoint".into(), at("o-{step}.x")])
                .collect(),
            "would write its checkpoint of step",
        ),
    ];
    for (args, says) in &cases {
        let args: Vec<&str> = std::iter::once("train")
            .chain(args.iter().map(String::as_str))
            .collect();
        let e = fails(&args);
        assert!(e.contains(says) && e.contains("--checkpoint"), "{args:?}: {e}");
        assert_eq!(snapshot(&d), before, "{args:?} changed a file");
        assert_eq!(snapshot(&d.join("gl")), gl_before, "{args:?} changed a file");
    }
    // any step: a signal or the end of a join run writes at another step than the period's
    let e = fails(&cat(&[
        &["train"],
        GPT,
        &[
            "--steps",
            "2",
            "--text",
            &at("c-30.txt"),
            "--checkpoint",
            &at("c-{step}.txt"),
        ],
    ]));
    assert!(e.contains("with its checkpoint of step 30"), "{e}");
    // a glob that would read the checkpoints as data later, though none exists yet
    let e = fails(&cat(&[
        &["train"],
        GPT,
        &["--steps", "1", "--tokenizer", "bytes", "--data", &at("gl/a_*.bin")],
        &["--checkpoint", &at("gl/a_x{step}.bin")],
    ]));
    assert!(e.contains("names files that the --data pattern"), "{e}");
    // and so is any other output the pattern would read
    let e = fails(&cat(&[
        &["train"],
        GPT,
        &["--steps", "1", "--tokenizer", "bytes", "--data", &at("gl/a_*.bin")],
        &["--save", &at("gl/a_w.bin")],
    ]));
    assert!(
        e.contains("--save") && e.contains("is a file the --data pattern"),
        "{e}"
    );
    // a link at a checkpoint's name is written through: to the text it points at
    std::os::unix::fs::symlink(d.join("c-30.txt"), d.join("gl").join("l-1.ckpt")).unwrap();
    let e = fails(&cat(&[
        &["train"],
        GPT,
        &[
            "--steps",
            "1",
            "--text",
            &at("c-30.txt"),
            "--checkpoint",
            &at("gl/l-{step}.ckpt"),
        ],
    ]));
    assert!(e.contains("through the link"), "{e}");
    assert_eq!(snapshot(&d), before);
    // continuing the resumed checkpoint in place stays allowed, and other names are free
    let ck = |n: &str| d.join("ck").join(n);
    std::fs::create_dir(d.join("ck")).unwrap();
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--checkpoint", &ck("c-{step}.st").to_string_lossy()],
    ]));
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "3", "--resume", &ck("c-2.st").to_string_lossy()],
        &[
            "--checkpoint",
            &ck("c-{step}.st").to_string_lossy(),
            "--losses",
            &ck("c-x.csv").to_string_lossy(),
        ],
    ]));
    assert_eq!(listing(&d.join("ck")), ["c-2.st", "c-3.st", "c-x.csv"]);
}

#[test]
fn keep_last_removes_only_this_runs_own_checkpoints() {
    let d = dir("keep-last-own");
    let at = |name: &str| d.join(name).to_string_lossy().into_owned();
    // inputs under the checkpoints' names are refused, so never removed
    let t = text(&d.join("c-0.txt"));
    let bytes = std::fs::read(&t).unwrap();
    let e = fails(&cat(&[
        &["train"],
        GPT,
        &[
            "--steps",
            "2",
            "--text",
            s(&t),
            "--checkpoint",
            &at("c-{step}.txt"),
            "--keep-last",
            "1",
        ],
    ]));
    assert!(e.contains("would write over the --text file"), "{e}");
    let data = mlp_data(&d, None);
    let eval = d.join("ev-0.safetensors");
    std::fs::copy(&data, &eval).unwrap();
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--eval-every", "1", "--eval-data", s(&eval)],
        &["--checkpoint", &at("ev-{step}.safetensors"), "--keep-last", "1"],
    ]));
    assert!(e.contains("would write over the --eval-data file"), "{e}");
    assert_eq!(std::fs::read(&t).unwrap(), bytes);
    assert!(eval.exists());
    // files the path names that are not this run's checkpoints stay: a user's file, another
    // run's checkpoint (another lineage), a checkpoint that records no lineage
    std::fs::write(d.join("run-7.ckpt"), b"the user's notes").unwrap();
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "9", "--checkpoint", &at("run-{step}.ckpt")],
    ]));
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "5", "--checkpoint", &at("run-{step}.ckpt")],
    ]));
    let (tensors, mut meta) = load_safetensors_with_metadata(d.join("run-5.ckpt")).unwrap();
    assert!(meta.remove("lineage").is_some(), "a checkpoint records its lineage");
    save_safetensors(d.join("run-5.ckpt"), &tensors, Some(meta)).unwrap();
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "6", "--checkpoint", &at("run-{step}.ckpt")],
        &["--checkpoint-every", "2", "--keep-last", "1"],
    ]));
    assert_eq!(
        listing(&d),
        [
            "c-0.txt",
            "ev-0.safetensors",
            "mlp-data.safetensors",
            "run-5.ckpt",
            "run-6.ckpt",
            "run-7.ckpt",
            "run-9.ckpt"
        ]
    );
    assert_eq!(std::fs::read(d.join("run-7.ckpt")).unwrap(), b"the user's notes");
    assert_eq!(step_of(&d.join("run-9.ckpt")), "9");
}

#[test]
fn keep_last_keeps_what_this_run_wrote_after_an_older_run_or_a_rollback() {
    let d = dir("keep-last-newest");
    let template = d.join("run-{step}.ckpt");
    let run = |extra: &[&str]| {
        ok(&cat(&[
            &["train"],
            MLP,
            &["--checkpoint", s(&template), "--checkpoint-every", "2"],
            extra,
        ]))
    };
    // an older run left a higher step: a new run keeps its own newest, the older run's stays
    run(&["--steps", "8"]);
    run(&["--steps", "4", "--keep-last", "1"]);
    assert_eq!(listing(&d), ["run-4.ckpt", "run-6.ckpt", "run-8.ckpt"]);
    assert_eq!(step_of(&d.join("run-4.ckpt")), "4");
    // a rollback: resumed from step 2 of a run that reached 8, the steps after it are older
    // than what the resumed run writes
    let d2 = dir("keep-last-rollback");
    let template = d2.join("run-{step}.ckpt");
    let run = |extra: &[&str]| {
        ok(&cat(&[
            &["train"],
            MLP,
            &["--checkpoint", s(&template), "--checkpoint-every", "2"],
            extra,
        ]))
    };
    run(&["--steps", "8"]);
    run(&[
        "--steps",
        "4",
        "--resume",
        s(&d2.join("run-2.ckpt")),
        "--keep-last",
        "1",
    ]);
    assert_eq!(listing(&d2), ["run-4.ckpt"]);
    // on from step 4 to 10, then rolled back to step 4 once more: the second rollback's
    // checkpoint is the newest of the lineage, newer than the first one's steps 8 and 10
    let four = d2.join("run-4.ckpt");
    run(&["--steps", "10", "--resume", s(&four)]);
    assert_eq!(listing(&d2), ["run-10.ckpt", "run-4.ckpt", "run-6.ckpt", "run-8.ckpt"]);
    run(&["--steps", "6", "--resume", s(&four), "--keep-last", "1"]);
    assert_eq!(listing(&d2), ["run-6.ckpt"]);
}

#[test]
fn a_checkpoint_path_with_step_twice_or_in_its_folder_is_one_error_line() {
    let d = dir("step-twice");
    std::fs::create_dir(d.join("{step}")).unwrap();
    for path in [d.join("c-{step}-{step}.ckpt"), d.join("{step}").join("c.ckpt")] {
        let e = fails(&cat(&[
            &["train"],
            MLP,
            &["--steps", "4", "--checkpoint-every", "2", "--keep-last", "1"],
            &["--checkpoint", s(&path)],
        ]));
        assert!(e.contains("{step} may appear once, in the file name"), "{e}");
    }
    assert_eq!(listing(&d), ["{step}"], "nothing written");
    assert!(listing(&d.join("{step}")).is_empty());
}

#[test]
fn a_folder_or_a_pipe_at_a_checkpoints_name_is_one_error_line_before_step_0() {
    let d = dir("step-not-a-file");
    let template = d.join("run-{step}.ckpt");
    let train = || {
        fails(&cat(&[
            &["train"],
            MLP,
            &["--steps", "8", "--checkpoint-every", "2", "--keep-last", "1"],
            &["--checkpoint", s(&template)],
        ]))
    };
    std::fs::create_dir(d.join("run-6.ckpt")).unwrap();
    let e = train();
    assert!(
        e.contains("run-6.ckpt (its checkpoint of step 6), which is a folder"),
        "{e}"
    );
    std::fs::remove_dir(d.join("run-6.ckpt")).unwrap();
    // a pipe is not opened (reading it would wait for a writer) and not replaced
    assert!(std::process::Command::new("mkfifo")
        .arg(d.join("run-4.ckpt"))
        .status()
        .unwrap()
        .success());
    let e = train();
    assert!(e.contains("which is not a regular file"), "{e}");
    assert_eq!(listing(&d), ["run-4.ckpt"]);
}

#[test]
fn a_brace_token_other_than_step_in_a_path_is_refused_naming_the_flag_and_the_token() {
    let d = dir("stray-token");
    let at = |name: &str| d.join(name).to_string_lossy().into_owned();
    for (flag, name, token) in [
        ("--checkpoint", "run-{STEP}.ckpt", "{STEP}"),
        ("--checkpoint", "run-{rank}.ckpt", "{rank}"),
        ("--save", "w-{STEP}.safetensors", "{STEP}"),
        ("--losses", "l-{rank}.csv", "{rank}"),
    ] {
        let path = at(name);
        let e = fails(&cat(&[&["train"], MLP, &["--steps", "2", flag, &path]]));
        assert!(
            e.contains(&format!("{flag} {path}: {token} is not a placeholder")) && e.contains("{step}"),
            "{flag} {name}: {e}"
        );
    }
    assert!(listing(&d).is_empty(), "nothing written: {:?}", listing(&d));
}
