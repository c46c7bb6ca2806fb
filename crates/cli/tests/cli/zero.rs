//! `--zero 1|2` from the command line: the same losses and parameters as plain DDP (mlp and
//! gpt, SGD and AdamW, 2 and 4 ranks, --accum 2), resume under ZeRO, the memory report, and
//! the combinations that are one error line.

use crate::common;

use std::path::Path;

use brigade_models::load_safetensors;
use brigade_tensor::DType;
use common::{cat, dir, fails, losses, ok, s, GPT, MLP};

/// Several buckets (2 KiB caps), so that shards cut parameters and padding appears.
const SMALL_BUCKETS: &[&str] = &["--bucket-mb", "0.002", "--first-bucket-mb", "0.001"];

fn params(path: &Path) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<(String, Vec<f32>)> = load_safetensors(path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(
        a.iter().map(|p| &p.0).collect::<Vec<_>>(),
        b.iter().map(|p| &p.0).collect::<Vec<_>>()
    );
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.1.iter().zip(&y.1).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// Trains `model` for 3 steps of 2 microbatches with `extra`; returns losses and saved params.
fn train(d: &Path, tag: &str, model: &[&str], extra: &[&str]) -> (Vec<(usize, f64)>, Vec<(String, Vec<f32>)>) {
    let (l, p) = (d.join(format!("{tag}.csv")), d.join(format!("{tag}.safetensors")));
    let base = [
        "train",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--accum",
        "2",
        "--threads-per-rank",
        "1",
        "--losses",
        s(&l),
        "--save",
        s(&p),
    ];
    ok(&cat(&[&base, model, SMALL_BUCKETS, extra]));
    (losses(&l), params(&p))
}

fn parity(name: &str, model: &[&str]) {
    let d = dir(name);
    for opt in [
        &["--optimizer", "sgd", "--momentum", "0.9"][..],
        &["--optimizer", "adamw"],
    ] {
        for world in ["2", "4"] {
            let run = |zero: &str| {
                let tag = format!("{}-{world}-{zero}", opt[1]);
                train(&d, &tag, model, &cat(&[opt, &["--world-size", world, "--zero", zero]]))
            };
            let (plain_losses, plain_params) = run("0");
            for zero in ["1", "2"] {
                let (l, p) = run(zero);
                let what = format!("{name} {} world {world} --zero {zero}", opt[1]);
                assert_eq!(l.len(), 3, "{what}");
                for ((s, a), (_, b)) in l.iter().zip(&plain_losses) {
                    assert!((a - b).abs() <= 1e-6, "{what} step {s}: loss {a} vs plain {b}");
                }
                let diff = max_diff(&p, &plain_params);
                assert!(diff <= 1e-6, "{what}: saved parameters differ from plain DDP by {diff}");
            }
        }
    }
}

#[test]
fn zero_1_and_2_match_plain_ddp_on_the_mlp() {
    parity("zero-parity-mlp", MLP);
}

#[test]
fn zero_1_and_2_match_plain_ddp_on_the_gpt() {
    parity("zero-parity-gpt", GPT);
}

#[test]
fn a_resumed_zero_run_reproduces_the_uninterrupted_run_exactly() {
    let d = dir("zero-resume");
    for zero in ["1", "2"] {
        let run = [
            &[
                "train",
                "--world-size",
                "2",
                "--batch-size",
                "2",
                "--accum",
                "2",
                "--threads-per-rank",
                "1",
            ][..],
            MLP,
            SMALL_BUCKETS,
            &["--optimizer", "adamw"],
        ]
        .concat();
        let sharded = cat(&[&run, &["--zero", zero]]);
        let file = |name: &str| d.join(format!("{name}{zero}"));
        let (full_l, full_p) = (file("full.csv"), file("full.safetensors"));
        ok(&cat(&[
            &sharded,
            &["--steps", "6", "--losses", s(&full_l), "--save", s(&full_p)],
        ]));
        let (l, p, ck) = (file("part.csv"), file("part.safetensors"), file("ck.safetensors"));
        ok(&cat(&[
            &sharded,
            &["--steps", "3", "--losses", s(&l), "--checkpoint", s(&ck)],
        ]));
        // the checkpoint holds every shard's state, whole, under the parameters' names: what
        // plain DDP's checkpoint holds after the same steps
        let plain_ck = file("plain-ck.safetensors");
        ok(&cat(&[&run, &["--steps", "3", "--checkpoint", s(&plain_ck)]]));
        let (state, plain_state) = (params(&ck), params(&plain_ck));
        assert!(state.iter().any(|(n, _)| n == "optim.layers.0.weight.exp_avg"));
        let diff = max_diff(&state, &plain_state);
        assert!(
            diff <= 1e-6,
            "--zero {zero}: the checkpoint differs from plain DDP's by {diff}"
        );
        ok(&cat(&[
            &sharded,
            &["--steps", "6", "--resume", s(&ck), "--losses", s(&l), "--save", s(&p)],
        ]));
        let (a, b) = (losses(&l), losses(&full_l));
        assert_eq!(a.len(), 6);
        for ((step, x), (_, y)) in a.iter().zip(&b) {
            assert_eq!(x.to_bits(), y.to_bits(), "--zero {zero} step {step}: {x} vs {y}");
        }
        assert_eq!(max_diff(&params(&p), &params(&full_p)), 0.0, "--zero {zero}");
    }
}

/// A 2-row run of the small MLP with `extra`.
fn small<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    cat(&[&["train", "--batch-size", "2", "--threads-per-rank", "1"], MLP, extra])
}

#[test]
fn resuming_with_another_stage_and_unsupported_combinations_are_one_error_line() {
    let d = dir("zero-errors");
    let (ck, plain) = (d.join("ck.safetensors"), d.join("plain.safetensors"));
    ok(&small(&[
        "--steps",
        "1",
        "--world-size",
        "2",
        "--zero",
        "1",
        "--checkpoint",
        s(&ck),
    ]));
    ok(&small(&[
        "--steps",
        "1",
        "--world-size",
        "2",
        "--checkpoint",
        s(&plain),
    ]));
    // another world size resumes: the checkpoint holds the state whole, cut again on load (4
    // ranks at 1 row read the 4 rows a step of 2 ranks at 2, so the data reads on from its row)
    ok(&cat(&[
        &["train", "--batch-size", "1", "--threads-per-rank", "1"],
        MLP,
        &["--world-size", "4", "--zero", "1", "--steps", "2", "--resume", s(&ck)],
    ]));
    for (extra, from, want) in [
        (
            &["--world-size", "2", "--zero", "2"][..],
            &ck,
            "--zero 1, this run has --zero 2",
        ),
        (&["--world-size", "2"], &ck, "--zero 1, this run has --zero 0"),
        // a plain checkpoint does not resume under ZeRO either
        (
            &["--world-size", "2", "--zero", "1"],
            &plain,
            "--zero 0, this run has --zero 1",
        ),
    ] {
        let err = fails(&small(&cat(&[extra, &["--steps", "2", "--resume", s(from)]])));
        assert!(err.contains(want), "{err}");
    }
    let err = fails(&small(&["--world-size", "2", "--zero", "2", "--comm-hook", "fp16"]));
    assert!(err.contains("--zero 2") && err.contains("--comm-hook fp16"), "{err}");
    // the autotuner regroups buckets, and ZeRO's shards are cut from fixed ones
    let err = fails(&small(&["--world-size", "2", "--zero", "1", "--bucket-mb", "auto"]));
    assert!(err.contains("--zero 1") && err.contains("--bucket-mb auto"), "{err}");
    // (--zero 1|2 over --backend nccl is accepted: cli/nccl.rs checks that without a GPU its
    // one error line is about the missing device)
}

#[test]
fn the_memory_report_follows_the_zero_paper() {
    // Ψ = 16*32+32 + 32*32+32 + 32*4+4 = 1732 parameters; AdamW in f32 on 2 ranks; the padding
    // is less than one element per bucket and rank
    let psi = 1732usize;
    let memory = |zero: &str| -> serde_json::Value {
        let args = cat(&[
            &[
                "train",
                "--world-size",
                "2",
                "--batch-size",
                "2",
                "--steps",
                "2",
                "--threads-per-rank",
                "1",
                "--json",
            ],
            MLP,
            SMALL_BUCKETS,
            &["--zero", zero],
        ]);
        let v: serde_json::Value = serde_json::from_str(ok(&args).trim()).unwrap();
        v["memory"].clone()
    };
    let get = |m: &serde_json::Value, k: &str| m[k].as_u64().unwrap() as usize;
    let within = |measured: usize, formula: usize| measured >= formula && measured <= formula + 64;
    let m0 = memory("0");
    assert_eq!(get(&m0, "parameter_bytes"), 4 * psi);
    assert_eq!(get(&m0, "gradient_bytes"), 4 * psi);
    assert_eq!(get(&m0, "optimizer_state_bytes"), 8 * psi);
    let m1 = memory("1");
    assert_eq!(get(&m1, "parameter_bytes"), 4 * psi);
    assert!(within(get(&m1, "gradient_bytes"), 4 * psi), "{m1}");
    assert!(within(get(&m1, "optimizer_state_bytes"), 8 * psi / 2), "{m1}");
    assert!(get(&m1, "comm_scratch_bytes") > 0, "{m1}");
    let m2 = memory("2");
    assert!(within(get(&m2, "gradient_bytes"), 4 * psi / 2), "{m2}");
    assert!(within(get(&m2, "optimizer_state_bytes"), 8 * psi / 2), "{m2}");
    assert_eq!(get(&m2, "bucket_bytes"), 0, "{m2}");
}

#[test]
fn accum_into_shard_without_a_gradient_shard_or_microbatches_is_one_error_line() {
    for (extra, want) in [
        (&["--zero", "1", "--accum", "2"][..], "ZeRO stage 2 or 3"),
        (&["--accum", "2"], "ZeRO stage 2 or 3"),
        (&["--zero", "2"], "--accum 2 or more"),
        (&["--zero", "3", "--accum", "1"], "--accum 2 or more"),
    ] {
        let args = cat(&[extra, &["--world-size", "2", "--steps", "1", "--accum-into-shard"]]);
        let err = fails(&small(&args));
        assert!(
            err.contains("--accum-into-shard") && err.contains(want),
            "{extra:?}: {err}"
        );
    }
    ok(&small(&[
        "--world-size",
        "2",
        "--steps",
        "1",
        "--zero",
        "2",
        "--accum",
        "2",
        "--accum-into-shard",
    ]));
}
