//! GPT-2 tokens and token files through the command line: `brigade tokenize` writes an llm.c
//! shard (read back here to llm.c's spec), `train --tokenizer gpt2 --data FILE.bin` trains on it
//! (shuffled, on two ranks, from a glob, per rank, with a validation split), the checkpoint
//! records the tokenizer, `sample` uses it, and a mismatch is one error line.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use brigade_models::{
    generate_text_with, load_params_from_tensors, load_safetensors_with_metadata, Gpt, GptConfig, Model, SampleOptions,
    Tokenizer,
};

use crate::common::*;

/// The small GPT of these tests, at GPT-2's vocabulary.
const TINY_GPT2: &[&str] = &[
    "--model",
    "gpt",
    "--tokenizer",
    "gpt2",
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

fn text_file(dir: &Path) -> PathBuf {
    let path = dir.join("story.txt");
    let line = "The cat sat on the mat; the dog sat on the log. Café, naïve: 42 ✓\n";
    std::fs::write(&path, line.repeat(30)).unwrap();
    path
}

/// The ids of an llm.c shard, read to llm.c's spec: 256 little-endian int32 (magic 20240520,
/// version 1, the count, zeros), then the count's uint16.
fn llmc_ids(path: &Path) -> Vec<u16> {
    let b = std::fs::read(path).unwrap();
    let word = |i: usize| i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!((word(0), word(1)), (20240520, 1), "magic and version");
    assert!((3..256).all(|i| word(i) == 0));
    let n = word(2) as usize;
    assert_eq!(b.len(), 1024 + 2 * n);
    b[1024..]
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn write_llmc(path: &Path, ids: &[u16]) {
    let mut b = vec![0u8; 1024];
    b[..4].copy_from_slice(&20240520i32.to_le_bytes());
    b[4..8].copy_from_slice(&1i32.to_le_bytes());
    b[8..12].copy_from_slice(&(ids.len() as i32).to_le_bytes());
    b.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_tokenized_text_trains_the_gpt2_vocabulary_and_samples_with_the_recorded_tokenizer() {
    let d = dir("tokens-gpt2");
    let (text, shard, ckpt) = (text_file(&d), d.join("story.bin"), d.join("gpt.ckpt"));
    let out = ok(&["tokenize", "--text", s(&text), "--out", s(&shard)]);
    let ids = llmc_ids(&shard);
    assert!(out.contains(&format!("wrote {} gpt2 tokens", ids.len())), "{out}");
    // <|endoftext|> first, as llm.c starts a document, then the text's GPT-2 tokens
    let body = std::fs::read_to_string(&text).unwrap();
    let want: Vec<u16> = std::iter::once(50256)
        .chain(Tokenizer::Gpt2.encode(&body).into_iter().map(|t| t as u16))
        .collect();
    assert_eq!(ids, want);
    // the output may not replace its input
    let e = fails(&["tokenize", "--text", s(&text), "--out", s(&text)]);
    assert!(e.contains("would write over the --text file"), "{e}");

    let train = cat(&[
        &["train"],
        TINY_GPT2,
        &[
            "--data",
            s(&shard),
            "--world-size",
            "2",
            "--shuffle",
            "--steps",
            "3",
            "--checkpoint",
            s(&ckpt),
        ],
    ]);
    ok(&train);
    let (_, meta) = load_safetensors_with_metadata(&ckpt).unwrap();
    assert!(meta["model_config"].contains("\"tokenizer\":\"gpt2\""), "{meta:?}");
    assert!(meta["model_config"].contains("\"vocab\":50257"), "{meta:?}");
    // sample reads the tokenizer from the checkpoint: the library's greedy text through GPT-2
    let greedy = ok(&[
        "sample",
        "--checkpoint",
        s(&ckpt),
        "--prompt",
        "The cat",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ]);
    assert_eq!(greedy, format!("{}\n", library_greedy(&ckpt, "The cat", 12)));
    assert_eq!(
        ok(&[
            "sample",
            "--checkpoint",
            s(&ckpt),
            "--prompt",
            "The cat",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
            "--tokenizer",
            "gpt2"
        ]),
        greedy
    );
    // another tokenizer than the checkpoint's: one line, for sample and for a resume
    let e = fails(&[
        "sample",
        "--checkpoint",
        s(&ckpt),
        "--prompt",
        "The",
        "--tokenizer",
        "bytes",
    ]);
    assert!(
        e.contains("trained with --tokenizer gpt2") && e.contains("not bytes"),
        "{e}"
    );
    let bytes_resume: Vec<&str> = without(&train, "--tokenizer")
        .into_iter()
        .chain(["--resume", s(&ckpt)])
        .collect();
    let e = fails(&bytes_resume);
    assert!(
        e.contains("--resume") && e.contains("trained with --tokenizer gpt2"),
        "{e}"
    );
    // GPT-2's ids read with the byte vocabulary: the row and the id named
    let e = fails(&cat(&[
        &["train"],
        GPT,
        &["--data", s(&shard), "--steps", "1", "--batch-size", "2"],
    ]));
    assert!(e.contains("token 50256, expected 0..256"), "{e}");
}

/// What the library generates greedily from the checkpoint's parameters with GPT-2's tokenizer.
fn library_greedy(ckpt: &Path, prompt: &str, n: usize) -> String {
    let (tensors, _) = load_safetensors_with_metadata(ckpt).unwrap();
    let params: Vec<_> = tensors
        .into_iter()
        .filter_map(|(k, t)| k.strip_prefix("model.").map(|k| (k.to_string(), t)))
        .collect();
    let cfg = GptConfig {
        vocab: 50257,
        d_model: 16,
        n_layers: 1,
        n_heads: 2,
        d_ff: 32,
        context: 16,
        ..GptConfig::default()
    };
    let mut gpt = Gpt::new(cfg, 99).unwrap();
    load_params_from_tensors(gpt.params(), &params).unwrap();
    gpt.eval();
    let opts = SampleOptions {
        max_new_tokens: n,
        temperature: 0.0,
        top_k: None,
        seed: 0,
    };
    generate_text_with(&gpt, Tokenizer::Gpt2, prompt, &opts, |_| ControlFlow::Continue(())).unwrap()
}

#[test]
fn token_files_read_as_nanogpt_from_a_glob_per_rank_and_with_a_validation_split() {
    let d = dir("tokens-files");
    let ids = |n: u16, k: u16| (0..n).map(move |i| (i * k) % 50257).collect::<Vec<u16>>();
    // nanoGPT's raw uint16: 200 tokens, rows of 17 every 16: 12 rows
    let raw = d.join("train.bin");
    std::fs::write(
        &raw,
        ids(200, 7).iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .unwrap();
    let e = fails(&cat(&[&["train"], TINY_GPT2, &["--data", s(&raw), "--steps", "1"]]));
    assert!(
        e.contains("not an llm.c shard") && e.contains("--data-format nanogpt"),
        "{e}"
    );
    let out = ok(&cat(&[
        &["train"],
        TINY_GPT2,
        &[
            "--data",
            s(&raw),
            "--data-format",
            "nanogpt",
            "--steps",
            "2",
            "--shuffle",
            "--world-size",
            "2",
        ],
    ]));
    assert!(out.contains("6 rows per rank per epoch"), "{out}");
    // a glob: both shards, 12 + 6 rows
    write_llmc(&d.join("part-000.bin"), &ids(200, 3));
    write_llmc(&d.join("part-001.bin"), &ids(100, 5));
    let glob = d.join("part-*.bin");
    let out = ok(&cat(&[
        &["train"],
        TINY_GPT2,
        &["--data", s(&glob), "--steps", "2", "--shuffle", "--world-size", "2"],
    ]));
    assert!(out.contains("9 rows per rank per epoch"), "{out}");
    // a shard per rank, of different lengths, under --join; a held-out shard
    let losses = d.join("losses.csv");
    let rank = d.join("part-00{rank}.bin");
    let out = ok(&cat(&[
        &["train"],
        TINY_GPT2,
        &[
            "--data",
            s(&rank),
            "--world-size",
            "2",
            "--join",
            "divide-initial",
            "--steps",
            "3",
            "--eval-every",
            "3",
            "--eval-data",
            s(&d.join("part-001.bin")),
            "--losses",
            s(&losses),
        ],
    ]));
    assert!(out.contains("join"), "{out}");
    assert!(std::fs::read_to_string(&losses)
        .unwrap()
        .lines()
        .any(|l| !l.ends_with(',')));
    // --val-fraction holds out the shard's last rows (a view of the file)
    ok(&cat(&[
        &["train"],
        TINY_GPT2,
        &[
            "--data",
            s(&glob),
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--val-fraction",
            "0.2",
        ],
    ]));
    let e = fails(&cat(&[
        &["train"],
        TINY_GPT2,
        &["--data", s(&d.join("none-*.bin")), "--steps", "1"],
    ]));
    assert!(e.contains("matches no file"), "{e}");
    let e = fails(&cat(&[
        &["train"],
        TINY_GPT2,
        &["--data-format", "nanogpt", "--steps", "1"],
    ]));
    assert!(e.contains("add --data"), "{e}");
}

#[test]
fn a_resume_on_a_changed_shard_is_refused() {
    let d = dir("tokens-drift");
    let (shard, ckpt) = (d.join("s.bin"), d.join("s.ckpt"));
    let ids: Vec<u16> = (0..400).map(|i| (i * 11) % 50257).collect();
    write_llmc(&shard, &ids);
    let run = |steps: &'static str, resume: bool| {
        let mut a = cat(&[
            &["train"],
            TINY_GPT2,
            &["--data", s(&shard), "--steps", steps, "--checkpoint", s(&ckpt)],
        ]);
        if resume {
            a.extend(["--resume", s(&ckpt)]);
        }
        a
    };
    ok(&run("2", false));
    ok(&run("3", true));
    let mut other = ids.clone();
    other[5] = 1;
    write_llmc(&shard, &other);
    let e = fails(&run("4", true));
    assert!(e.contains("it was written with data") && e.contains("(sampled)"), "{e}");
}

#[test]
fn no_output_replaces_a_file_a_data_or_eval_data_pattern_matches() {
    let d = dir("tokens-glob-kept");
    let ids: Vec<u16> = (0..200u16).map(|i| (i * 7) % 50257).collect();
    let shards = [d.join("part-000.bin"), d.join("part-001.bin")];
    for p in &shards {
        write_llmc(p, &ids);
    }
    let bytes = std::fs::read(&shards[1]).unwrap();
    let glob = d.join("part-*.bin");
    for data_flag in ["--data", "--eval-data"] {
        for flag in ["--checkpoint", "--losses", "--save"] {
            let mut args = cat(&[&["train"], TINY_GPT2, &["--steps", "1", flag, s(&shards[1])]]);
            if data_flag == "--data" {
                args.extend(["--data", s(&glob)]);
            } else {
                args.extend(["--data", s(&shards[0]), "--eval-data", s(&glob), "--eval-every", "1"]);
            }
            let e = fails(&args);
            assert!(
                e.contains(&format!("would write over the {data_flag} file")) && e.contains("part-001.bin"),
                "{data_flag} {flag}: {e}"
            );
            assert_eq!(
                std::fs::read(&shards[1]).unwrap(),
                bytes,
                "{data_flag} {flag}: the shard changed"
            );
        }
    }
}
