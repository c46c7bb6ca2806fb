//! Bad input on the command line, found by trying to break it: each case is one clean error
//! line naming the flag (never a panic, an abort, a segfault, a hang, or a silently different
//! run), and the summary names every flag that shapes what trained.

use crate::common;

use common::{cat, dir, fails, ok, s, MLP};

/// The small MLP of every test, as `brigade sweep` takes it (no --quiet).
const SWEEP_MLP: &[&str] = &["--model", "mlp", "--widths", "16,32,32,4", "--lr", "0.05"];

#[test]
fn a_list_flag_given_twice_is_an_error_not_a_longer_list() {
    let e = fails(&cat(&[&["train"], MLP, &["--widths", "8,4", "--steps", "1"]]));
    assert!(e.contains("--widths") && e.contains("multiple times"), "{e}");
    let e = fails(&["predict", "--profile", "p.json", "--bucket-mb", "1", "--bucket-mb", "2"]);
    assert!(e.contains("--bucket-mb"), "{e}");
}

#[test]
fn the_json_summary_names_the_model_shape_and_the_powersgd_rank() {
    let out = ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--world-size", "2", "--json"],
        &[
            "--comm-hook",
            "powersgd",
            "--powersgd-rank",
            "2",
            "--powersgd-start-iter",
            "2",
        ],
    ]));
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let flags = &v["flags"];
    assert_eq!(flags["widths"], serde_json::json!([16, 32, 32, 4]), "{flags}");
    assert_eq!(flags["powersgd_rank"], 2, "{flags}");
    assert_eq!(flags["powersgd_start_iter"], 2, "{flags}");
}

#[test]
fn thread_counts_beyond_reason_are_refused() {
    let huge = "18446744073709551615";
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--threads-per-rank", huge]]));
    assert!(e.contains("--threads-per-rank") && e.contains(huge), "{e}");
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--world-size", "100000"]]));
    assert!(e.contains("--world-size 100000") && e.contains("mpirun"), "{e}");
    let e = fails(&["bench", "gemm", "--threads", huge, "--shapes", "8x8x8"]);
    assert!(e.contains("--threads"), "{e}");
    let e = fails(&["bench", "ops", "--threads", "100000", "--steps", "1"]);
    assert!(e.contains("--threads"), "{e}");
    let e = fails(&["bench", "comm", "--world-size", "100000", "--sizes", "4M"]);
    assert!(e.contains("--world-size 100000"), "{e}");
}

#[test]
fn sizes_that_overflow_or_exceed_memory_are_one_line_naming_the_flag() {
    let mlp = ["train", "--model", "mlp", "--quiet", "--steps", "1"];
    // m * k overflows usize: this was a segfault inside the GEMM call
    let e = fails(&["bench", "gemm", "--shapes", "4294967296x4294967296x1", "--reps", "1"]);
    assert!(e.contains("--shapes 4294967296x4294967296x1"), "{e}");
    let e = fails(&["bench", "gemm", "--shapes", "8x8x8", "--reps", "18446744073709551615"]);
    assert!(e.contains("--reps"), "{e}");
    let e = fails(&["bench", "gemm", "--shapes", "1000000x1000000x1000000", "--reps", "1"]);
    assert!(e.contains("--shapes") && e.contains("this machine has"), "{e}");
    // these were "capacity overflow" panics
    let e = fails(&["bench", "comm", "--sizes", "18446744073709551615"]);
    assert!(e.contains("--sizes"), "{e}");
    let e = fails(&["bench", "comm", "--sizes", "18446744073709551615K"]);
    assert!(e.contains("--sizes") && e.contains("more bytes"), "{e}");
    let e = fails(&cat(&[&mlp, &["--widths", "16,18446744073709551615,4"]]));
    assert!(
        e.contains("--widths 16,18446744073709551615,4") && e.contains("2^64"),
        "{e}"
    );
    let e = fails(&["bench", "ops", "--batch-size", "18446744073709551615", "--steps", "1"]);
    assert!(e.contains("--batch-size 18446744073709551615"), "{e}");
    // this was an allocator abort (rc 134): a model of 10^12 parameters does not fit
    let e = fails(&cat(&[&mlp, &["--widths", "16,1000000,1000000,4"]]));
    assert!(
        e.contains("--widths 16,1000000,1000000,4") && e.contains("this machine has"),
        "{e}"
    );
    let e = fails(&[
        "train",
        "--model",
        "gpt",
        "--d-model",
        "65536",
        "--layers",
        "64",
        "--heads",
        "1",
        "--steps",
        "1",
    ]);
    assert!(e.contains("--d-model 65536") && e.contains("this machine has"), "{e}");
    // a small GPT at a long context: one layer's attention probabilities, 2 rows x 2 heads x
    // 100,000^2 f32 values, are 160 GB
    let e = fails(&[
        "train",
        "--model",
        "gpt",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--d-ff",
        "64",
        "--context",
        "100000",
        "--batch-size",
        "2",
        "--steps",
        "1",
    ]);
    assert!(e.contains("--context 100000") && e.contains("this machine has"), "{e}");
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--batch-size", "18446744073709551615"],
    ]));
    assert!(e.contains("--batch-size"), "{e}");
}

#[test]
fn predict_reads_a_bounded_profile_and_refuses_a_device() {
    // a device is refused before a byte of it is read
    for device in ["/dev/zero", "/dev/urandom"] {
        let e = fails(&["predict", "--profile", device, "--net-gbps", "10"]);
        assert!(e.contains(&format!("--profile {device} is not a regular file")), "{e}");
    }
    // a file larger than any profile is refused from its size, before it is read
    let d = dir("predict-huge-profile");
    let huge = d.join("huge.json");
    let size = (256u64 << 20) + 1;
    std::fs::File::create(&huge).unwrap().set_len(size).unwrap();
    let e = fails(&["predict", "--profile", s(&huge), "--net-gbps", "10"]);
    assert!(
        e.contains("not a step profile") && e.contains(&format!("it is {size} bytes")),
        "{e}"
    );
}

#[test]
fn a_text_that_is_a_device_or_too_large_is_refused_before_it_is_read() {
    let e = fails(&cat(&[
        &["train"],
        common::GPT,
        &["--steps", "1", "--text", "/dev/zero"],
    ]));
    assert!(e.contains("/dev/zero") && e.contains("not a regular file"), "{e}");
    let d = dir("text-huge");
    let huge = d.join("huge.txt");
    let size = (1u64 << 30) + 1;
    std::fs::File::create(&huge).unwrap().set_len(size).unwrap();
    let e = fails(&cat(&[&["train"], common::GPT, &["--steps", "1", "--text", s(&huge)]]));
    assert!(e.contains(&format!("is {size} bytes")) && e.contains("1 GiB"), "{e}");
}

#[test]
fn a_sweep_out_that_is_a_file_says_so() {
    let d = dir("sweep-out-file");
    let file = d.join("results");
    std::fs::write(&file, "not a directory").unwrap();
    let sweep_mlp = SWEEP_MLP.to_vec();
    for policy in [&[][..], &["--policy", "allreduce,fp16"]] {
        let e = fails(&cat(&[
            &["sweep"],
            &sweep_mlp,
            &["--steps", "2", "--world-size", "2", "--out", s(&file)],
            policy,
        ]));
        assert!(e.contains("--out") && e.contains("is a file"), "{e}");
        let e = fails(&cat(&[
            &["sweep"],
            &sweep_mlp,
            &["--steps", "2", "--world-size", "2", "--out", s(&file.join("under"))],
            policy,
        ]));
        assert!(e.contains("is a file"), "{e}");
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a directory");
}

#[test]
fn an_unknown_bench_ops_precision_is_refused_in_one_line() {
    let e = fails(&["bench", "ops", "--precision", "f8", "--steps", "1", "--warmup", "0"]);
    assert!(e.contains("--precision") && e.contains("bf16"), "{e}");
}

#[test]
fn an_attention_ab_on_a_model_without_attention_is_refused() {
    let e = fails(&[
        "bench", "ops", "--model", "mlp", "--ab", "--steps", "1", "--warmup", "0",
    ]);
    assert!(e.contains("--ab") && e.contains("--model gpt"), "{e}");
}

#[test]
fn a_negative_count_names_its_flag() {
    for (flag, value) in [
        ("--powersgd-rank", "-1"),
        ("--steps", "-1"),
        ("--batch-size", "-3"),
        ("--world-size", "-2"),
    ] {
        let e = fails(&cat(&[&["train"], MLP, &[flag, value]]));
        assert!(e.contains(flag) && e.contains(value), "{flag} {value}: {e}");
    }
    let e = fails(&["bench", "comm", "--iters", "-1"]);
    assert!(e.contains("--iters"), "{e}");
}

#[test]
fn train_sweep_and_predict_cap_the_first_bucket_alike() {
    let d = dir("first-bucket");
    let profile = d.join("p.json");
    // every gradient of the small MLP is larger than 1000 bytes but two: a cap of 0.001 MiB
    // (1048 bytes) makes one bucket per layer, first bucket included
    let cap = ["--bucket-mb", "0.001"];
    let train = ok(&cat(&[
        &["train"],
        MLP,
        &cap,
        &["--steps", "2", "--world-size", "2", "--json", "--profile", s(&profile)],
    ]));
    let trained: serde_json::Value = serde_json::from_str(train.trim()).unwrap();
    let trained = trained["buckets"].as_u64().unwrap();
    let predict = ok(&cat(&[
        &["predict", "--profile", s(&profile), "--net-gbps", "10", "--json"],
        &cap,
    ]));
    let predicted: serde_json::Value = serde_json::from_str(&predict).unwrap();
    let predicted = predicted[0]["buckets"].as_array().unwrap().len() as u64;
    assert_eq!(trained, predicted, "train made {trained} buckets, predict {predicted}");
    assert!(trained > 1, "a 0.001 MiB cap splits the gradients: {trained}");
    // the sweep's row for the same cap
    let out = d.join("sweep");
    let sweep = ok(&cat(&[
        &["sweep"],
        SWEEP_MLP,
        &cap,
        &["--steps", "2", "--world-size", "2", "--json", "--out", s(&out)],
    ]));
    let rows: serde_json::Value = serde_json::from_str(&sweep).unwrap();
    assert_eq!(rows[0]["buckets"].as_u64(), Some(trained), "{rows}");
}

#[test]
fn flags_that_would_do_nothing_are_refused_in_one_line() {
    let d = dir("nonsense");
    // --join over files that all hold less than one step: no step would run (rows 4 and 6,
    // a step reads 8), under every mode
    for (r, rows) in [(0, 4), (1, 6)] {
        let data = common::mlp_data(&d, None);
        let all = brigade_models::load_safetensors(&data).unwrap();
        let cut: Vec<(String, brigade_tensor::Tensor)> = all
            .into_iter()
            .map(|(n, t)| {
                let v = t.to_f64_vec().unwrap();
                let width = v.len() / 64;
                let shape: Vec<usize> = std::iter::once(rows).chain(t.shape()[1..].iter().copied()).collect();
                let t = match n.as_str() {
                    "targets" => brigade_tensor::Tensor::from_vec(
                        v[..rows].iter().map(|&x| x as i64).collect::<Vec<_>>(),
                        &shape,
                    ),
                    _ => brigade_tensor::Tensor::from_vec(
                        v[..rows * width].iter().map(|&x| x as f32).collect::<Vec<_>>(),
                        &shape,
                    ),
                };
                (n, t.unwrap())
            })
            .collect();
        brigade_models::save_safetensors(d.join(format!("short-{r}.safetensors")), &cut, None).unwrap();
    }
    let save = d.join("w.safetensors");
    for mode in ["divide-initial", "divide-active", "throw"] {
        let e = fails(&cat(&[
            &["train"],
            MLP,
            &["--steps", "3", "--world-size", "2", "--batch-size", "8", "--join", mode],
            &["--data", s(&d.join("short-{rank}.safetensors")), "--save", s(&save)],
        ]));
        assert!(
            e.contains("shorter than one step of 8 rows") && e.contains("4, 6"),
            "{mode}: {e}"
        );
        assert!(!save.exists(), "{mode}: an untrained --save");
    }
    // --join over one dataset cut evenly: no rank's data ends early
    let text = d.join("t.txt");
    std::fs::write(&text, "some text to train on. ".repeat(40)).unwrap();
    let data = common::mlp_data(&d, None);
    for (model, input) in [
        (MLP, vec![]),
        (MLP, vec!["--data", s(&data)]),
        (common::GPT, vec!["--text", s(&text)]),
    ] {
        let e = fails(&cat(&[
            &["train"],
            model,
            &["--steps", "1", "--world-size", "2", "--join", "divide-initial"],
            &input,
        ]));
        assert!(
            e.contains("--join divide-initial is for a file per rank"),
            "{input:?}: {e}"
        );
    }
    // schedule flags the schedule in use does not read
    for (flags, named) in [
        (&["--min-lr", "0.001"][..], "--min-lr"),
        (&["--lr-decay-steps", "5"][..], "--lr-decay-steps"),
        (&["--lr-schedule", "cosine", "--lr-gamma", "0.5"][..], "--lr-gamma"),
        (
            &["--lr-schedule", "linear", "--lr-step-size", "2"][..],
            "--lr-step-size",
        ),
        (&["--lr-schedule", "step", "--min-lr", "0.001"][..], "--min-lr"),
    ] {
        let e = fails(&cat(&[&["train"], MLP, &["--steps", "2"], flags]));
        assert!(e.contains(named) && e.contains("the schedule in use"), "{flags:?}: {e}");
    }
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--lr-schedule", "cosine", "--min-lr", "0.001"],
    ]));
    // a profile whose policy sends nothing per element
    let profile = d.join("p.json");
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "2", "--world-size", "2", "--profile", s(&profile)],
    ]));
    let text = std::fs::read_to_string(&profile).unwrap();
    assert!(text.contains("\"bytes_per_element\": 4.0"), "{text}");
    std::fs::write(
        &profile,
        text.replace("\"bytes_per_element\": 4.0", "\"bytes_per_element\": 0.0"),
    )
    .unwrap();
    let e = fails(&["predict", "--profile", s(&profile), "--net-gbps", "10"]);
    assert!(e.contains("bytes per gradient element"), "{e}");
}

#[test]
fn sizes_without_a_bound_are_refused_in_one_line() {
    let d = dir("unbounded");
    let ckpt = d.join("gpt.ckpt");
    ok(&cat(&[
        &["train"],
        common::GPT,
        &["--steps", "1", "--checkpoint", s(&ckpt)],
    ]));
    let sample = ["sample", "--checkpoint", s(&ckpt), "--prompt", "ab", "--max-new-tokens"];
    for n in ["1000000000000", "18446744073709551615"] {
        let e = fails(&cat(&[&sample, &[n]]));
        assert!(e.contains("--max-new-tokens must be at most 16777216"), "{n}: {e}");
    }
    // a checkpoint whose configuration claims a context its tensors do not hold
    let (tensors, mut meta) = brigade_models::load_safetensors_with_metadata(&ckpt).unwrap();
    let config = meta["model_config"].clone();
    let huge = config.replace("\"context\":16", "\"context\":1000000000000");
    assert_ne!(huge, config, "{config}");
    meta.insert("model_config".into(), huge);
    let lying = d.join("lying.ckpt");
    brigade_models::save_safetensors(&lying, &tensors, Some(meta)).unwrap();
    let e = fails(&[
        "sample",
        "--checkpoint",
        s(&lying),
        "--prompt",
        "ab",
        "--max-new-tokens",
        "4",
    ]);
    assert!(e.contains("does not describe them"), "{e}");
    let e = fails(&["bench", "comm", "--sizes", "1K", "--iters", "18446744073709551615"]);
    assert!(e.contains("--iters must be between 1 and"), "{e}");
}

#[test]
fn a_huge_number_in_a_message_is_written_short() {
    for (flag, value) in [
        ("--timeout-s", "1e300"),
        ("--net-gbps", "1e300"),
        ("--net-latency-us", "1e300"),
        ("--dropout", "1e300"),
        ("--first-bucket-mb", "1e300"),
        ("--weight-decay", "-1e300"),
        ("--clip-grad-norm", "-1e300"),
    ] {
        let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", flag, value]]));
        assert!(
            e.contains(flag) && e.contains("e300") && e.len() < 300,
            "{flag} {value}: {e}"
        );
    }
    let e = fails(&[
        "sample",
        "--checkpoint",
        "none.ckpt",
        "--prompt",
        "a",
        "--temperature",
        "-1e300",
    ]);
    assert!(e.contains("e300") && e.len() < 300, "{e}");
}

#[test]
fn a_mistyped_flag_value_or_command_names_what_was_meant_in_its_one_line() {
    let e = fails(&["train", "--plan", "foo"]);
    assert!(e.contains("'foo'") && e.contains("(one of: auto)"), "{e}");
    let e = fails(&["train", "--model", "gpx"]);
    assert!(
        e.contains("one of: mlp, gpt") && e.contains("did you mean 'gpt'"),
        "{e}"
    );
    let e = fails(&["train", "--lrr", "3"]);
    assert!(e.contains("did you mean '--lr'"), "{e}");
    let e = fails(&["trian"]);
    assert!(e.contains("did you mean 'train'"), "{e}");
}

#[test]
fn a_flag_left_without_its_value_lists_no_empty_choice() {
    for flag in ["--seed", "--steps", "--lr"] {
        let e = fails(&["train", "--model", "mlp", flag]);
        assert!(e.contains("a value is required") && e.contains(flag), "{flag}: {e}");
        assert!(!e.contains("one of: )"), "{flag}: {e}");
    }
    // a flag whose values are listed still lists them
    let e = fails(&["train", "--model"]);
    assert!(e.contains("(one of: mlp, gpt)"), "{e}");
}

#[test]
fn a_powersgd_settings_flag_that_contradicts_the_policy_entry_is_refused() {
    fn run<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        cat(&[&["train"], MLP, &["--steps", "1", "--world-size", "2"], extra])
    }
    let e = fails(&run(&["--policy", "powersgd:2", "--powersgd-rank", "3"]));
    assert!(
        e.contains("--powersgd-rank 3") && e.contains("powersgd:2") && e.contains("rank is 2"),
        "{e}"
    );
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    let e = fails(&run(&["--policy", "powersgd:2@5", "--powersgd-start-iter", "3"]));
    assert!(
        e.contains("--powersgd-start-iter 3") && e.contains("start iter is 5"),
        "{e}"
    );
    // study's list is read by the same rule
    let e = fails(&cat(&[
        &["study"],
        SWEEP_MLP,
        &[
            "--steps",
            "4",
            "--world-size",
            "2",
            "--target-loss",
            "0.5",
            "--net-gbps",
            "1",
        ],
        &["--policy", "allreduce,powersgd:2@5", "--powersgd-start-iter", "0"],
        &["--out", s(&dir("psgd_flag_study").join("out"))],
    ]));
    assert!(
        e.contains("--powersgd-start-iter 0") && e.contains("start iter is 5"),
        "{e}"
    );
    // a flag that fills in what the entry leaves out, or agrees with it, is taken
    let out = ok(&run(&[
        "--policy",
        "powersgd:2",
        "--powersgd-start-iter",
        "0",
        "--json",
    ]));
    assert!(out.contains("\"powersgd:2@0\""), "{out}");
    ok(&run(&["--policy", "powersgd:2", "--powersgd-rank", "2"]));
}

#[test]
fn a_missing_required_flag_is_named_on_the_one_error_line() {
    let e = fails(&cat(&[
        &["study"],
        SWEEP_MLP,
        &["--steps", "4", "--target-loss", "0.5", "--net-gbps", "1"],
    ]));
    assert!(e.contains("required") && e.contains("--out"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
}
