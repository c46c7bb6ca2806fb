//! Every differentiable op against central finite differences in f64, including
//! broadcasting and non-contiguous (transposed, narrowed) inputs.

use brigade_autograd::{gradcheck, Result, Var};
use brigade_tensor::{DType, Rng, Tensor};

const H: f64 = 1e-6;
const TOL: f64 = 1e-6;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, 1.0, DType::F64, &mut Rng::new(seed))
}

/// Values bounded away from zero, for ln/sqrt/div.
fn positive(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_uniform(shape, 0.5, 2.0, DType::F64, &mut Rng::new(seed))
}

fn check(f: impl Fn(&[Var]) -> Result<Var>, inputs: &[Tensor]) {
    let r = gradcheck(f, inputs, H, TOL).unwrap();
    assert!(r.max_error <= TOL, "{r:?}");
}

#[test]
fn elementwise_binary_ops_with_broadcasting() {
    let (a, b) = (randn(&[3, 4], 1), randn(&[4], 2));
    check(|x| x[0].add(&x[1]), &[a.clone(), b.clone()]);
    check(|x| x[0].sub(&x[1]), &[a.clone(), b.clone()]);
    check(|x| x[0].mul(&x[1]), &[a.clone(), b.clone()]);
    // column broadcast against a row: [3,1] op [1,4]
    check(|x| x[0].mul(&x[1]), &[randn(&[3, 1], 3), randn(&[1, 4], 4)]);
    check(|x| x[0].div(&x[1]), &[a, positive(&[3, 1], 5)]);
}

#[test]
fn unary_ops() {
    let x = randn(&[2, 5], 6);
    check(|v| v[0].exp(), &[x.clone()]);
    check(|v| v[0].ln(), &[positive(&[2, 5], 7)]);
    check(|v| v[0].sqrt(), &[positive(&[2, 5], 8)]);
    check(|v| v[0].gelu(), &[x.clone()]);
    check(|v| v[0].affine(-1.5, 0.25), &[x.clone()]);
    // relu away from the kink at 0
    let away: Vec<f64> = x
        .to_vec::<f64>()
        .unwrap()
        .into_iter()
        .map(|v| if v.abs() < 0.1 { v + 0.3 } else { v })
        .collect();
    check(|v| v[0].relu(), &[Tensor::from_vec(away, &[2, 5]).unwrap()]);
}

/// `x` with every element within `gap` of a point in `kinks` moved `2 gap` away from it.
fn away_from(x: Tensor, kinks: &[f64], gap: f64) -> Tensor {
    let v = x
        .to_vec::<f64>()
        .unwrap()
        .into_iter()
        .map(|v| {
            if kinks.iter().any(|k| (v - k).abs() < gap) {
                v + 2.0 * gap
            } else {
                v
            }
        })
        .collect();
    Tensor::from_vec(v, x.shape()).unwrap()
}

#[test]
fn trigonometric_magnitude_power_and_clamping_ops() {
    let x = randn(&[3, 4], 50);
    check(|v| v[0].sin(), &[x.clone()]);
    check(|v| v[0].cos(), &[x.clone()]);
    check(|v| v[0].sqr(), &[x.clone()]);
    check(|v| v[0].pow(3.0), &[x.clone()]);
    check(|v| v[0].pow(-1.5), &[positive(&[3, 4], 51)]);
    check(|v| v[0].pow(0.5), &[positive(&[3, 4], 52)]);
    // away from the kinks: abs at 0, clamp at its bounds
    check(|v| v[0].abs(), &[away_from(x.clone(), &[0.0], 0.05)]);
    check(|v| v[0].clamp(-0.5, 0.7), &[away_from(x.clone(), &[-0.5, 0.7], 0.05)]);
    check(
        |v| v[0].clamp(f64::NEG_INFINITY, 0.2),
        &[away_from(x.clone(), &[0.2], 0.05)],
    );
    // a transposed view through a composition
    check(|v| v[0].t()?.sin()?.mul(&v[0].t()?.cos()?), &[x]);
}

#[test]
fn round_has_a_zero_gradient_and_the_straight_through_form_passes_it() {
    // away from the half-integers, round is a step: both gradients are 0
    let x = away_from(
        randn(&[2, 5], 53).mul_scalar(3.0).unwrap(),
        &[-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5],
        0.05,
    );
    check(|v| v[0].round(), &[x.clone()]);
    let v = Var::leaf(x.clone());
    v.round().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(v.grad().unwrap().to_vec::<f64>().unwrap(), vec![0.0; 10]);
    // the straight-through estimator the doc gives: round's value, the identity's gradient
    let v = Var::leaf(x.clone());
    let ste = v.add(&v.round().unwrap().sub(&v).unwrap().detach()).unwrap();
    assert_eq!(
        ste.value().to_vec::<f64>().unwrap(),
        x.round().unwrap().to_vec::<f64>().unwrap()
    );
    ste.sum_all().unwrap().backward().unwrap();
    assert_eq!(v.grad().unwrap().to_vec::<f64>().unwrap(), vec![1.0; 10]);
}

#[test]
fn amax_and_amin_over_dims() {
    let x = randn(&[2, 3, 4], 54);
    check(|v| v[0].amax(&[2], false), &[x.clone()]);
    check(|v| v[0].amax(&[0, 2], true), &[x.clone()]);
    check(|v| v[0].amin(&[1], false), &[x.clone()]);
    check(|v| v[0].amin(&[0, 1, 2], false), &[x.clone()]);
    check(|v| v[0].transpose(0, 2)?.amax(&[1, 2], false), &[x]);
    // ties share the gradient equally (PyTorch's amax): [3, 1, 3] -> 1/2, 0, 1/2
    let v = Var::leaf(Tensor::from_vec(vec![3.0f64, 1.0, 3.0, -2.0, -2.0, 0.0], &[2, 3]).unwrap());
    v.amax(&[1], false).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(
        v.grad().unwrap().to_vec::<f64>().unwrap(),
        vec![0.5, 0.0, 0.5, 0.0, 0.0, 1.0]
    );
    let v = Var::leaf(Tensor::from_vec(vec![3.0f64, 1.0, 3.0, -2.0, -2.0, 0.0], &[2, 3]).unwrap());
    v.amin(&[0, 1], false).unwrap().backward().unwrap();
    assert_eq!(
        v.grad().unwrap().to_vec::<f64>().unwrap(),
        vec![0.0, 0.0, 0.0, 0.5, 0.5, 0.0]
    );
}

#[test]
fn matmul_plain_batched_and_transposed() {
    check(|v| v[0].matmul(&v[1]), &[randn(&[3, 4], 9), randn(&[4, 5], 10)]);
    // batched x batched
    check(|v| v[0].matmul(&v[1]), &[randn(&[2, 3, 4], 11), randn(&[2, 4, 2], 12)]);
    // batched x matrix (the linear-layer path that folds the batch into rows)
    check(|v| v[0].matmul(&v[1]), &[randn(&[2, 3, 4], 13), randn(&[4, 5], 14)]);
    // non-contiguous inputs: a transposed view as the lhs, a transposed weight
    let at = randn(&[4, 3], 15).t().unwrap();
    assert!(!at.is_contiguous());
    check(|v| v[0].matmul(&v[1]), &[at, randn(&[4, 2], 16)]);
    check(
        |v| v[0].linear(&v[1], Some(&v[2])),
        &[randn(&[2, 3, 4], 17), randn(&[5, 4], 18), randn(&[5], 19)],
    );
    // the bias-fused product with a transposed input
    check(
        |v| v[0].linear(&v[1], Some(&v[2])),
        &[randn(&[4, 3], 34).t().unwrap(), randn(&[2, 4], 35), randn(&[2], 36)],
    );
    check(
        |v| v[0].linear(&v[1], None),
        &[randn(&[4, 3], 32).t().unwrap(), randn(&[2, 4], 33)],
    );
}

#[test]
fn reductions() {
    let x = randn(&[2, 3, 4], 20);
    check(|v| v[0].sum(&[1], false), &[x.clone()]);
    check(|v| v[0].sum(&[0, 2], true), &[x.clone()]);
    check(|v| v[0].mean(&[2], false), &[x.clone()]);
    check(|v| v[0].sum_all(), &[x.clone()]);
    check(|v| v[0].mean_all(), &[x.clone()]);
    check(|v| v[0].max_dim(2, false), &[x.clone()]);
    check(|v| v[0].max_dim(0, true), &[x]);
}

#[test]
fn softmax_family_and_layer_norm() {
    let x = randn(&[3, 5], 21);
    check(|v| v[0].softmax(), &[x.clone()]);
    check(|v| v[0].log_softmax(), &[x.clone()]);
    // non-contiguous input to a last-axis op
    check(|v| v[0].softmax(), &[randn(&[5, 3], 22).t().unwrap()]);
    check(
        |v| v[0].layer_norm(&v[1], &v[2], 1e-5),
        &[randn(&[2, 3, 6], 23), randn(&[6], 24), randn(&[6], 25)],
    );
    // rows of 37: two chunks of the CPU kernel's 16 partial sums and a tail of 5
    check(
        |v| v[0].layer_norm(&v[1], &v[2], 1e-5),
        &[randn(&[3, 37], 29), randn(&[37], 30), randn(&[37], 31)],
    );
}

#[test]
fn embedding_causal_mask_and_cross_entropy() {
    let ids = Tensor::from_vec(vec![1i64, 3, 1, 0, 2, 3], &[2, 3]).unwrap();
    check(|v| v[0].embedding(&ids), &[randn(&[4, 5], 26)]);
    // masked scores through softmax: the path attention uses
    check(|v| v[0].causal_mask()?.softmax(), &[randn(&[2, 4, 4], 27)]);
    let targets = Tensor::from_vec(vec![2i64, 0, 4], &[3]).unwrap();
    check(|v| v[0].cross_entropy(&targets), &[randn(&[3, 5], 28)]);
}

#[test]
fn fused_causal_attention() {
    // 2 heads of width 3: qkv [B=2, T=5, 3 * 6]
    check(|v| v[0].causal_attention(2), &[randn(&[2, 5, 18], 40)]);
    // one head, one token (the softmax of a single score), and a strided (transposed) input
    check(|v| v[0].causal_attention(1), &[randn(&[3, 1, 6], 41)]);
    check(|v| v[0].transpose(0, 1)?.causal_attention(3), &[randn(&[4, 2, 9], 42)]);
    // 70 positions: the CPU kernel splits the queries into two blocks of 35 rows that
    // skip the masked keys
    check(|v| v[0].causal_attention(2), &[randn(&[1, 70, 12], 45)]);
}

#[test]
fn fused_causal_attention_refuses_bad_shapes() {
    let x = Var::leaf(randn(&[2, 5, 18], 43));
    // 18 columns do not split into q, k, v of 4 heads
    assert!(x.causal_attention(4).is_err());
    assert!(x.causal_attention(0).is_err());
    assert!(Var::leaf(randn(&[5, 18], 44)).causal_attention(2).is_err());
}

#[test]
fn views_pass_gradients_back_to_the_right_elements() {
    let x = randn(&[2, 3, 4], 29);
    check(|v| v[0].reshape(&[6, 4])?.mul(&v[0].reshape(&[6, 4])?), &[x.clone()]);
    check(|v| v[0].transpose(0, 2)?.exp(), &[x.clone()]);
    check(|v| v[0].permute(&[1, 2, 0])?.softmax(), &[x.clone()]);
    check(|v| v[0].narrow(2, 1, 2)?.sqrt(), &[positive(&[2, 3, 4], 30)]);
    check(|v| v[0].narrow(1, 1, 2)?.contiguous()?.sum(&[0], false), &[x]);
}

#[test]
fn a_wrong_gradient_is_caught() {
    // sanity: the checker is not vacuous. exp's backward with the wrong factor must fail.
    let x = randn(&[3], 31);
    let wrong = |v: &[Var]| v[0].mul_scalar(2.0)?.exp()?.mul_scalar(0.5);
    // correct composition passes ...
    check(wrong, &[x.clone()]);
    // ... and comparing it against a different function's gradient fails
    let r = gradcheck(
        |v: &[Var]| Ok(Var::constant(v[0].value().exp()?)).and_then(|c| c.add(&v[0].mul_scalar(0.0)?)),
        &[x],
        H,
        TOL,
    );
    assert!(
        r.is_err(),
        "a function whose graph drops the exp derivative must fail the check"
    );
}

#[test]
fn a_nan_or_infinite_gradient_fails_the_check() {
    // ln(x) at x < 0 is NaN, and so is its finite difference: the relative error is NaN,
    // which a `max` would drop. It must fail instead.
    let negative = Tensor::from_vec(vec![-1.0f64, -2.0, 0.5], &[3]).unwrap();
    let e = gradcheck(|v| v[0].ln(), &[negative], H, TOL)
        .expect_err("NaN gradients must fail the check")
        .to_string();
    assert!(e.contains("NaN") && e.contains("inf"), "{e}");
    // sqrt at 0: the analytic gradient 1/(2 sqrt 0) is infinite.
    let zero = Tensor::from_vec(vec![0.0f64, 1.0], &[2]).unwrap();
    assert!(
        gradcheck(|v| v[0].sqrt(), &[zero], H, TOL).is_err(),
        "an infinite gradient must fail the check"
    );
}

/// An `I64` index tensor of `shape` with values below `bound` (repeats certain when the
/// index is longer than `bound`).
fn index(shape: &[usize], bound: u64, seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let n: usize = shape.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.below(bound) as i64).collect(), shape).unwrap()
}

#[test]
fn topk_and_sort_pass_the_gradient_to_the_picked_elements() {
    // distinct random values: the order does not change within +-h
    check(|v| Ok(v[0].topk(3)?.0), &[randn(&[4, 7], 40)]);
    check(|v| Ok(v[0].topk(7)?.0), &[randn(&[2, 7], 41)]);
    check(|v| Ok(v[0].sort(false)?.0), &[randn(&[3, 5], 42)]);
    check(|v| Ok(v[0].sort(true)?.0), &[randn(&[3, 5], 43)]);
    // a transposed view: rows of the view are columns of the storage
    check(|v| Ok(v[0].topk(2)?.0), &[randn(&[6, 3], 44).t().unwrap()]);
}

#[test]
fn gather_and_index_select_add_up_the_gradient_of_repeated_indices() {
    let ids = index(&[5, 4], 3, 45);
    check(|v| v[0].gather(0, &ids), &[randn(&[3, 4], 46)]);
    let ids = index(&[2, 6], 4, 47);
    check(|v| v[0].gather(1, &ids), &[randn(&[3, 4], 48)]);
    let ids = index(&[7], 3, 49);
    check(|v| v[0].index_select(0, &ids), &[randn(&[3, 4], 50)]);
    check(|v| v[0].index_select(1, &index(&[5], 4, 51)), &[randn(&[3, 4], 52)]);
}

#[test]
fn scatter_add_and_index_add_gradients_reach_both_inputs() {
    let ids = index(&[6, 4], 3, 53);
    check(
        |v| v[0].scatter_add(0, &ids, &v[1]),
        &[randn(&[3, 4], 54), randn(&[6, 4], 55)],
    );
    let ids = index(&[2, 5], 4, 56);
    check(
        |v| v[0].scatter_add(1, &ids, &v[1]),
        &[randn(&[3, 4], 57), randn(&[2, 5], 58)],
    );
    let ids = index(&[5], 4, 59);
    check(
        |v| v[0].index_add(1, &ids, &v[1]),
        &[randn(&[3, 4], 60), randn(&[3, 5], 61)],
    );
    // a sparse update of a flat vector, as a top-k policy applies one
    let x = randn(&[10], 62);
    check(
        |v| {
            let (vals, at) = v[1].topk(3)?;
            v[0].scatter_add(0, &at, &vals)
        },
        &[x, randn(&[10], 63)],
    );
}
