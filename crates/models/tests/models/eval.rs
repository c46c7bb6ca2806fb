//! Evaluation pieces: `Model::forward`, train/eval mode, `Dropout` (p = 0 keeps
//! the bits, eval mode is the identity, its generator's state makes a resume exact) and an eval
//! loss under `no_grad` equal to the training loss of the same batch.

use brigade_autograd::{no_grad, profile_ops, OpProfile, Optimizer, ParamStore, Sgd, Var};
use brigade_models::nn::{Dropout, DropoutRng};
use brigade_models::{Batch, Gpt, GptConfig, Mlp, MlpConfig, Model, ModelError, RngState};
use brigade_tensor::{DType, Rng, Tensor};

fn gpt_cfg(dropout: f64) -> GptConfig {
    GptConfig {
        vocab: 32,
        d_model: 16,
        n_layers: 2,
        n_heads: 2,
        d_ff: 24,
        context: 8,
        dtype: DType::F32,
        dropout,
    }
}

fn mlp_cfg(dropout: f64) -> MlpConfig {
    MlpConfig {
        dropout,
        ..MlpConfig::new(vec![6, 16, 16, 3])
    }
}

fn gpt_batch(seed: u64) -> Batch {
    let mut rng = Rng::new(seed);
    let t: Vec<i64> = (0..4 * 9).map(|_| rng.below(32) as i64).collect();
    Batch::tokens(Tensor::from_vec(t, &[4, 9]).unwrap())
}

fn mlp_batch(seed: u64) -> Batch {
    let mut rng = Rng::new(seed);
    let x = Tensor::randn(&[5, 6], 1.0, DType::F32, &mut rng);
    let y: Vec<i64> = (0..5).map(|_| rng.below(3) as i64).collect();
    Batch::classify(x, Tensor::from_vec(y, &[5]).unwrap())
}

/// The loss's bits and every gradient's bits after one backward.
fn loss_and_grads(model: &dyn Model, batch: &Batch) -> (u64, Vec<Vec<u32>>) {
    model.params().set_grads_to_none().unwrap();
    let loss = model.loss(batch).unwrap();
    loss.backward().unwrap();
    let grads = model
        .params()
        .params()
        .iter()
        .map(|p| {
            p.grad()
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|g| g.to_bits())
                .collect()
        })
        .collect();
    (loss.value().item().unwrap().to_bits(), grads)
}

fn loss_bits(model: &dyn Model, batch: &Batch) -> u64 {
    model.loss(batch).unwrap().value().item().unwrap().to_bits()
}

/// Forward and backward op calls of one training step.
fn op_calls(model: &dyn Model, batch: &Batch) -> (OpProfile, u64) {
    model.params().set_grads_to_none().unwrap();
    let (loss, profile) = profile_ops(|| {
        let loss = model.loss(batch).unwrap();
        loss.backward().unwrap();
        loss
    });
    (profile, loss.value().item().unwrap().to_bits())
}

/// Calls per op name.
type Calls = Vec<(&'static str, usize)>;

fn calls(p: &OpProfile) -> (Calls, Calls) {
    let f = |m: &std::collections::BTreeMap<&'static str, brigade_autograd::OpTime>| {
        m.iter().map(|(k, v)| (*k, v.calls)).collect()
    };
    (f(&p.forward), f(&p.backward))
}

#[test]
fn dropout_zero_records_no_op_and_keeps_every_bit() {
    // p = 0 in training mode against p = 0.3 in eval mode (the path without dropout): the same
    // op calls, the same loss bits, the same gradient bits; p = 0.3 in training mode adds one
    // `mul` per dropout and changes the loss.
    type Build = Box<dyn Fn(f64) -> Box<dyn Model>>;
    let batches: [(Build, Batch, usize); 2] = [
        (
            Box::new(|p| Box::new(Gpt::new(gpt_cfg(p), 3).unwrap())),
            gpt_batch(1),
            1 + 2 * 2,
        ),
        (
            Box::new(|p| Box::new(Mlp::new(mlp_cfg(p), 3).unwrap())),
            mlp_batch(1),
            2,
        ),
    ];
    for (build, batch, n_dropouts) in batches {
        let zero = build(0.0);
        let mut off = build(0.3);
        off.eval();
        assert_eq!(loss_and_grads(&*zero, &batch), loss_and_grads(&*off, &batch));
        let ((pz, lz), (po, lo)) = (op_calls(&*zero, &batch), op_calls(&*off, &batch));
        assert_eq!(calls(&pz), calls(&po));
        assert_eq!(lz, lo);
        let on = build(0.3);
        let (pd, ld) = op_calls(&*on, &batch);
        let muls = |p: &OpProfile| p.forward.get("mul").map_or(0, |t| t.calls);
        assert_eq!(muls(&pd), muls(&pz) + n_dropouts, "one mask multiplication per dropout");
        assert_ne!(ld, lz, "dropout at p = 0.3 changes the loss");
    }
}

#[test]
fn dropout_drops_p_of_the_elements_and_scales_the_rest() {
    let rng = DropoutRng::new(42);
    let drop = Dropout::new(0.25, &rng).unwrap();
    let x = Var::leaf(Tensor::ones(&[200, 200], DType::F32));
    let y = drop.forward(&x).unwrap();
    let v = y.value().to_vec::<f32>().unwrap();
    let zeros = v.iter().filter(|&&e| e == 0.0).count() as f64 / v.len() as f64;
    // 40000 draws: the fraction's standard deviation is 0.0022
    assert!((zeros - 0.25).abs() < 0.011, "dropped {zeros}");
    assert!(
        v.iter().all(|&e| e == 0.0 || e == (1.0f64 / 0.75) as f32),
        "kept elements scale by 1/(1-p)"
    );
    // the gradient is the mask: d(sum y)/dx = y / x = y
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), v);
    // a new mask each call, the generator advancing one mask per call
    assert_eq!(rng.state(), RngState { seed: 42, offset: 1 });
    assert_ne!(drop.forward(&x).unwrap().value().to_vec::<f32>().unwrap(), v);
    // p = 1 drops everything; p outside [0, 1] is refused
    let all = Dropout::new(1.0, &rng).unwrap().forward(&x).unwrap();
    assert!(all.value().to_vec::<f32>().unwrap().iter().all(|&e| e == 0.0));
    for p in [-0.1, 1.5, f64::NAN] {
        assert!(Dropout::new(p, &rng).is_err(), "{p}");
    }
    assert!(Gpt::new(gpt_cfg(2.0), 0).is_err() && Mlp::new(mlp_cfg(-1.0), 0).is_err());
}

#[test]
fn dropout_in_eval_mode_is_the_identity() {
    let rng = DropoutRng::new(1);
    let mut drop = Dropout::new(0.5, &rng).unwrap();
    assert!(drop.is_training());
    drop.set_training(false);
    let x = Var::leaf(Tensor::randn(&[7, 5], 1.0, DType::F32, &mut Rng::new(0)));
    let y = drop.forward(&x).unwrap();
    assert!(y.same(&x), "the same Var: no op recorded");
    assert_eq!(rng.state().offset, 0, "no mask drawn");
    // a whole model: eval() turns every dropout off, train() back on
    let mut gpt = Gpt::new(gpt_cfg(0.5), 0).unwrap();
    let batch = gpt_batch(2);
    gpt.eval();
    assert!(!gpt.is_training());
    let a = loss_bits(&gpt, &batch);
    assert_eq!(a, loss_bits(&gpt, &batch), "deterministic in eval mode");
    assert_eq!(gpt.rng_state().unwrap().offset, 0);
    gpt.train();
    assert!(gpt.is_training());
    assert_ne!(a, loss_bits(&gpt, &batch));
    assert_eq!(
        gpt.rng_state().unwrap().offset,
        5,
        "one mask per dropout: embed + 2 per block"
    );
}

#[test]
fn restoring_the_generator_makes_a_resume_exact_at_p_above_zero() {
    // 4 SGD steps straight, against 2 steps, a "checkpoint" (parameters, generator state) into
    // a fresh model, and 2 more: bit-identical parameters. Without the generator state, not.
    let cfg = mlp_cfg(0.4);
    let batches: Vec<Batch> = (0..4).map(mlp_batch).collect();
    let step = |m: &Mlp, opt: &mut Sgd, b: &Batch| {
        m.params().zero_grad().unwrap();
        m.loss(b).unwrap().backward().unwrap();
        opt.step().unwrap();
    };
    let values = |s: &ParamStore| -> Vec<Vec<u32>> {
        s.params()
            .iter()
            .map(|p| p.value().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    let straight = Mlp::new(cfg.clone(), 7).unwrap();
    let mut opt = Sgd::new(straight.params().params().to_vec(), 0.1, 0.0, 0.0);
    batches.iter().for_each(|b| step(&straight, &mut opt, b));

    let first = Mlp::new(cfg.clone(), 7).unwrap();
    let mut opt = Sgd::new(first.params().params().to_vec(), 0.1, 0.0, 0.0);
    batches[..2].iter().for_each(|b| step(&first, &mut opt, b));
    let (params, rng) = (first.params().named_values(), first.rng_state().unwrap());
    assert_eq!(rng.offset, 4, "2 steps x 2 dropouts");
    for restore in [true, false] {
        let mut resumed = Mlp::new(cfg.clone(), 99).unwrap();
        brigade_models::load_params_from_tensors(resumed.params(), &params).unwrap();
        if restore {
            resumed.set_rng_state(rng).unwrap();
        }
        let mut opt = Sgd::new(resumed.params().params().to_vec(), 0.1, 0.0, 0.0);
        batches[2..].iter().for_each(|b| step(&resumed, &mut opt, b));
        assert_eq!(
            values(resumed.params()) == values(straight.params()),
            restore,
            "restored generator: {restore}"
        );
    }
}

#[test]
fn eval_loss_under_no_grad_equals_the_training_loss_of_the_same_batch() {
    let gpt = Gpt::new(gpt_cfg(0.0), 5).unwrap();
    let mlp = Mlp::new(mlp_cfg(0.0), 5).unwrap();
    for (model, batch) in [(&gpt as &dyn Model, gpt_batch(3)), (&mlp, mlp_batch(3))] {
        let train = model.loss(&batch).unwrap();
        assert!(train.requires_grad());
        let eval = no_grad(|| model.loss(&batch)).unwrap();
        assert!(!eval.requires_grad(), "no graph under no_grad");
        assert_eq!(
            eval.value().item().unwrap().to_bits(),
            train.value().item().unwrap().to_bits()
        );
    }
    // with dropout: the eval-mode loss is the loss of the same weights without dropout
    let mut dropped = Gpt::new(gpt_cfg(0.3), 5).unwrap();
    let batch = gpt_batch(4);
    let plain = no_grad(|| gpt.loss(&batch)).unwrap().value().item().unwrap();
    dropped.eval();
    assert_eq!(no_grad(|| dropped.loss(&batch)).unwrap().value().item().unwrap(), plain);
}

#[test]
fn forward_gives_the_logits_the_loss_reads() {
    let gpt = Gpt::new(gpt_cfg(0.0), 1).unwrap();
    let batch = gpt_batch(5);
    let (inputs, targets) = batch.shifted_tokens("gpt").unwrap();
    let logits = gpt.forward(&Batch::tokens(inputs)).unwrap();
    assert_eq!(logits.shape(), [4, 8, 32]);
    let ce = logits.reshape(&[32, 32]).unwrap().cross_entropy(&targets).unwrap();
    assert_eq!(
        ce.value().item().unwrap(),
        gpt.loss(&batch).unwrap().value().item().unwrap()
    );

    let mlp = Mlp::new(mlp_cfg(0.0), 1).unwrap();
    let batch = mlp_batch(5);
    let inputs_only = Batch::new(vec![("inputs".into(), batch.get("inputs").unwrap().clone())]).unwrap();
    let logits = mlp.forward(&inputs_only).unwrap();
    assert_eq!(logits.shape(), [5, 3]);
    let ce = logits.cross_entropy(batch.get("targets").unwrap()).unwrap();
    assert_eq!(
        ce.value().item().unwrap(),
        mlp.loss(&batch).unwrap().value().item().unwrap()
    );
    let e = mlp.loss(&inputs_only).unwrap_err();
    assert!(matches!(e, ModelError::WrongBatch { model: "mlp", .. }), "{e}");
}

/// A user's model that defines only its loss.
struct LossOnly(ParamStore);

impl Model for LossOnly {
    fn params(&self) -> &ParamStore {
        &self.0
    }
    fn loss(&self, _: &Batch) -> brigade_models::Result<Var> {
        Ok(Var::constant(Tensor::scalar(0.0, DType::F32)))
    }
    fn layer_names(&self) -> Vec<String> {
        vec![]
    }
}

#[test]
fn a_model_without_forward_or_generator_says_so() {
    let mut m = LossOnly(ParamStore::new());
    let e = m.forward(&mlp_batch(0)).unwrap_err();
    assert!(
        matches!(e, ModelError::Unsupported(_)) && e.to_string().contains("Model::forward"),
        "{e}"
    );
    m.eval(); // nothing depends on the mode: a no-op
    assert!(m.rng_state().is_none() && m.batch_schema().is_none());
    assert!(m.set_rng_state(RngState { seed: 0, offset: 3 }).is_err());
}
