//! `brigade train --activation-checkpointing [N]`: the same run bit for bit with the GPT's
//! blocks checkpointed, recorded in `--json`; bad values and models refused in one line.

use super::common::{cat, dir, fails, ok, s, GPT};

/// The saved parameters' bytes.
fn params(path: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    brigade_models::load_safetensors(path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                t.to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn checkpointed_blocks_train_the_same_gpt_bit_for_bit_and_json_says_so() {
    let d = dir("activation-checkpointing");
    let base = cat(&[
        &["train"],
        GPT,
        &[
            "--world-size",
            "2",
            "--batch-size",
            "4",
            "--steps",
            "3",
            "--dropout",
            "0.3",
            "--json",
        ],
    ]);
    let (mut saved, mut memory) = (vec![], vec![]);
    for (i, extra) in [
        &[][..],
        &["--activation-checkpointing"],
        &["--activation-checkpointing", "2"],
    ]
    .into_iter()
    .enumerate()
    {
        let path = d.join(format!("p{i}.st"));
        let out = ok(&cat(&[&base, extra, &["--save", s(&path)]]));
        let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(json["flags"]["activation_checkpointing"], [0, 1, 2][i], "{out}");
        saved.push(params(&path));
        let m = &json["memory"];
        memory.push((
            m["activation_bytes"].as_u64().unwrap(),
            m["peak_bytes"].as_u64().unwrap(),
        ));
        assert_eq!(m["activation_checkpointing"], [0, 1, 2][i], "{out}");
    }
    // measured: checkpointing every block holds fewer activation bytes, and a lower peak
    assert!(memory[1].0 < memory[0].0 && memory[1].1 < memory[0].1, "{memory:?}");
    assert!(memory[2].0 < memory[0].0, "{memory:?}");
    assert!(saved[1] == saved[0], "every block checkpointed: the parameters differ");
    assert!(
        saved[2] == saved[0],
        "every 2nd block checkpointed: the parameters differ"
    );
}

#[test]
fn the_memory_line_shows_the_measured_activations_and_peak() {
    let out = ok(&cat(&[
        &["train"],
        GPT,
        &["--steps", "1", "--activation-checkpointing"],
    ]));
    let line = out
        .lines()
        .find(|l| l.starts_with("memory per rank"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("activations ") && line.contains("(every block checkpointed)") && line.contains("peak "),
        "{line}"
    );
}

#[test]
fn activation_checkpointing_refuses_a_zero_and_the_mlp_in_one_line() {
    let e = fails(&cat(&[&["train"], GPT, &["--activation-checkpointing", "0"]]));
    assert!(e.contains("positive number of blocks"), "{e}");
    let e = fails(&["train", "--model", "mlp", "--activation-checkpointing"]);
    assert!(e.contains("needs --model gpt"), "{e}");
}

/// `(measured peak, predicted peak)` of a 2-step GPT run with `extra` flags.
fn peaks(extra: &[&str]) -> (f64, f64) {
    let base = [
        "train",
        "--model",
        "gpt",
        "--d-model",
        "64",
        "--d-ff",
        "256",
        "--context",
        "32",
        "--layers",
        "3",
        "--heads",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "2",
        "--json",
    ];
    let out = ok(&cat(&[&base, extra]));
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let m = &json["memory"];
    (
        m["peak_bytes"].as_f64().unwrap(),
        m["predicted_peak_bytes"].as_f64().unwrap(),
    )
}

#[test]
fn the_predicted_peak_meets_the_measured_one_within_ten_percent() {
    for world in ["1", "2"] {
        for zero in ["0", "1", "2"] {
            for ck in [
                &[][..],
                &["--activation-checkpointing"],
                &["--activation-checkpointing", "2"],
            ] {
                let (measured, predicted) = peaks(&cat(&[&["--world-size", world, "--zero", zero], ck]));
                let err = predicted / measured - 1.0;
                assert!(
                    err.abs() < 0.10,
                    "world {world} zero {zero} {ck:?}: predicted {predicted} against measured {measured} ({:+.1}%)",
                    100.0 * err
                );
            }
        }
    }
    // ZeRO-3: the parameters' shard and the units gathered at once (measured as they are
    // gathered and freed)
    for world in ["2", "4"] {
        for ck in [&[][..], &["--activation-checkpointing"]] {
            let (measured, predicted) = peaks(&cat(&[&["--world-size", world, "--zero", "3"], ck]));
            let err = predicted / measured - 1.0;
            assert!(
                err.abs() < 0.10,
                "world {world} zero 3 {ck:?}: predicted {predicted} against measured {measured} ({:+.1}%)",
                100.0 * err
            );
        }
    }
    // with dropout the masks count too
    let (measured, predicted) = peaks(&["--dropout", "0.1"]);
    assert!(
        (predicted / measured - 1.0).abs() < 0.10,
        "dropout: {predicted} against {measured}"
    );
}

#[test]
fn a_memory_budget_refuses_a_run_predicted_past_it_in_one_line_naming_the_fix() {
    let base = cat(&[&["train"], GPT, &["--batch-size", "16", "--steps", "1"]]);
    let (_, predicted) = peaks(&[]);
    assert!(predicted > 0.0);
    // the GPT of GPT and 16 rows: activations lead; checkpointing is the first fix named
    let e = fails(&cat(&[&base, &["--memory-budget", "2"]]));
    assert!(
        e.contains("the largest part activations") && e.contains("--activation-checkpointing would bring it to"),
        "{e}"
    );
    // and the fix it names runs under the same budget
    let with_fix = cat(&[&base, &["--memory-budget", "2", "--activation-checkpointing"]]);
    let out = ok(&cat(&[&with_fix, &["--json"]]));
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(
        json["memory"]["peak_bytes"].as_f64().unwrap() < 2.0 * 1024.0 * 1024.0,
        "{out}"
    );
    // too small for anything: says so
    let e = fails(&cat(&[&base, &["--memory-budget", "0.01"]]));
    assert!(
        e.contains("the largest part") && e.contains("a smaller model or more ranks"),
        "{e}"
    );
    for bad in ["0", "-3", "NaN"] {
        let e = fails(&cat(&[&base, &["--memory-budget", bad]]));
        assert!(e.contains("--memory-budget must be a positive number"), "{e}");
    }
}
