//! The models' structure: reference parameter names, shapes and counts, causality,
//! per-layer scopes, input errors, and finite-difference gradient checks in f64.

use std::sync::{Arc, Mutex};

use brigade_autograd::{no_grad, GradReady, GradSubscriber, SubscriberError};
use brigade_models::{load_params_from_tensors, Batch, Gpt, GptConfig, Mlp, MlpConfig, Model, ModelError, ModelKind};
use brigade_tensor::{DType, Rng, Tensor};

fn names_and_shapes(m: &dyn Model) -> Vec<(String, Vec<usize>)> {
    m.params()
        .named_values()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec()))
        .collect()
}

#[test]
fn reference_mlp_has_pytorch_names_shapes_and_count() {
    let m = Mlp::new(MlpConfig::default(), 0).unwrap();
    let want: Vec<(String, Vec<usize>)> = [(512, 2048), (2048, 2048), (2048, 2048), (2048, 10)]
        .iter()
        .enumerate()
        .flat_map(|(i, &(inp, out))| {
            [
                (format!("layers.{i}.weight"), vec![out, inp]),
                (format!("layers.{i}.bias"), vec![out]),
            ]
        })
        .collect();
    assert_eq!(names_and_shapes(&m), want);
    assert_eq!(
        m.params().numel(),
        512 * 2048 + 2048 + 2 * (2048 * 2048 + 2048) + 2048 * 10 + 10
    );
    assert_eq!(m.params().numel(), 9_463_818);
    assert_eq!(m.layer_names(), ["layers.0", "layers.1", "layers.2", "layers.3"]);
    // PyTorch's nn.Linear init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias
    let w0 = m
        .params()
        .get("layers.0.weight")
        .unwrap()
        .value()
        .to_vec::<f32>()
        .unwrap();
    let b3 = m
        .params()
        .get("layers.3.bias")
        .unwrap()
        .value()
        .to_vec::<f32>()
        .unwrap();
    let (bound0, bound3) = (1.0 / 512f32.sqrt(), 1.0 / 2048f32.sqrt());
    assert!(w0.iter().all(|x| x.abs() <= bound0) && w0.iter().any(|x| x.abs() > 0.9 * bound0));
    assert!(b3.iter().all(|x| x.abs() <= bound3) && b3.iter().any(|&x| x != 0.0));
}

#[test]
fn reference_gpt_has_the_documented_names_shapes_and_count() {
    let cfg = GptConfig::default();
    assert_eq!(
        (cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.context),
        (256, 256, 4, 4, 1024, 128)
    );
    let m = Gpt::new(cfg, 0).unwrap();
    let (v, d, f, c) = (256, 256, 1024, 128);
    let mut want: Vec<(String, Vec<usize>)> = vec![
        ("tok_emb.weight".into(), vec![v, d]),
        ("pos_emb.weight".into(), vec![c, d]),
    ];
    for i in 0..4 {
        let p = format!("blocks.{i}");
        for (n, s) in [
            ("ln1.weight", vec![d]),
            ("ln1.bias", vec![d]),
            ("attn.qkv.weight", vec![3 * d, d]),
            ("attn.qkv.bias", vec![3 * d]),
            ("attn.proj.weight", vec![d, d]),
            ("attn.proj.bias", vec![d]),
            ("ln2.weight", vec![d]),
            ("ln2.bias", vec![d]),
            ("mlp.fc.weight", vec![f, d]),
            ("mlp.fc.bias", vec![f]),
            ("mlp.proj.weight", vec![d, f]),
            ("mlp.proj.bias", vec![d]),
        ] {
            want.push((format!("{p}.{n}"), s));
        }
    }
    want.extend([
        ("ln_f.weight".into(), vec![d]),
        ("ln_f.bias".into(), vec![d]),
        ("head.weight".into(), vec![v, d]),
    ]);
    assert_eq!(names_and_shapes(&m), want);
    // embeddings 256*256 + 128*256 = 98_304
    // per block: ln1 512 + qkv 3*256*256+768 = 197_376 + proj 65_536+256 = 65_792 + ln2 512
    //            + fc 1024*256+1024 = 263_168 + proj 256*1024+256 = 262_400  => 789_760
    // 4 blocks = 3_159_040; ln_f 512; head 256*256 = 65_536
    // total = 98_304 + 3_159_040 + 512 + 65_536 = 3_323_392
    assert_eq!(m.params().numel(), 3_323_392);
    assert_eq!(
        m.layer_names(),
        ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    );
    // GPT-2 init: N(0, 0.02) weights, zero biases, LayerNorm (1, 0)
    let w = m
        .params()
        .get("blocks.2.mlp.fc.weight")
        .unwrap()
        .value()
        .to_vec::<f32>()
        .unwrap();
    let std = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    assert!((std - 0.02).abs() < 0.001, "std {std}");
    let all = |n: &str, v: f32| {
        m.params()
            .get(n)
            .unwrap()
            .value()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .all(|&x| x == v)
    };
    assert!(all("blocks.1.attn.qkv.bias", 0.0) && all("blocks.0.ln2.weight", 1.0) && all("ln_f.bias", 0.0));
}

fn tiny_gpt(dtype: DType) -> GptConfig {
    GptConfig {
        vocab: 7,
        d_model: 8,
        n_layers: 2,
        n_heads: 2,
        d_ff: 12,
        context: 5,
        dtype,
        dropout: 0.0,
    }
}

fn random_tokens(shape: &[usize], vocab: u64, seed: u64) -> Vec<i64> {
    let mut rng = Rng::new(seed);
    (0..shape.iter().product::<usize>())
        .map(|_| rng.below(vocab) as i64)
        .collect()
}

#[test]
fn gpt_is_causal_a_future_token_changes_no_earlier_logit() {
    let cfg = GptConfig {
        vocab: 32,
        d_model: 16,
        n_layers: 2,
        n_heads: 4,
        d_ff: 32,
        context: 8,
        ..GptConfig::default()
    };
    let m = Gpt::new(cfg, 3).unwrap();
    let mut toks = random_tokens(&[2, 8], 32, 1);
    let before = m
        .logits(&Tensor::from_vec(toks.clone(), &[2, 8]).unwrap())
        .unwrap()
        .value()
        .to_vec::<f32>()
        .unwrap();
    // change position 5 of both rows
    for r in 0..2 {
        toks[r * 8 + 5] = (toks[r * 8 + 5] + 1) % 32;
    }
    let after = m
        .logits(&Tensor::from_vec(toks, &[2, 8]).unwrap())
        .unwrap()
        .value()
        .to_vec::<f32>()
        .unwrap();
    let at = |v: &[f32], r: usize, t: usize| v[(r * 8 + t) * 32..(r * 8 + t + 1) * 32].to_vec();
    for r in 0..2 {
        for t in 0..5 {
            assert_eq!(
                at(&before, r, t),
                at(&after, r, t),
                "row {r} position {t} saw the future"
            );
        }
        for t in 5..8 {
            assert_ne!(
                at(&before, r, t),
                at(&after, r, t),
                "row {r} position {t} should see position 5"
            );
        }
    }
}

#[test]
fn u8_and_i64_tokens_give_the_same_loss() {
    let m = Gpt::new(tiny_gpt(DType::F32), 1).unwrap();
    let ids = random_tokens(&[3, 6], 7, 2);
    let i64_loss = m
        .loss(&Batch::tokens(Tensor::from_vec(ids.clone(), &[3, 6]).unwrap()))
        .unwrap();
    let u8s: Vec<u8> = ids.iter().map(|&x| x as u8).collect();
    let u8_loss = m.loss(&Batch::tokens(Tensor::from_vec(u8s, &[3, 6]).unwrap())).unwrap();
    assert_eq!(i64_loss.value().item().unwrap(), u8_loss.value().item().unwrap());
}

#[test]
fn bad_inputs_are_clear_errors() {
    let gpt = Gpt::new(tiny_gpt(DType::F32), 1).unwrap();
    // context 5 reads at most 5 tokens: a row of 7 (6 inputs) is too long
    let long = Batch::tokens(Tensor::from_vec(vec![1i64; 14], &[2, 7]).unwrap());
    let e = gpt.loss(&long).unwrap_err();
    assert!(matches!(e, ModelError::ContextTooLong { found: 6, context: 5 }), "{e}");
    assert!(e.to_string().contains("context"), "{e}");
    let oov = Batch::tokens(Tensor::from_vec(vec![1i64, 2, 9], &[1, 3]).unwrap());
    assert!(gpt.loss(&oov).unwrap_err().to_string().contains("index 9"));

    let mlp = Mlp::new(MlpConfig::new(vec![4, 3]), 1).unwrap();
    let e = mlp.loss(&long).unwrap_err();
    assert!(matches!(e, ModelError::WrongBatch { model: "mlp", .. }), "{e}");
    let classify = Batch::classify(Tensor::zeros(&[2, 5], DType::F32), Tensor::zeros(&[2], DType::I64));
    assert!(mlp
        .loss(&classify)
        .unwrap_err()
        .to_string()
        .contains("expected [batch, 4]"));
    assert!(matches!(
        gpt.loss(&classify).unwrap_err(),
        ModelError::WrongBatch { model: "gpt", .. }
    ));

    let e = Gpt::new(
        GptConfig {
            n_heads: 3,
            ..tiny_gpt(DType::F32)
        },
        0,
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("does not divide"), "{e}");
    assert!(Mlp::new(MlpConfig::new(vec![4]), 0).is_err());
}

#[derive(Default)]
struct Scopes(Mutex<Vec<String>>);

impl GradSubscriber for Scopes {
    fn node_backward(&self, scope: Option<&str>, _op: &str) {
        self.0.lock().unwrap().push(scope.unwrap_or("<none>").to_string());
    }
    fn grad_ready(&self, _: GradReady<'_>) -> Result<(), SubscriberError> {
        Ok(())
    }
}

#[test]
fn every_backward_op_runs_under_one_of_the_layer_names_newest_first() {
    let mlp = ModelKind::Mlp(MlpConfig::new(vec![4, 6, 6, 3])).build(0).unwrap();
    let mlp_batch = Batch::classify(
        Tensor::ones(&[2, 4], DType::F32),
        Tensor::from_vec(vec![0i64, 2], &[2]).unwrap(),
    );
    let gpt = ModelKind::Gpt(tiny_gpt(DType::F32)).build(0).unwrap();
    let gpt_batch = Batch::tokens(Tensor::from_vec(random_tokens(&[2, 6], 7, 1), &[2, 6]).unwrap());
    for (model, batch) in [(mlp, mlp_batch), (gpt, gpt_batch)] {
        let log = Arc::new(Scopes::default());
        model.params().bus().subscribe(log.clone());
        model.loss(&batch).unwrap().backward().unwrap();
        let seen = log.0.lock().unwrap().clone();
        let names = model.layer_names();
        let order: Vec<usize> = seen
            .iter()
            .map(|s| {
                names
                    .iter()
                    .position(|n| n == s)
                    .unwrap_or_else(|| panic!("scope {s} is not in {names:?}"))
            })
            .collect();
        assert!(
            order.windows(2).all(|w| w[0] >= w[1]),
            "backward should visit layers last to first: {seen:?}"
        );
        assert_eq!(order.first(), Some(&(names.len() - 1)));
        assert_eq!(order.last(), Some(&0));
    }
}

/// Moves every parameter off its symmetric init (zero biases, unit LayerNorm).
fn move_params(model: &dyn Model, rng: &mut Rng) {
    let moved: Vec<(String, Tensor)> = model
        .params()
        .named_values()
        .into_iter()
        .map(|(n, t)| (n, Tensor::randn(t.shape(), 0.4, DType::F64, rng)))
        .collect();
    load_params_from_tensors(model.params(), &moved).unwrap();
}

/// `|analytic - numeric| / max(1, |numeric|)`, infinite when anything is not finite: a NaN
/// must fail the check, not vanish in a comparison.
fn relative_error(analytic: f64, numeric: f64) -> f64 {
    let err = (analytic - numeric).abs() / numeric.abs().max(1.0);
    if err.is_finite() {
        err
    } else {
        f64::INFINITY
    }
}

/// Checks backward's parameter gradients of `model` on `batch` against central
/// differences at a few random elements of every parameter (f64 model).
fn check_param_grads(model: &dyn Model, batch: &Batch) {
    let mut rng = Rng::new(17);
    move_params(model, &mut rng);
    let (err, at) = worst_param_grad_error(model, batch, &mut rng);
    assert!(err < 1e-6, "worst relative error {err:.3e} at {at}");
}

/// The worst relative error between backward's gradients and central differences at a few
/// random elements of every parameter, and where it is.
fn worst_param_grad_error(model: &dyn Model, batch: &Batch, rng: &mut Rng) -> (f64, String) {
    model.params().zero_grad().unwrap();
    model.loss(batch).unwrap().backward().unwrap();
    let loss_at = || no_grad(|| model.loss(batch).unwrap().value().item().unwrap());
    let h = 1e-5;
    let mut worst = (0.0f64, String::new());
    for p in model.params().params() {
        let (value, grad) = (p.value(), p.grad().unwrap().to_vec::<f64>().unwrap());
        for _ in 0..4 {
            let j = rng.below(value.numel() as u64) as usize;
            let element = value.flat_view(j, &[]).unwrap();
            let nudge = |delta: f64| element.add_assign(&Tensor::scalar(delta, DType::F64)).unwrap();
            nudge(h);
            let up = loss_at();
            nudge(-2.0 * h);
            let down = loss_at();
            nudge(h);
            let numeric = (up - down) / (2.0 * h);
            let err = relative_error(grad[j], numeric);
            if err > worst.0 || worst.1.is_empty() {
                worst = (
                    err,
                    format!(
                        "{}[{j}]: analytic {:.9e} vs numeric {numeric:.9e}",
                        p.name().unwrap(),
                        grad[j]
                    ),
                );
            }
        }
    }
    worst
}

#[test]
fn a_nan_gradient_fails_the_parameter_check() {
    // One NaN in the output layer makes the loss, gradients and differences NaN: the check must
    // report an infinite error, not the 0 of a comparison that is always false.
    let m = Mlp::new(
        MlpConfig {
            widths: vec![5, 7, 3],
            dtype: DType::F64,
            dropout: 0.0,
        },
        5,
    )
    .unwrap();
    let mut rng = Rng::new(17);
    move_params(&m, &mut rng);
    m.params()
        .get("layers.1.bias")
        .unwrap()
        .value()
        .flat_view(1, &[])
        .unwrap()
        .copy_from(&Tensor::scalar(f64::NAN, DType::F64))
        .unwrap();
    let batch = Batch::classify(
        Tensor::randn(&[4, 5], 1.0, DType::F32, &mut rng),
        Tensor::from_vec(vec![0i64, 1, 2, 1], &[4]).unwrap(),
    );
    let (err, at) = worst_param_grad_error(&m, &batch, &mut rng);
    assert_eq!(err, f64::INFINITY, "at {at}");
}

#[test]
fn gpt_parameter_gradients_match_finite_differences_in_f64() {
    let m = Gpt::new(tiny_gpt(DType::F64), 5).unwrap();
    let batch = Batch::tokens(Tensor::from_vec(random_tokens(&[2, 6], 7, 3), &[2, 6]).unwrap());
    check_param_grads(&m, &batch);
}

#[test]
fn mlp_parameter_gradients_match_finite_differences_in_f64() {
    let m = Mlp::new(
        MlpConfig {
            widths: vec![5, 7, 7, 3],
            dtype: DType::F64,
            dropout: 0.0,
        },
        5,
    )
    .unwrap();
    let mut rng = Rng::new(2);
    let batch = Batch::classify(
        Tensor::randn(&[4, 5], 1.0, DType::F32, &mut rng),
        Tensor::from_vec(vec![0i64, 1, 2, 1], &[4]).unwrap(),
    );
    check_param_grads(&m, &batch);
}
