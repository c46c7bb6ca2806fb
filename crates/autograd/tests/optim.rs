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
    let (store, p, c) = setup(&[1.0, -2.0], &[0.5, -1.0]);
    let mut opt = AdamW::new(store.params().to_vec(), 0.1);
    grad_step(&store, &p, &c, &mut opt);
    // step 1: p *= 1 - 0.1*0.01; m = 0.1 g, v = 0.001 g^2; mhat = g, vhat = g^2
    // p -= 0.1 * g / (|g| + 1e-8) = 0.1 sign(g)
    let p1 = [1.0 * 0.999 - 0.1, -2.0 * 0.999 + 0.1];
    close(&p.value().to_vec::<f32>().unwrap(), &p1);
    let saved = opt.state().unwrap();
    grad_step(&store, &p, &c, &mut opt);
    // step 2 with the same g: m = 0.19 g, v = 0.001999 g^2; mhat = g, vhat = g^2 again
    let p2 = [p1[0] * 0.999 - 0.1, p1[1] * 0.999 + 0.1];
    close(&p.value().to_vec::<f32>().unwrap(), &p2);

    // restoring the state after step 1 into a fresh optimizer reproduces step 2
    let (store2, q, c2) = setup(&p1, &[0.5, -1.0]);
    let mut opt2 = AdamW::new(store2.params().to_vec(), 0.1);
    opt2.load_state(&saved).unwrap();
    grad_step(&store2, &q, &c2, &mut opt2);
    close(&q.value().to_vec::<f32>().unwrap(), &p2);
}
