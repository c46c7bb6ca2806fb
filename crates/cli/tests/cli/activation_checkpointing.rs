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
    let mut saved = vec![];
    for (i, extra) in [&[][..], &["--activation-checkpointing"], &["--activation-checkpointing", "2"]]
        .into_iter()
        .enumerate()
    {
        let path = d.join(format!("p{i}.st"));
        let out = ok(&cat(&[&base, extra, &["--save", s(&path)]]));
        let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(json["flags"]["activation_checkpointing"], [0, 1, 2][i], "{out}");
        saved.push(params(&path));
    }
    assert!(saved[1] == saved[0], "every block checkpointed: the parameters differ");
    assert!(saved[2] == saved[0], "every 2nd block checkpointed: the parameters differ");
}

#[test]
fn activation_checkpointing_refuses_a_zero_and_the_mlp_in_one_line() {
    let e = fails(&cat(&[&["train"], GPT, &["--activation-checkpointing", "0"]]));
    assert!(e.contains("positive number of blocks"), "{e}");
    let e = fails(&["train", "--model", "mlp", "--activation-checkpointing"]);
    assert!(e.contains("needs --model gpt"), "{e}");
}
