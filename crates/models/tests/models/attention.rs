//! The fused attention op against the attention composed of primitive ops it replaced
//! (`CausalSelfAttention::forward_reference`): a GPT trained with either gives the same
//! losses and the same parameters, bit for bit, also with a context long enough for the
//! fused kernel to split the queries into blocks that skip the masked keys.

use brigade_autograd::{Optimizer, Sgd};
use brigade_models::nn::with_reference_attention;
use brigade_models::{Batch, Gpt, GptConfig, Model};
use brigade_tensor::Tensor;

/// Three SGD steps on `rows` sequences; returns the loss bits and every parameter's bits
/// afterwards.
fn train(cfg: &GptConfig, rows: usize, reference: bool) -> (Vec<u32>, Vec<Vec<u32>>) {
    let g = Gpt::new(cfg.clone(), 11).unwrap();
    let n = rows * (cfg.context + 1);
    let tokens: Vec<i64> = (0..n).map(|i| (i * 53 % 256) as i64).collect();
    let batch = Batch::tokens(Tensor::from_vec(tokens, &[rows, cfg.context + 1]).unwrap());
    let mut opt = Sgd::new(g.params().params().to_vec(), 0.1, 0.9, 0.0);
    let mut step = || {
        g.params().zero_grad().unwrap();
        let loss = g.loss(&batch).unwrap();
        let v = loss.value().item().unwrap() as f32;
        loss.backward().unwrap();
        opt.step().unwrap();
        v.to_bits()
    };
    let losses = (0..3)
        .map(|_| {
            if reference {
                with_reference_attention(&mut step)
            } else {
                step()
            }
        })
        .collect();
    let params = g
        .params()
        .params()
        .iter()
        .map(|p| {
            p.value()
                .to_vec::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        })
        .collect();
    (losses, params)
}

#[test]
fn fused_attention_trains_the_gpt_bit_for_bit_as_the_composed_ops() {
    let cfg = GptConfig {
        d_model: 24,
        n_layers: 2,
        n_heads: 3,
        d_ff: 40,
        context: 9,
        ..GptConfig::default()
    };
    let (fused, reference) = (train(&cfg, 4, false), train(&cfg, 4, true));
    assert_eq!(fused.0, reference.0, "losses");
    assert!(fused.1 == reference.1, "parameters differ after three steps");
}

#[test]
fn fused_attention_with_query_blocks_trains_bit_for_bit_as_the_composed_ops() {
    // 100 positions: the fused kernel takes three blocks of queries (33, 33, 34 rows), each
    // against only the keys up to its last row.
    let cfg = GptConfig {
        d_model: 32,
        n_layers: 1,
        n_heads: 2,
        d_ff: 32,
        context: 100,
        ..GptConfig::default()
    };
    let (fused, reference) = (train(&cfg, 2, false), train(&cfg, 2, true));
    assert_eq!(fused.0, reference.0, "losses");
    assert!(fused.1 == reference.1, "parameters differ after three steps");
}
