//! The GPT with activation checkpointing: the same gradients bit for bit, with dropout on, for
//! every block and every N-th, over steps that accumulate.

use brigade_models::{Batch, Gpt, GptConfig, Mlp, MlpConfig, Model};
use brigade_tensor::{Rng, Tensor};

fn cfg() -> GptConfig {
    GptConfig {
        vocab: 11,
        d_model: 8,
        n_layers: 4,
        n_heads: 2,
        d_ff: 12,
        context: 6,
        dropout: 0.2,
        ..GptConfig::default()
    }
}

fn batch(seed: u64) -> Batch {
    let mut rng = Rng::new(seed);
    let ids: Vec<i64> = (0..3 * 6).map(|_| rng.below(11) as i64).collect();
    Batch::tokens(Tensor::from_vec(ids, &[3, 6]).unwrap())
}

/// Gradient bits after two backward passes (accumulating) on two batches, and the loss bits.
fn run(every: usize) -> (Vec<Vec<u32>>, Vec<u32>, u64) {
    let mut m = Gpt::new(cfg(), 5).unwrap();
    m.set_activation_checkpointing(every).unwrap();
    let mut losses = vec![];
    for s in 0..2 {
        let loss = m.loss(&batch(s)).unwrap();
        losses.push(loss.value().to_vec::<f32>().unwrap()[0].to_bits());
        loss.backward().unwrap();
    }
    let grads = m
        .params()
        .params()
        .iter()
        .map(|p| {
            p.grad()
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect();
    (grads, losses, m.rng_state().unwrap().offset)
}

#[test]
fn checkpointed_blocks_give_the_gradients_of_the_plain_gpt_bit_for_bit_with_dropout() {
    let plain = run(0);
    for every in [1, 2, 3] {
        let ck = run(every);
        assert_eq!(ck.1, plain.1, "losses, every {every}");
        assert_eq!(ck.2, plain.2, "dropout masks drawn, every {every}");
        assert!(
            ck.0 == plain.0,
            "gradients differ with every {every}-th block checkpointed"
        );
    }
}

#[test]
fn a_model_without_blocks_refuses_checkpointing_in_one_line() {
    let mut m = Mlp::new(MlpConfig::new(vec![4, 3, 2]), 1).unwrap();
    m.set_activation_checkpointing(0).unwrap();
    let e = m.set_activation_checkpointing(1).unwrap_err().to_string();
    assert!(e.contains("no blocks to checkpoint") && !e.contains('\n'), "{e}");
}
