//! `ParamSet::set_grads_to_none` (PyTorch's `zero_grad(set_to_none=True)`) trains exactly as
//! `zero_grad`: the first gradient kept as the op produced it instead of added to zeros.

use brigade_autograd::{AdamW, Optimizer};
use brigade_models::{Batch, Gpt, GptConfig, Model};
use brigade_tensor::Tensor;

fn train(to_none: bool) -> (Vec<u32>, Vec<Vec<u32>>) {
    let cfg = GptConfig {
        d_model: 16,
        n_layers: 1,
        n_heads: 2,
        d_ff: 24,
        context: 8,
        ..GptConfig::default()
    };
    let g = Gpt::new(cfg, 4).unwrap();
    let tokens: Vec<i64> = (0..3 * 9).map(|i| (i * 29 % 256) as i64).collect();
    let batch = Batch::tokens(Tensor::from_vec(tokens, &[3, 9]).unwrap());
    let mut opt = AdamW::with_options(g.params().params().to_vec(), 1e-2, (0.9, 0.999), 1e-8, 0.01);
    let losses = (0..3)
        .map(|_| {
            if to_none {
                g.params().set_grads_to_none().unwrap();
            } else {
                g.params().zero_grad().unwrap();
            }
            let loss = g.loss(&batch).unwrap();
            let v = loss.value().item().unwrap() as f32;
            loss.backward().unwrap();
            opt.step().unwrap();
            v.to_bits()
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
fn set_grads_to_none_trains_the_gpt_bit_for_bit_as_zero_grad() {
    let (none, zeroed) = (train(true), train(false));
    assert_eq!(none.0, zeroed.0, "losses");
    assert!(none.1 == zeroed.1, "parameters differ after three steps");
}
