//! The reference MLP and GPT, rebuilt from the `nn` layers, train exactly as the hand-written
//! models they replaced: the pinned losses below were printed by the previous implementation
//! (commit 276579e) with this same code, bit for bit. The MLP's third loss was re-pinned when
//! GEMM moved to the `gemm` crate's AVX-512 kernels (`x86-v4`), which sum in another order;
//! the f64 finite-difference tests did not move.

use brigade_autograd::{Optimizer, Sgd};
use brigade_models::{Batch, Gpt, GptConfig, Mlp, MlpConfig, Model};
use brigade_tensor::{DType, Rng, Tensor};

fn train(model: &dyn Model, batch: &Batch) -> Vec<u64> {
    let mut opt = Sgd::new(model.params().params().to_vec(), 0.05, 0.9, 0.0);
    (0..3)
        .map(|_| {
            model.params().zero_grad().unwrap();
            let loss = model.loss(batch).unwrap();
            let v = loss.value().item().unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            v.to_bits()
        })
        .collect()
}

fn mlp_losses() -> Vec<u64> {
    let m = Mlp::new(MlpConfig::new(vec![16, 32, 24, 5]), 3).unwrap();
    let mut rng = Rng::new(1);
    let x = Tensor::randn(&[8, 16], 1.0, DType::F32, &mut rng);
    let y = Tensor::from_vec((0..8).map(|i| (i % 5) as i64).collect::<Vec<_>>(), &[8]).unwrap();
    train(&m, &Batch::classify(x, y))
}

fn gpt_losses() -> Vec<u64> {
    let cfg = GptConfig {
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        d_ff: 64,
        context: 12,
        ..GptConfig::default()
    };
    let g = Gpt::new(cfg, 5).unwrap();
    let tokens: Vec<i64> = (0..3 * 13).map(|i| (i * 37 % 256) as i64).collect();
    train(&g, &Batch::tokens(Tensor::from_vec(tokens, &[3, 13]).unwrap()))
}

#[test]
fn the_mlp_from_layers_trains_bit_for_bit_as_before() {
    // The gemm crate picks its kernels at run time: AVX-512 where the CPU has it (the pin
    // re-taken then), AVX2 elsewhere (the previous implementation's own pin).
    #[cfg(target_arch = "x86_64")]
    let third = if std::arch::is_x86_feature_detected!("avx512f") {
        4609919370603266048
    } else {
        4609919370066395136
    };
    #[cfg(not(target_arch = "x86_64"))]
    let third = 4609919370066395136;
    assert_eq!(mlp_losses(), [4610025053642293248, 4609987518312480768, third]);
}

#[test]
fn the_gpt_from_layers_trains_bit_for_bit_as_before() {
    assert_eq!(
        gpt_losses(),
        [4617935092226981888, 4617803804740419584, 4617678000316481536]
    );
}
