//! Text in and text out: `brigade train --model gpt --text FILE` (byte-level, the file's training
//! split), `--shuffle`, and `brigade sample` from the checkpoint (greedy output equal to the
//! library's `generate_text`; a bad or non-GPT checkpoint is one error line).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use brigade_models::{
    generate_text, load_params_from_tensors, load_safetensors_with_metadata, Gpt, GptConfig, Model, SampleOptions,
};

use crate::common::*;

/// The small GPT of these tests: the flags and the configuration they describe.
const TINY_GPT: &[&str] = &[
    "--model",
    "gpt",
    "--d-model",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--d-ff",
    "32",
    "--context",
    "16",
    "--batch-size",
    "4",
    "--quiet",
];

fn tiny_config() -> GptConfig {
    GptConfig {
        d_model: 16,
        n_layers: 1,
        n_heads: 2,
        d_ff: 32,
        context: 16,
        ..GptConfig::default()
    }
}

fn text_file(dir: &Path) -> PathBuf {
    let path = dir.join("story.txt");
    let line = "the cat sat on the mat; the dog sat on the log. é ü\n";
    std::fs::write(&path, line.repeat(40)).unwrap();
    path
}

/// What the library generates from the checkpoint's parameters, read here without the CLI.
fn library_greedy(ckpt: &Path, prompt: &str, n: usize) -> String {
    let (tensors, meta) = load_safetensors_with_metadata(ckpt).unwrap();
    assert_eq!(meta.get("model").map(String::as_str), Some("gpt"));
    let params: Vec<_> = tensors
        .into_iter()
        .filter_map(|(k, t)| k.strip_prefix("model.").map(|k| (k.to_string(), t)))
        .collect();
    let mut gpt = Gpt::new(tiny_config(), 99).unwrap();
    load_params_from_tensors(gpt.params(), &params).unwrap();
    gpt.eval();
    let opts = SampleOptions {
        max_new_tokens: n,
        temperature: 0.0,
        top_k: None,
        seed: 0,
    };
    generate_text(&gpt, prompt, &opts, |_| ControlFlow::Continue(())).unwrap()
}

#[test]
fn a_gpt_trained_on_a_text_file_samples_greedily_as_the_library_does() {
    let d = dir("text-sample");
    let (text, ckpt) = (text_file(&d), d.join("gpt.ckpt"));
    let out = ok(&cat(&[
        &["train"],
        TINY_GPT,
        &["--steps", "6", "--text", s(&text), "--checkpoint", s(&ckpt)],
    ]));
    assert!(out.contains("loss"), "{out}");
    let sample = [
        "sample",
        "--checkpoint",
        s(&ckpt),
        "--prompt",
        "the ",
        "--max-new-tokens",
        "40",
    ];
    let greedy = ok(&cat(&[&sample, &["--temperature", "0"]]));
    assert_eq!(
        greedy,
        format!("{}\n", library_greedy(&ckpt, "the ", 40)),
        "CLI == library"
    );
    assert!(!greedy.trim().is_empty());
    assert_eq!(
        ok(&cat(&[&sample, &["--temperature", "0", "--seed", "5"]])),
        greedy,
        "greedy ignores the seed"
    );
    // sampling: the same seed the same text
    let drawn = ok(&cat(&[&sample, &["--temperature", "1", "--top-k", "5", "--seed", "3"]]));
    assert_eq!(
        ok(&cat(&[&sample, &["--temperature", "1", "--top-k", "5", "--seed", "3"]])),
        drawn
    );
}

#[test]
fn a_bad_text_file_is_one_error_line_naming_it_and_the_offset() {
    let d = dir("text-bad");
    let missing = d.join("missing.txt");
    let e = fails(&cat(&[&["train"], TINY_GPT, &["--steps", "1", "--text", s(&missing)]]));
    assert!(e.contains("missing.txt"), "{e}");
    let binary = d.join("binary.txt");
    let mut bytes = "hello world, this is text ".repeat(10).into_bytes();
    bytes[37] = 0xff;
    std::fs::write(&binary, &bytes).unwrap();
    let e = fails(&cat(&[&["train"], TINY_GPT, &["--steps", "1", "--text", s(&binary)]]));
    assert!(e.contains("binary.txt") && e.contains("offset 37"), "{e}");
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--text", s(&binary)]]));
    assert!(e.contains("--model gpt"), "{e}");
}

#[test]
fn sampling_from_a_bad_or_non_gpt_checkpoint_is_one_error_line() {
    let d = dir("sample-bad");
    let text = text_file(&d);
    let sample = |ckpt: &Path| {
        fails(&[
            "sample",
            "--checkpoint",
            s(ckpt),
            "--prompt",
            "the ",
            "--max-new-tokens",
            "5",
        ])
    };
    let e = sample(&d.join("nope.ckpt"));
    assert!(e.contains("nope.ckpt"), "{e}");
    let e = sample(&text);
    assert!(e.contains("story.txt"), "{e}");
    let mlp_ckpt = d.join("mlp.ckpt");
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "1", "--batch-size", "8", "--checkpoint", s(&mlp_ckpt)],
    ]));
    let e = sample(&mlp_ckpt);
    assert!(e.contains("'mlp'") && e.contains("not a GPT"), "{e}");
    let gpt_ckpt = d.join("gpt.ckpt");
    ok(&cat(&[
        &["train"],
        TINY_GPT,
        &["--steps", "1", "--text", s(&text), "--checkpoint", s(&gpt_ckpt)],
    ]));
    let e = fails(&[
        "sample",
        "--checkpoint",
        s(&gpt_ckpt),
        "--prompt",
        "x",
        "--temperature",
        "-1",
    ]);
    assert!(e.contains("--temperature"), "{e}");
}

#[test]
fn shuffle_reports_the_epoch_and_resumes_only_shuffled() {
    let d = dir("shuffle");
    let ckpt = d.join("run.ckpt");
    let json = ok(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--shuffle",
            "--json",
            "--checkpoint",
            s(&ckpt),
        ],
    ]));
    let v: serde_json::Value = serde_json::from_str(json.lines().last().unwrap()).unwrap();
    assert_eq!(
        (v["epoch"].as_u64(), v["epoch_row"].as_u64()),
        (Some(0), Some(24)),
        "{json}"
    );
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &["--steps", "5", "--batch-size", "8", "--resume", s(&ckpt)],
    ]));
    assert!(e.contains("data order"), "{e}");
    // a sampled run's position is per rank: on another number of ranks, one plain line
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "5",
            "--batch-size",
            "8",
            "--shuffle",
            "--world-size",
            "2",
            "--resume",
            s(&ckpt),
        ],
    ]));
    assert!(
        e.contains("written at world size 1") && e.contains("this run uses 2") && e.contains("per rank"),
        "{e}"
    );
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "5", "--batch-size", "8", "--shuffle", "--resume", s(&ckpt)],
    ]));
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--drop-last"]]));
    assert!(e.contains("--shuffle"), "{e}");
}

#[test]
fn eval_every_evaluates_the_text_s_last_tenth() {
    use brigade_models::{Dataset, ValSplit};
    let d = dir("text-eval");
    let (text, save, csv) = (text_file(&d), d.join("gpt.safetensors"), d.join("losses.csv"));
    ok(&cat(&[
        &["train"],
        TINY_GPT,
        &["--steps", "3", "--text", s(&text), "--eval-every", "2"],
        &["--save", s(&save), "--losses", s(&csv)],
    ]));
    // the val_loss column after steps 1 (the second) and 2 (the last)
    let rows: Vec<String> = std::fs::read_to_string(&csv)
        .unwrap()
        .lines()
        .skip(1)
        .map(String::from)
        .collect();
    let val: Vec<Option<f64>> = rows
        .iter()
        .map(|r| r.rsplit(',').next().unwrap().parse().ok())
        .collect();
    assert!(val[0].is_none() && val[1].is_some(), "{rows:?}");
    // the last one is the saved model's loss on the file's last tenth, as the library cuts it
    let held = Dataset::from_text_file(&text, 16, &ValSplit::Fraction(0.1), brigade_models::Tokenizer::Bytes)
        .unwrap()
        .val
        .unwrap();
    let mut gpt = Gpt::new(tiny_config(), 0).unwrap();
    load_params_from_tensors(gpt.params(), &brigade_models::load_safetensors(&save).unwrap()).unwrap();
    gpt.eval();
    let expected = gpt
        .loss(&held.batch(0, held.len()).unwrap())
        .unwrap()
        .value()
        .item()
        .unwrap();
    let last = val[2].expect("evaluated after the last step");
    assert!(
        (last - expected).abs() < 1e-4 * expected.abs(),
        "val_loss {last}, the last tenth's {expected}"
    );
    // the tenth is the held-out data: no other is taken beside it
    for other in [&["--val-fraction", "0.2"][..], &["--eval-data", s(&save)][..]] {
        let e = fails(&cat(&[
            &["train"],
            TINY_GPT,
            &["--steps", "1", "--text", s(&text), "--eval-every", "1"],
            other,
        ]));
        assert!(e.contains(other[0]) && e.contains("last tenth"), "{e}");
    }
}
