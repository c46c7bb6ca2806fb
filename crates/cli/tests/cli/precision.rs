//! `brigade train --precision`: bf16 halves the bucket bytes in `--json` and counts the f32
//! masters; fp16 writes the `scale` column and counts skipped steps; a bf16 checkpoint samples
//! and initialises an f32 run; bad values and combinations not built fail in one line.

use std::path::Path;

use super::common::{brigade, cat, dir, fails, ok, s, GPT, MLP};

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
    assert!(
        e.contains("use --policy fp16 (a pass-through)"),
        "the library's fields said as flags: {e}"
    );
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--steps",
            "1",
            "--world-size",
            "2",
            "--precision",
            "bf16",
            "--reduce-dtype",
            "f32",
            "--policy",
            "fp16",
        ],
    ]));
    assert!(
        e.contains("defeats --reduce-dtype f32") && e.trim().lines().count() == 1,
        "{e}"
    );
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--reduce-dtype", "bf16"]]));
    assert!(
        e.contains("--reduce-dtype bf16") && e.trim().lines().count() == 1,
        "{e}"
    );
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

#[test]
fn a_resume_under_another_precision_says_so_and_what_becomes_of_the_loss_scale() {
    let d = dir("precision-resume");
    let base = cat(&[&["train"], MLP, &["--world-size", "2"]]);
    let write = |name: &str, flags: &[&str]| {
        let ck = d.join(name);
        ok(&cat(&[&base, flags, &["--steps", "2", "--checkpoint", s(&ck)]]));
        ck
    };
    let resume = |ck: &Path, flags: &[&str]| {
        let out = brigade(&cat(&[&base, flags, &["--steps", "4", "--resume", s(ck)]]));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let fp16 = write("fp16.ckpt", &["--precision", "fp16"]);
    let note = resume(&fp16, &[]);
    assert!(note.contains("precision fp16 -> f32"), "{note}");
    assert!(note.contains("loss scale (65536) is dropped"), "{note}");
    assert!(
        !note.contains("reduce_dtype"),
        "the reduce dtype follows the precision: {note}"
    );
    let bf16 = write("bf16.ckpt", &["--precision", "bf16"]);
    let note = resume(&bf16, &["--precision", "fp16"]);
    assert!(
        note.contains("precision bf16 -> fp16") && note.contains("loss scale starts afresh at 65536"),
        "{note}"
    );
    let zero3 = write("zero3.ckpt", &["--precision", "bf16", "--policy", "zero3"]);
    let note = resume(&zero3, &["--policy", "zero3"]);
    assert!(
        note.contains("precision bf16 -> f32") && !note.contains("loss scale"),
        "{note}"
    );
    // both fp16: the scale is kept, nothing to say
    assert!(resume(&fp16, &["--precision", "fp16"]).is_empty());
    // an f32 sum of fp16 gradients, then the parameters' own: the reduce dtype alone changed
    let summed = write("summed.ckpt", &["--precision", "fp16", "--reduce-dtype", "f32"]);
    let note = resume(&summed, &["--precision", "fp16"]);
    assert!(
        note.contains("reduce_dtype f32 -> fp16") && !note.contains("precision"),
        "{note}"
    );
}

#[test]
fn a_shuffled_run_at_another_batch_and_a_dropout_run_on_other_ranks_say_what_differs() {
    let d = dir("resume-notes");
    let ck = d.join("shuffled.ckpt");
    let shuffled = cat(&[&["train"], MLP, &["--world-size", "2", "--shuffle"]]);
    ok(&cat(&[
        &shuffled,
        &["--steps", "2", "--batch-size", "8", "--checkpoint", s(&ck)],
    ]));
    let out = brigade(&cat(&[
        &shuffled,
        &["--steps", "4", "--batch-size", "4", "--resume", s(&ck)],
    ]));
    let note = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{note}");
    assert!(
        note.contains("4 a step per rank") && note.contains("where it read 8"),
        "{note}"
    );
    let ck = d.join("dropout.ckpt");
    let dropout = cat(&[&["train"], MLP, &["--dropout", "0.1"]]);
    ok(&cat(&[
        &dropout,
        &[
            "--world-size",
            "2",
            "--batch-size",
            "8",
            "--steps",
            "2",
            "--checkpoint",
            s(&ck),
        ],
    ]));
    let out = brigade(&cat(&[
        &dropout,
        &[
            "--world-size",
            "4",
            "--batch-size",
            "4",
            "--steps",
            "4",
            "--resume",
            s(&ck),
        ],
    ]));
    let note = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{note}");
    assert!(
        note.contains("drew its masks on 2 ranks, this run on 4") && note.contains("masks (and the steps) differ"),
        "{note}"
    );
    // a run without dropout draws no mask: nothing to say
    let ck = d.join("plain.ckpt");
    let plain = cat(&[&["train"], MLP]);
    ok(&cat(&[
        &plain,
        &[
            "--world-size",
            "2",
            "--batch-size",
            "8",
            "--steps",
            "2",
            "--checkpoint",
            s(&ck),
        ],
    ]));
    let out = brigade(&cat(&[
        &plain,
        &[
            "--world-size",
            "4",
            "--batch-size",
            "4",
            "--steps",
            "4",
            "--resume",
            s(&ck),
        ],
    ]));
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_losses_file_resumed_across_fp16_and_another_precision_has_as_many_cells_in_every_row() {
    let d = dir("precision-losses-cells");
    let base = cat(&[&["train"], MLP, &["--world-size", "2"]]);
    for (first, then) in [("fp16", "f32"), ("f32", "fp16")] {
        let (ck, l) = (d.join(format!("{first}.ckpt")), d.join(format!("{first}.csv")));
        ok(&cat(&[
            &base,
            &[
                "--precision",
                first,
                "--steps",
                "3",
                "--checkpoint",
                s(&ck),
                "--losses",
                s(&l),
            ],
        ]));
        let out = brigade(&cat(&[
            &base,
            &[
                "--precision",
                then,
                "--steps",
                "5",
                "--resume",
                s(&ck),
                "--losses",
                s(&l),
            ],
        ]));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = std::fs::read_to_string(&l).unwrap();
        let header = text.lines().next().unwrap();
        assert_eq!(header, "step,loss,lr,grad_norm,val_loss,scale", "{first} -> {then}");
        assert!(
            text.lines().all(|r| r.split(',').count() == 6),
            "{first} -> {then}: {text}"
        );
        assert_eq!(text.lines().count(), 6, "{text}");
    }
}
