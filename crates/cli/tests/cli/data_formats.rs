//! `brigade train --data` reads what the library reads: safetensors, NumPy `.npz` (one array
//! per tensor, by name) and `.npy` (one array: the GPT's tokens), told apart by the file's
//! first bytes (then its extension); a file of none of them is one error line.

use brigade_models::{load_safetensors, save_npy, save_npz};
use brigade_tensor::Tensor;

use crate::common::{cat, dir, fails, mlp_data, ok, s, GPT, MLP};

/// The last stdout line of a `--json` run, parsed.
fn summary(out: &str) -> serde_json::Value {
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

#[test]
fn npz_and_npy_data_train_as_the_same_rows_in_safetensors_do() {
    let d = dir("data-npz");
    let st = mlp_data(&d, None);
    let npz = d.join("data.npz");
    save_npz(&npz, &load_safetensors(&st).unwrap()).unwrap();
    let base = cat(&[&["train"], MLP, &["--steps", "2", "--batch-size", "8", "--json"]]);
    let from_st = summary(&ok(&cat(&[&base, &["--data", s(&st)]])));
    let from_npz = summary(&ok(&cat(&[&base, &["--data", s(&npz)]])));
    assert_eq!(from_npz["first_loss"], from_st["first_loss"]);
    assert_eq!(from_npz["last_loss"], from_st["last_loss"]);
    // the first bytes decide: an .npz under another name is still read as one
    let renamed = d.join("data-npz.bin");
    std::fs::copy(&npz, &renamed).unwrap();
    let from_renamed = summary(&ok(&cat(&[&base, &["--data", s(&renamed)]])));
    assert_eq!(from_renamed["last_loss"], from_st["last_loss"]);
    // the GPT's tokens in one .npy: 16 rows of context 16 + 1
    let tokens: Vec<i64> = (0..16 * 17).map(|i| (i * 7 % 64) as i64).collect();
    let npy = d.join("tokens.npy");
    save_npy(&npy, &Tensor::from_vec(tokens, &[16, 17]).unwrap()).unwrap();
    ok(&cat(&[
        &["train"],
        GPT,
        &["--steps", "1", "--batch-size", "4", "--data", s(&npy)],
    ]));
    // one .npy for the MLP's two tensors: one line naming the way out
    let one = d.join("inputs.npy");
    save_npy(&one, &Tensor::from_vec(vec![0f32; 32], &[2, 16]).unwrap()).unwrap();
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--data", s(&one)]]));
    assert!(e.contains(".npz") && !e.contains("HeaderTooLarge"), "{e}");
    // a text file named .npz is refused in one line
    let bad = d.join("bad.npz");
    std::fs::write(&bad, "not numpy\n").unwrap();
    let e = fails(&cat(&[&["train"], MLP, &["--steps", "1", "--data", s(&bad)]]));
    assert!(!e.contains("HeaderTooLarge"), "{e}");
}
