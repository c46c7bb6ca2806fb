//! Learnability and determinism: the models really train on the built-in data, and a
//! seed fixes every bit of the loss curve.

use std::time::Instant;

use brigade_autograd::{AdamW, Optimizer};
use brigade_models::{Dataset, Gpt, GptConfig, Mlp, MlpConfig, Model};

/// `steps` AdamW steps over consecutive batches; the loss of each step.
fn train(model: &dyn Model, data: &Dataset, batch: usize, steps: usize, lr: f64) -> Vec<f32> {
    let mut opt = AdamW::with_options(model.params().params().to_vec(), lr, (0.9, 0.999), 1e-8, 0.0);
    (0..steps)
        .map(|s| {
            model.params().zero_grad().unwrap();
            let loss = model.loss(&data.batch(s * batch, batch).unwrap()).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            loss.value().item().unwrap() as f32
        })
        .collect()
}

fn mean(v: &[f32]) -> f32 {
    v.iter().sum::<f32>() / v.len() as f32
}

fn small_mlp() -> MlpConfig {
    MlpConfig::new(vec![32, 64, 64, 64, 4])
}

fn tiny_gpt() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 32,
        n_layers: 2,
        n_heads: 2,
        d_ff: 128,
        context: 32,
        ..GptConfig::default()
    }
}

#[test]
fn mlp_fits_teacher_labels() {
    let t0 = Instant::now();
    let data = Dataset::teacher(4096, 32, 4, 11).unwrap();
    let model = Mlp::new(small_mlp(), 1).unwrap();
    let losses = train(&model, &data, 64, 300, 3e-3);
    let (first, last) = (losses[0], mean(&losses[losses.len() - 20..]));
    eprintln!("mlp: loss {first:.4} -> {last:.4} in {:?}", t0.elapsed());
    assert!(last < 0.5 * first, "mlp loss fell only from {first} to {last}");
}

#[test]
fn gpt_learns_builtin_text_well_below_uniform() {
    let t0 = Instant::now();
    let cfg = tiny_gpt();
    let data = Dataset::builtin_text(cfg.context, 5).unwrap();
    let model = Gpt::new(cfg, 2).unwrap();
    let losses = train(&model, &data, 16, 300, 3e-3);
    let (first, last) = (losses[0], mean(&losses[losses.len() - 20..]));
    eprintln!("gpt: loss {first:.4} -> {last:.4} in {:?}", t0.elapsed());
    // Untrained, the loss sits near ln(256) = 5.55: every byte equally likely.
    assert!(
        (first - 256f32.ln()).abs() < 0.3,
        "initial loss {first} should be near ln(256)"
    );
    assert!(last < 2.5, "gpt loss fell only from {first} to {last}");
}

#[test]
fn same_seed_gives_the_same_loss_curve_bit_for_bit() {
    let data = Dataset::teacher(512, 32, 4, 3).unwrap();
    let run = |seed| train(&Mlp::new(small_mlp(), seed).unwrap(), &data, 32, 20, 3e-3);
    let (a, b) = (run(9), run(9));
    assert_eq!(
        a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_ne!(a, run(10), "a different seed should give a different curve");

    let text = Dataset::builtin_text(tiny_gpt().context, 1).unwrap();
    let run = |seed| train(&Gpt::new(tiny_gpt(), seed).unwrap(), &text, 4, 5, 3e-3);
    let (a, b) = (run(4), run(4));
    assert_eq!(
        a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_ne!(a, run(5));
}
