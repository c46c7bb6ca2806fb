//! The reference MLP and GPT, rebuilt from the `nn` layers, train as the hand-written models
//! they replaced: the recorded losses below were printed by the previous implementation with
//! this same code, on a CPU whose GEMM ran its AVX2 kernels.
//!
//! Another CPU's GEMM sums in another order (the `gemm` crate picks AVX-512, AVX2 or NEON
//! kernels at run time), so each loss is compared within [`TOL`] of the recorded one, relative:
//! AVX-512 kernels moved the MLP's third loss by 7.4e-8 and none of the GPT's. What is exact is
//! what one run can compare with itself: the same model trained twice gives the same bits.

use brigade_autograd::{Optimizer, Sgd};
use brigade_models::{Batch, Gpt, GptConfig, Mlp, MlpConfig, Model};
use brigade_tensor::{DType, Rng, Tensor};

fn train(model: &dyn Model, batch: &Batch) -> Vec<f64> {
    let mut opt = Sgd::new(model.params().params().to_vec(), 0.05, 0.9, 0.0);
    (0..3)
        .map(|_| {
            model.params().zero_grad().unwrap();
            let loss = model.loss(batch).unwrap();
            let v = loss.value().item().unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            v
        })
        .collect()
}

fn mlp_losses() -> Vec<f64> {
    let m = Mlp::new(MlpConfig::new(vec![16, 32, 24, 5]), 3).unwrap();
    let mut rng = Rng::new(1);
    let x = Tensor::randn(&[8, 16], 1.0, DType::F32, &mut rng);
    let y = Tensor::from_vec((0..8).map(|i| (i % 5) as i64).collect::<Vec<_>>(), &[8]).unwrap();
    train(&m, &Batch::classify(x, y))
}

fn gpt_losses() -> Vec<f64> {
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

/// Relative distance allowed from a recorded loss: ten times what another kernel's summation
/// order was seen to move one; a change to a layer's arithmetic moves these losses by far more.
const TOL: f64 = 1e-6;

fn assert_as_recorded(what: &str, got: &[f64], recorded: [f64; 3]) {
    for (step, (g, r)) in got.iter().zip(recorded).enumerate() {
        let rel = (g - r).abs() / r.abs();
        assert!(
            rel <= TOL,
            "{what} step {step}: loss {g} is {rel:.1e} from the recorded {r} (tolerance {TOL:.0e})"
        );
    }
    assert_eq!(got.len(), 3);
}

#[test]
fn the_mlp_from_layers_trains_as_the_hand_written_one_did() {
    let losses = mlp_losses();
    assert_as_recorded(
        "mlp",
        &losses,
        [1.6311917304992676, 1.6228572130203247, 1.6077252626419067],
    );
    assert_eq!(mlp_losses(), losses, "the same run twice");
}

#[test]
fn the_gpt_from_layers_trains_as_the_hand_written_one_did() {
    let losses = gpt_losses();
    assert_as_recorded(
        "gpt",
        &losses,
        [5.550292491912842, 5.433685779571533, 5.321949005126953],
    );
    assert_eq!(gpt_losses(), losses, "the same run twice");
}
