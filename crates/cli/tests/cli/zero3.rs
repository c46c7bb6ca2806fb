//! `--zero 3` from the command line: plain DDP's losses and saved parameters bit for bit (mlp
//! and gpt, SGD and AdamW, 2 and 3 ranks, --accum 2), the memory line and `--json` with the
//! gathered units, a checkpoint that `--init` and `sample` read, one error line for a
//! compressing hook, and under one `--memory-budget` a GPT of over 3x the parameters plain DDP
//! fits, trained with activation checkpointing.

use crate::common;

use std::path::Path;

use brigade_models::load_safetensors;
use brigade_tensor::DType;
use common::{cat, dir, fails, losses, ok, s, GPT, MLP};

fn params(path: &Path) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<(String, Vec<u32>)> = load_safetensors(path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let bits = t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            (n, bits.iter().map(|x| x.to_bits()).collect())
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// 3 steps of 2 microbatches with `extra`: losses and saved parameters.
fn train(d: &Path, tag: &str, model: &[&str], extra: &[&str]) -> (Vec<(usize, f64)>, Vec<(String, Vec<u32>)>) {
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
    ok(&cat(&[&base, model, extra]));
    (losses(&l), params(&p))
}

fn parity(name: &str, model: &[&str]) {
    let d = dir(name);
    for opt in [
        &["--optimizer", "sgd", "--momentum", "0.9"][..],
        &["--optimizer", "adamw"],
    ] {
        for world in ["2", "3"] {
            let run = |zero: &str| {
                let tag = format!("{}-{world}-{zero}", opt[1]);
                train(&d, &tag, model, &cat(&[opt, &["--world-size", world, "--zero", zero]]))
            };
            let (plain_losses, plain_params) = run("0");
            let (l, p) = run("3");
            let what = format!("{name} {} world {world}", opt[1]);
            assert_eq!(l.len(), 3, "{what}");
            for ((step, a), (_, b)) in l.iter().zip(&plain_losses) {
                assert_eq!(a.to_bits(), b.to_bits(), "{what} step {step}: loss {a} vs plain {b}");
            }
            assert_eq!(p, plain_params, "{what}: saved parameters differ from plain DDP");
        }
    }
}

#[test]
fn zero_3_matches_plain_ddp_bit_for_bit_on_the_mlp() {
    parity("zero3-parity-mlp", MLP);
}

#[test]
fn zero_3_matches_plain_ddp_bit_for_bit_on_the_gpt() {
    parity("zero3-parity-gpt", GPT);
}

#[test]
fn the_memory_report_counts_the_shards_and_the_gathered_units() {
    // Ψ = 16*32+32 + 32*32+32 + 32*4+4 = 1732 parameters in 3 units (544, 1056, 132) on 2 ranks
    let base = [
        "train",
        "--world-size",
        "2",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--threads-per-rank",
        "1",
    ];
    let json = |zero: &str| -> serde_json::Value {
        let out = ok(&cat(&[&base, MLP, &["--zero", zero, "--json"]]));
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["memory"].clone()
    };
    let get = |m: &serde_json::Value, k: &str| m[k].as_u64().unwrap() as usize;
    let (m0, m3) = (json("0"), json("3"));
    assert_eq!(get(&m0, "parameter_bytes"), 4 * 1732, "{m0}");
    assert_eq!(get(&m0, "gathered_bytes"), 0, "{m0}");
    assert_eq!(get(&m3, "parameter_bytes"), 4 * (272 + 528 + 66), "{m3}");
    // a unit and the next, prefetched while it computes: layers 0 and 1 at most
    assert_eq!(get(&m3, "gathered_bytes"), 4 * (544 + 1056), "{m3}");
    assert!(get(&m3, "total_bytes") < get(&m0, "total_bytes"), "{m3} vs {m0}");
    let text = ok(&cat(&[&base, &MLP[..MLP.len() - 1], &["--zero", "3"]]));
    let line = text.lines().find(|l| l.starts_with("memory per rank")).expect(&text);
    assert!(
        line.contains("(zero 3, measured)") && line.contains("gathered 0.01 MiB"),
        "{line}"
    );
}

#[test]
fn the_report_says_what_the_compute_waited_for_the_gathers() {
    // 0.1 Gb/s, 20 us: the first unit's gather in each pass is never prefetched, so the compute
    // waits at least for layer 0's shards in forward (1088 bytes: 107 us) and layer 2's in
    // backward (264 bytes: 41 us)
    let base = [
        "train",
        "--world-size",
        "2",
        "--batch-size",
        "2",
        "--steps",
        "3",
        "--threads-per-rank",
        "1",
        "--net-gbps",
        "0.1",
        "--net-latency-us",
        "20",
    ];
    let json = |zero: &str| -> serde_json::Value {
        let out = ok(&cat(&[&base, MLP, &["--zero", zero, "--json"]]));
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["memory"].clone()
    };
    let (m2, m3) = (json("2"), json("3"));
    assert!(m2["gather_wait_ms"].is_null(), "{m2}");
    let waited = m3["gather_wait_ms"].as_f64().unwrap();
    assert!(waited >= 0.148, "{m3}");
    let text = ok(&cat(&[&base, &MLP[..MLP.len() - 1], &["--zero", "3"]]));
    let line = text.lines().find(|l| l.starts_with("memory per rank")).expect(&text);
    assert!(line.contains("ms a step for the gathers"), "{line}");
}

/// The units a ZeRO-3 step of `model` gathered for its forward, rank by rank, from its profile.
fn forward_gathers(tag: &str, model: &[&str]) -> Vec<Vec<String>> {
    let d = dir(tag);
    let p = d.join("profile.json");
    let base = [
        "train",
        "--world-size",
        "2",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--zero",
        "3",
    ];
    ok(&cat(&[&base, model, &["--threads-per-rank", "1", "--profile", s(&p)]]));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r["gathers"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|g| g["phase"] == "forward")
                .map(|g| g["unit"].as_str().unwrap().to_string())
                .collect()
        })
        .collect()
}

#[test]
fn a_forward_gathers_each_unit_once_the_loss_running_in_the_last_ones_gather() {
    // the loss runs in the last unit's scope while its parameters are still gathered: it is
    // not entered, gathered and freed a second time
    for rank in forward_gathers("zero3-gathers-mlp", MLP) {
        assert_eq!(rank, ["layers.0", "layers.1", "layers.2"]);
    }
    for rank in forward_gathers("zero3-gathers-gpt", GPT) {
        assert_eq!(rank, ["embed", "blocks.0", "blocks.1", "head"]);
    }
}

/// The memory line of a 2-step ZeRO-3 run of `model` on `world` ranks.
fn zero_3_memory_line(model: &[&str], world: &str) -> String {
    let base = [
        "train",
        "--world-size",
        world,
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--zero",
        "3",
    ];
    let text = ok(&cat(&[&base, &model[..model.len() - 1], &["--threads-per-rank", "1"]]));
    let line = text.lines().find(|l| l.starts_with("memory per rank")).expect(&text);
    line.to_string()
}

#[test]
fn the_memory_line_says_when_the_gathered_units_outweigh_what_the_shards_save() {
    // the small MLP's units are most of it (layers.1 alone is 61% of its 1,732 parameters): at
    // 2 ranks the shards save 3,464 bytes, and two units gathered at once hold more
    let mlp = zero_3_memory_line(MLP, "2");
    assert!(
        mlp.contains("cost more than sharding the parameters saves") && mlp.contains("ZeRO-2 may peak lower"),
        "{mlp}"
    );
    // the GPT's units are each a small part of it: at 4 ranks the shards save three quarters
    let gpt = zero_3_memory_line(GPT, "4");
    assert!(
        gpt.contains("gathered") && !gpt.contains("ZeRO-2 may peak lower"),
        "{gpt}"
    );
}

#[test]
fn a_zero_3_checkpoint_loads_with_init_and_samples() {
    let d = dir("zero3-checkpoint");
    let ck = d.join("gpt.ckpt");
    ok(&cat(&[
        &[
            "train",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--threads-per-rank",
            "1",
            "--zero",
            "3",
        ],
        GPT,
        &["--checkpoint", s(&ck)],
    ]));
    let out = ok(&[
        "sample",
        "--checkpoint",
        s(&ck),
        "--prompt",
        "ab",
        "--max-new-tokens",
        "4",
    ]);
    assert!(!out.trim().is_empty(), "{out}");
    let (l, _) = train(&d, "init", GPT, &["--world-size", "2", "--zero", "3", "--init", s(&ck)]);
    assert_eq!(l.len(), 3);
}

#[test]
fn zero_3_with_a_compressing_hook_is_one_error_line() {
    let e = fails(&cat(&[
        &[
            "train",
            "--world-size",
            "2",
            "--batch-size",
            "2",
            "--zero",
            "3",
            "--comm-hook",
            "fp16",
        ],
        MLP,
    ]));
    assert!(e.contains("--zero 3") && e.contains("--comm-hook fp16"), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");
}

/// `(parameters of the whole model in bytes, measured peak in bytes)` of a 2-step world-4 GPT
/// run of `layers` blocks under `--memory-budget 10` with `extra` flags.
fn budget_run(layers: &str, extra: &[&str]) -> (f64, f64) {
    let out = ok(&cat(&[&budget_args(layers), extra, &["--json"]]));
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let m = &json["memory"];
    let mut params = m["parameter_bytes"].as_f64().unwrap();
    if m["zero"] == 3 {
        params *= 4.0; // the rank's shard
    }
    (params, m["peak_bytes"].as_f64().unwrap())
}

fn budget_args(layers: &str) -> Vec<&str> {
    vec![
        "train",
        "--model",
        "gpt",
        "--d-model",
        "64",
        "--d-ff",
        "256",
        "--context",
        "32",
        "--heads",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "2",
        "--world-size",
        "4",
        "--memory-budget",
        "10",
        "--layers",
        layers,
    ]
}

#[test]
fn zero3_with_checkpointing_trains_three_times_the_gpt_plain_ddp_fits_in_the_same_budget() {
    let budget = 10.0 * 1024.0 * 1024.0;
    // plain DDP at world 4 in 10 MB a rank: 4 blocks fit, 5 are refused
    let (ddp_params, _) = budget_run("4", &[]);
    let e = fails(&budget_args("5"));
    assert!(e.contains("--memory-budget 10 MB") && e.contains("predicted"), "{e}");
    // 14 blocks, over 3x the parameters: ZeRO-3 with every block checkpointed trains it, its
    // measured peak under the budget
    let (params, peak) = budget_run("14", &["--zero", "3", "--activation-checkpointing"]);
    assert!(params >= 3.0 * ddp_params, "{params} against {ddp_params}");
    assert!(peak < budget, "measured peak {peak} over the budget {budget}");
    // and neither alone fits it, nor ZeRO-2 with checkpointing
    for extra in [
        &["--activation-checkpointing"][..],
        &["--zero", "2", "--activation-checkpointing"],
        &["--zero", "3"],
    ] {
        let e = fails(&cat(&[&budget_args("14"), extra]));
        assert!(
            e.contains("--memory-budget 10 MB: this run is predicted"),
            "{extra:?}: {e}"
        );
    }
}

/// `path` copied to `to` with the last element of its f32 tensor `name` made NaN.
fn with_a_nan(path: &Path, name: &str, to: &Path) {
    let (stored, _) = brigade_models::stored_tensors(path).unwrap();
    let t = stored
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("{name}"));
    let at = t.offset as usize + 4 * (t.shape.iter().product::<usize>() - 1);
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(to, bytes).unwrap();
}

#[test]
fn a_nan_read_into_the_shards_names_the_policy_as_given_on_init_and_on_resume() {
    let d = dir("zero3-nan-name");
    let ck = d.join("run.ckpt");
    let spec = "zero3:qwz";
    fn run<'a>(spec: &'a str, more: &[&'a str]) -> Vec<&'a str> {
        let base = ["train", "--world-size", "2", "--threads-per-rank", "1"];
        cat(&[&base, MLP, &["--optimizer", "adamw", "--policy", spec], more])
    }
    ok(&run(spec, &["--steps", "2", "--checkpoint", s(&ck)]));
    // a parameter read by --init, an optimizer state read by --resume: each read by one rank
    // into its shard, so each stops the run with that rank's error
    let (bad_init, bad_resume) = (d.join("init.ckpt"), d.join("resume.ckpt"));
    with_a_nan(&ck, "model.layers.2.weight", &bad_init);
    with_a_nan(&ck, "optim.layers.2.weight.exp_avg_sq", &bad_resume);
    for (flag, file) in [("--init", &bad_init), ("--resume", &bad_resume)] {
        let e = fails(&run(spec, &["--steps", "3", flag, s(file)]));
        assert!(
            e.contains("NaN") && e.contains(&format!("policy '{spec}'")),
            "{flag}: {e}"
        );
    }
}
