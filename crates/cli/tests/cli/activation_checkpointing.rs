//! `brigade train --activation-checkpointing [N]`: the same run bit for bit with the GPT's
//! blocks checkpointed, recorded in `--json`; bad values and models refused in one line.

use super::common::{cat, dir, fails, ok, s, GPT};

/// The saved parameters' bytes.
fn params(path: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    brigade_models::load_safetensors(path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_vec::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect()
}

#[test]
fn checkpointed_blocks_train_the_same_gpt_bit_for_bit_and_json_says_so() {
    let d = dir("activation-checkpointing");
    let base = cat(&[
        &["train"],
        GPT,
        &["--world-size", "2", "--batch-size", "4", "--steps", "3", "--dropout", "0.3", "--json"],
    ]);
    let (mut saved, mut memory) = (vec![], vec![]);
    for (i, extra) in [&[][..], &["--activation-checkpointing"], &["--activation-checkpointing", "2"]]
        .into_iter()
        .enumerate()
    {
        let path = d.join(format!("p{i}.st"));
        let out = ok(&cat(&[&base, extra, &["--save", s(&path)]]));
        let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(json["flags"]["activation_checkpointing"], [0, 1, 2][i], "{out}");
        saved.push(params(&path));
        let m = &json["memory"];
        memory.push((m["activation_bytes"].as_u64().unwrap(), m["peak_bytes"].as_u64().unwrap()));
        assert_eq!(m["activation_checkpointing"], [0, 1, 2][i], "{out}");
    }
    // measured: checkpointing every block holds fewer activation bytes, and a lower peak
    assert!(memory[1].0 < memory[0].0 && memory[1].1 < memory[0].1, "{memory:?}");
    assert!(memory[2].0 < memory[0].0, "{memory:?}");
    assert!(saved[1] == saved[0], "every block checkpointed: the parameters differ");
    assert!(saved[2] == saved[0], "every 2nd block checkpointed: the parameters differ");
}

#[test]
fn the_memory_line_shows_the_measured_activations_and_peak() {
    let out = ok(&cat(&[&["train"], GPT, &["--steps", "1", "--activation-checkpointing"]]));
    let line = out.lines().find(|l| l.starts_with("memory per rank")).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("activations ") && line.contains("(every block checkpointed)") && line.contains("peak "), "{line}");
}

#[test]
fn activation_checkpointing_refuses_a_zero_and_the_mlp_in_one_line() {
    let e = fails(&cat(&[&["train"], GPT, &["--activation-checkpointing", "0"]]));
    assert!(e.contains("positive number of blocks"), "{e}");
    let e = fails(&["train", "--model", "mlp", "--activation-checkpointing"]);
    assert!(e.contains("needs --model gpt"), "{e}");
}
