//! `brigade train --precision`: bf16 halves the bucket bytes in `--json` and counts the f32
//! masters; fp16 writes the `scale` column and counts skipped steps; a bf16 checkpoint samples
//! and initialises an f32 run; bad values and combinations not built fail in one line.

use super::common::{cat, dir, fails, ok, s, GPT, MLP};

/// `--json`'s memory object of a 2-rank, 3-step run at `precision`.
fn memory(precision: &str) -> serde_json::Value {
    let out = ok(&cat(&[
        &["train"],
        MLP,
        &["--world-size", "2", "--steps", "3", "--json", "--precision", precision],
    ]));
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    v["memory"].clone()
}

#[test]
fn bf16_halves_the_buckets_and_counts_the_f32_masters() {
    let (f, b) = (memory("f32"), memory("bf16"));
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    assert_eq!(n(&b, "bucket_bytes") * 2, n(&f, "bucket_bytes"), "{b} vs {f}");
    assert_eq!(n(&b, "parameter_bytes") * 2, n(&f, "parameter_bytes"));
    assert_eq!(
        (n(&f, "master_weight_bytes"), n(&b, "master_weight_bytes")),
        (0, n(&f, "parameter_bytes"))
    );
}

#[test]
fn fp16_writes_the_scale_column_and_a_bf16_checkpoint_samples() {
    let d = dir("precision");
    let losses = d.join("fp16.csv");
    let out = ok(&cat(&[
        &["train"],
        MLP,
        &["--steps", "4", "--precision", "fp16", "--losses", s(&losses), "--json"],
    ]));
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(
        (v["skipped_steps"].as_u64(), v["scale"][0].as_f64()),
        (Some(0), Some(65536.0)),
        "{v}"
    );
    let text = std::fs::read_to_string(&losses).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("step,loss,lr,grad_norm,val_loss,scale"), "{text}");
    assert!(lines.all(|l| l.ends_with(",65536")), "{text}");

    let ckpt = d.join("gpt.ckpt");
    ok(&cat(&[
        &["train"],
        GPT,
        &["--steps", "2", "--precision", "bf16", "--checkpoint", s(&ckpt)],
    ]));
    ok(&[
        "sample",
        "--checkpoint",
        s(&ckpt),
        "--prompt",
        "ab",
        "--max-new-tokens",
        "4",
    ]);
    ok(&cat(&[&["train"], GPT, &["--steps", "1", "--init", s(&ckpt)]]));
}

#[test]
fn a_bad_precision_and_combinations_not_built_fail_in_one_line() {
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--precision", "f8"]]));
    assert!(e.contains("unknown precision 'f8'"), "{e}");
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "1",
            "--world-size",
            "2",
            "--precision",
            "fp16",
            "--policy",
            "bf16",
        ],
    ]));
    assert!(e.contains("--precision fp16") && e.trim().lines().count() == 1, "{e}");
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--reduce-dtype", "f8"]]));
    assert!(e.contains("unknown reduce dtype 'f8'"), "{e}");
}

/// `--reduce-dtype f32` beside bf16 parameters: f32 buckets in `--json`, the compute copy bf16;
/// ZeRO-2 under bf16 keeps half the f32 masters per rank.
#[test]
fn reduce_dtype_f32_keeps_f32_buckets_and_zero2_shards_the_masters() {
    let json = |extra: &[&str]| -> serde_json::Value {
        let out = ok(&cat(&[
            &["train"],
            MLP,
            &["--world-size", "2", "--steps", "2", "--json", "--precision", "bf16"],
            extra,
        ]));
        let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        v["memory"].clone()
    };
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    let (bf16, f32_reduce) = (json(&[]), json(&["--reduce-dtype", "f32"]));
    assert_eq!(
        n(&f32_reduce, "bucket_bytes"),
        2 * n(&bf16, "bucket_bytes"),
        "{f32_reduce}"
    );
    assert_eq!(n(&f32_reduce, "parameter_bytes"), n(&bf16, "parameter_bytes"));
    let zero2 = json(&["--policy", "zero2"]);
    let (whole, shard) = (n(&bf16, "master_weight_bytes"), n(&zero2, "master_weight_bytes"));
    assert!(shard * 2 >= whole && shard * 2 < whole + 64, "{shard} of {whole}");
}
