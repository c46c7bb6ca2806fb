//! Optimizers against PyTorch's update rules, worked by hand.

use brigade_autograd::{AdamW, Optimizer, ParamStore, Sgd, Var};
use brigade_tensor::Tensor;

/// One parameter `p` with loss `sum(p * c)`, so that the gradient is exactly `c`.
fn setup(p0: &[f32], c: &[f32]) -> (ParamStore, Var, Var) {
    let mut store = ParamStore::new();
    let p = store.add("p", Tensor::from_slice(p0, &[p0.len()]).unwrap()).unwrap();
    let c = Var::constant(Tensor::from_slice(c, &[c.len()]).unwrap());
    (store, p, c)
}

fn grad_step(store: &ParamStore, p: &Var, c: &Var, opt: &mut dyn Optimizer) {
    store.zero_grad().unwrap();
    p.mul(c).unwrap().sum_all().unwrap().backward().unwrap();
    opt.step().unwrap();
}

fn close(a: &[f32], b: &[f32]) {
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-6, "{a:?} vs {b:?}");
    }
}

#[test]
fn sgd_with_momentum_and_weight_decay() {
    let (store, p, c) = setup(&[1.0, -2.0], &[0.5, 1.0]);
    let mut opt = Sgd::new(store.params().to_vec(), 0.1, 0.9, 0.01);
    grad_step(&store, &p, &c, &mut opt);
    // g = c + 0.01 p = [0.51, 0.98]; buf = g; p = p - 0.1 g = [0.949, -2.098]
    close(&p.value().to_vec::<f32>().unwrap(), &[0.949, -2.098]);
    grad_step(&store, &p, &c, &mut opt);
    // g = [0.5 + 0.00949, 1 - 0.02098] = [0.50949, 0.97902]
    // buf = 0.9 [0.51, 0.98] + g = [0.96849, 1.86102]; p -= 0.1 buf
    close(
        &p.value().to_vec::<f32>().unwrap(),
        &[0.949 - 0.096849, -2.098 - 0.186102],
    );
}

#[test]
fn adamw_two_steps_and_state_round_trip() {
    let (store, p, c1) = setup(&[1.0, -2.0], &[0.5, -1.0]);
    let mut opt = AdamW::new(store.params().to_vec(), 0.1);
    grad_step(&store, &p, &c1, &mut opt);
    // step 1: p *= 1 - 0.1*0.01; m = 0.1 g, v = 0.001 g^2; mhat = g, vhat = g^2
    // p -= 0.1 * g / (|g| + 1e-8) = 0.1 sign(g)
    let p1 = [1.0 * 0.999 - 0.1, -2.0 * 0.999 + 0.1];
    close(&p.value().to_vec::<f32>().unwrap(), &p1);
    let saved = opt.state_dict().unwrap();
    let after_step1 = p.value().to_vec::<f32>().unwrap();
    // Step 2 with another gradient, so that the result depends on the state: with a constant
    // gradient every AdamW update is lr * sign(g), whatever m, v and the step count hold.
    let c2 = Var::constant(Tensor::from_slice(&[2.0f32, -0.25], &[2]).unwrap());
    grad_step(&store, &p, &c2, &mut opt);
    // g1 = [0.5, -1], g2 = [2, -0.25]
    // m = 0.9 * 0.1 g1 + 0.1 g2 = [0.245, -0.115];  mhat = m / (1 - 0.9^2) = m / 0.19
    // v = 0.999 * 0.001 g1^2 + 0.001 g2^2 = [0.00424975, 0.0010615];  vhat = v / 0.001999
    // p2 = 0.999 p1 - 0.1 mhat / (sqrt(vhat) + 1e-8) = 0.999 p1 - [0.0884376, -0.0830598]
    let p2 = [p1[0] * 0.999 - 0.088_437_65, p1[1] * 0.999 + 0.083_059_75];
    close(&p.value().to_vec::<f32>().unwrap(), &p2);
    // (without the state, step 2 would move each element by 0.1 sign(g2) instead)
    assert!((p2[0] - (p1[0] * 0.999 - 0.1)).abs() > 1e-2);

    // restoring the state after step 1 into a fresh optimizer reproduces step 2, bit for bit
    let (store2, q, _) = setup(&after_step1, &[0.5, -1.0]);
    let mut opt2 = AdamW::new(store2.params().to_vec(), 0.1);
    opt2.load_state_dict(&saved).unwrap();
    grad_step(&store2, &q, &c2, &mut opt2);
    assert_eq!(q.value().to_vec::<f32>().unwrap(), p.value().to_vec::<f32>().unwrap());
    let bits = |o: &dyn Optimizer| -> Vec<(String, Vec<u64>)> {
        o.state_dict()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.to_f64_vec().unwrap().iter().map(|x| x.to_bits()).collect()))
            .collect()
    };
    assert_eq!(bits(&opt2), bits(&opt), "the restored optimizer's state after step 2");
}

/// Two parameters, one frozen: `loss = sum(p * c) + sum(f * c)`.
fn frozen_setup() -> (ParamStore, Var, Var, Var) {
    let mut store = ParamStore::new();
    let p = store
        .add("p", Tensor::from_slice(&[1.0f32, -2.0], &[2]).unwrap())
        .unwrap();
    let f = store
        .add("f", Tensor::from_slice(&[3.0f32, 4.0], &[2]).unwrap())
        .unwrap();
    let c = Var::constant(Tensor::from_slice(&[0.5f32, -1.0], &[2]).unwrap());
    (store, p, f, c)
}

#[test]
fn optimizers_leave_a_frozen_parameter_unchanged() {
    let make: [(&str, fn(Vec<Var>) -> Box<dyn Optimizer>); 2] = [
        ("sgd", |ps| Box::new(Sgd::new(ps, 0.1, 0.9, 0.01))),
        ("adamw", |ps| {
            Box::new(AdamW::with_options(ps, 0.1, (0.9, 0.999), 1e-8, 0.1))
        }),
    ];
    for (name, make) in make {
        let (store, p, f, c) = frozen_setup();
        let mut opt = make(store.params().to_vec());
        let step = |opt: &mut Box<dyn Optimizer>| {
            store.zero_grad().unwrap();
            p.mul(&c)
                .unwrap()
                .add(&f.mul(&c).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            opt.step().unwrap();
        };
        // one step with both trainable, so that the frozen one has optimizer state (momentum,
        // moments) that would move it again
        step(&mut opt);
        f.set_requires_grad(false).unwrap();
        let (p_before, f_before) = (p.value().to_vec::<f32>().unwrap(), f.value().to_vec::<f32>().unwrap());
        // weight decay and momentum would move it without a gradient if it were not skipped
        step(&mut opt);
        step(&mut opt);
        assert_eq!(
            f.value().to_vec::<f32>().unwrap(),
            f_before,
            "{name}: a frozen parameter moved"
        );
        assert_ne!(
            p.value().to_vec::<f32>().unwrap(),
            p_before,
            "{name}: the trainable parameter must move"
        );
    }
}

#[test]
fn an_optimizer_lists_the_parameters_it_steps() {
    use brigade_autograd::MasterWeights;
    use brigade_tensor::DType;

    let (store, p, c) = setup(&[1.0, -2.0], &[0.5, 1.0]);
    let q = Var::leaf(Tensor::from_slice(&[3.0f32], &[1]).unwrap());
    let mut sgd = Sgd::new(vec![p.clone(), q.clone()], 0.1, 0.0, 0.0);
    let adamw = AdamW::new(vec![q.clone()], 0.1);
    assert_eq!(sgd.params().len(), 2);
    assert_eq!(adamw.params().len(), 1);
    // the listed parameters are the ones stepped: the update shows through them
    grad_step(&store, &p, &c, &mut sgd);
    close(&sgd.params()[0].value().to_vec::<f32>().unwrap(), &[0.95, -2.1]);
    close(&sgd.params()[1].value().to_vec::<f32>().unwrap(), &[3.0]);

    // under master weights the listed parameters are the f32 masters the inner one steps
    let (store, p, c) = setup(&[1.0, -2.0], &[0.5, 1.0]);
    let build = |ps: Vec<Var>| Box::new(Sgd::new(ps, 0.1, 0.0, 0.0)) as Box<dyn Optimizer>;
    let mut mixed = MasterWeights::new(store.params().to_vec(), DType::BF16, build, &[]).unwrap();
    let c = Var::constant(c.value().to_dtype(DType::BF16).unwrap());
    grad_step(&store, &p, &c, &mut mixed);
    let masters = mixed.params();
    assert_eq!((masters.len(), masters[0].value().dtype()), (1, DType::F32));
    close(&masters[0].value().to_vec::<f32>().unwrap(), &[0.95, -2.1]);
    assert_eq!(p.value().dtype(), DType::BF16);
}
