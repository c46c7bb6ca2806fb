//! The losses against central finite differences in f64 (for the input and for a target that
//! needs a gradient, under each reduction), and against values derived by hand.

use brigade_autograd::{gradcheck, Reduction, Result, Var};
use brigade_tensor::{DType, Rng, Tensor};

const H: f64 = 1e-6;
const TOL: f64 = 1e-6;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, 1.0, DType::F64, &mut Rng::new(seed))
}

fn check(f: impl Fn(&[Var]) -> Result<Var>, inputs: &[Tensor]) {
    let r = gradcheck(f, inputs, H, TOL).unwrap();
    assert!(r.max_error <= TOL, "{r:?}");
}

const REDUCTIONS: [Reduction; 3] = [Reduction::Mean, Reduction::Sum, Reduction::None];

/// A target with every `|input - target|` at least `gap` from each of `kinks`.
fn target_away(input: &Tensor, seed: u64, kinks: &[f64], gap: f64) -> Tensor {
    let x = input.to_vec::<f64>().unwrap();
    let y: Vec<f64> = randn(input.shape(), seed)
        .to_vec::<f64>()
        .unwrap()
        .into_iter()
        .zip(&x)
        .map(|(y, &x)| {
            if kinks.iter().any(|k| ((x - y).abs() - k).abs() < gap) {
                y + 3.0 * gap
            } else {
                y
            }
        })
        .collect();
    Tensor::from_vec(y, input.shape()).unwrap()
}

fn value(v: Var) -> f64 {
    v.value().item().unwrap()
}

fn vars(x: &[f64], y: &[f64]) -> (Var, Var) {
    let t = |v: &[f64]| Var::leaf(Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap());
    (t(x), t(y))
}

#[test]
fn mse_loss_gradients_and_values() {
    let (x, y) = (randn(&[3, 4], 1), randn(&[3, 4], 2));
    for r in REDUCTIONS {
        check(|v| v[0].mse_loss_with(&v[1], r), &[x.clone(), y.clone()]);
    }
    check(|v| v[0].t()?.mse_loss(&v[1]), &[randn(&[4, 3], 3), y]);
    // ((1-0)^2 + (2-0)^2 + (0-3)^2) / 3 = 14/3
    let (a, b) = vars(&[1.0, 2.0, 0.0], &[0.0, 0.0, 3.0]);
    assert!((value(a.mse_loss(&b).unwrap()) - 14.0 / 3.0).abs() < 1e-15);
    assert_eq!(value(a.mse_loss_with(&b, Reduction::Sum).unwrap()), 14.0);
    assert_eq!(a.mse_loss_with(&b, Reduction::None).unwrap().shape(), vec![3]);
}

#[test]
fn l1_loss_gradients_and_values() {
    let x = randn(&[3, 4], 4);
    let y = target_away(&x, 5, &[0.0], 0.05);
    for r in REDUCTIONS {
        check(|v| v[0].l1_loss_with(&v[1], r), &[x.clone(), y.clone()]);
    }
    // (1 + 2 + 3) / 3 = 2; at x = y the gradient is 0
    let (a, b) = vars(&[1.0, 2.0, 0.0, 5.0], &[0.0, 0.0, 3.0, 5.0]);
    assert_eq!(value(a.l1_loss_with(&b, Reduction::Sum).unwrap()), 6.0);
    a.l1_loss(&b).unwrap().backward().unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f64>().unwrap(), vec![0.25, 0.25, -0.25, 0.0]);
}

#[test]
fn smooth_l1_and_huber_loss_gradients_and_values() {
    let x = randn(&[4, 5], 6);
    for beta in [0.5, 1.0, 2.0] {
        let y = target_away(&x, 7, &[0.0, beta], 0.05);
        for r in REDUCTIONS {
            check(|v| v[0].smooth_l1_loss_with(&v[1], beta, r), &[x.clone(), y.clone()]);
            check(|v| v[0].huber_loss_with(&v[1], beta, r), &[x.clone(), y.clone()]);
        }
    }
    // beta = 0 is the L1 loss
    let y = target_away(&x, 8, &[0.0], 0.05);
    check(|v| v[0].smooth_l1_loss(&v[1], 0.0), &[x.clone(), y]);
    // d = 0.5 and 3 with beta = delta = 1: smooth L1 0.5*0.25 = 0.125 and 3 - 0.5 = 2.5;
    // Huber 0.125 and 1 * (3 - 0.5) = 2.5; with delta = 2: 0.125 and 2 * (3 - 1) = 4
    let (a, b) = vars(&[0.5, 3.0], &[0.0, 0.0]);
    assert_eq!(value(a.smooth_l1_loss_with(&b, 1.0, Reduction::Sum).unwrap()), 2.625);
    assert_eq!(value(a.huber_loss_with(&b, 1.0, Reduction::Sum).unwrap()), 2.625);
    assert_eq!(value(a.huber_loss_with(&b, 2.0, Reduction::Sum).unwrap()), 4.125);
    assert!(a.smooth_l1_loss(&b, -1.0).is_err());
    assert!(a.huber_loss(&b, 0.0).is_err());
    assert!(a.huber_loss(&b, f64::NAN).is_err());
}

#[test]
fn binary_cross_entropy_with_logits_gradients_values_and_stability() {
    let x = randn(&[3, 4], 9).mul_scalar(3.0).unwrap();
    let y = Tensor::rand_uniform(&[3, 4], 0.0, 1.0, DType::F64, &mut Rng::new(10));
    for r in REDUCTIONS {
        check(
            |v| v[0].binary_cross_entropy_with_logits_with(&v[1], r),
            &[x.clone(), y.clone()],
        );
    }
    // x = 0 exactly, where max(x, 0) and |x| have kinks but the loss does not
    let zeros = Tensor::zeros(&[3, 4], DType::F64);
    check(|v| v[0].binary_cross_entropy_with_logits(&v[1]), &[zeros, y]);
    // at x = 0 the loss is ln 2 whatever y is; sigmoid(0) - y = 0.5 - y
    let (a, b) = vars(&[0.0, 0.0], &[1.0, 0.25]);
    let l = a.binary_cross_entropy_with_logits(&b).unwrap();
    assert!((value(l.clone()) - std::f64::consts::LN_2).abs() < 1e-15);
    l.backward().unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f64>().unwrap(), vec![-0.25, 0.125]);
    // logits of +-100 in f32: finite, 0 when right, 100 when wrong (the naive
    // -y ln sigmoid(x) is ln(0) = -inf there)
    let logits = Var::leaf(Tensor::from_vec(vec![100.0f32, -100.0, 100.0, -100.0], &[4]).unwrap());
    let target = Var::constant(Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 1.0], &[4]).unwrap());
    let l = logits
        .binary_cross_entropy_with_logits_with(&target, Reduction::None)
        .unwrap();
    assert_eq!(l.value().to_vec::<f32>().unwrap(), vec![0.0, 0.0, 100.0, 100.0]);
    l.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        logits.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 0.0, 1.0, -1.0]
    );
}

#[test]
fn losses_refuse_an_input_and_target_of_different_shapes() {
    let (a, b) = (Var::leaf(randn(&[3, 1], 11)), Var::constant(randn(&[3], 12)));
    for e in [
        a.mse_loss(&b).err(),
        a.l1_loss(&b).err(),
        a.smooth_l1_loss(&b, 1.0).err(),
        a.huber_loss(&b, 1.0).err(),
        a.binary_cross_entropy_with_logits(&b).err(),
    ] {
        let e = e.expect("a shape mismatch is an error").to_string();
        assert!(e.contains("[3, 1]") && e.contains("[3]"), "{e}");
    }
}
