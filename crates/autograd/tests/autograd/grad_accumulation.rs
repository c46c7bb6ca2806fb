//! Leaf gradients: the first one is kept as the op produced it when nothing else shares its
//! storage, and copied when something does, so two leaves never end up sharing a gradient.

use brigade_autograd::Var;
use brigade_tensor::{DType, Tensor};

#[test]
fn gradients_that_share_storage_are_copied_before_they_accumulate() {
    // d(a + b) hands both leaves the same gradient tensor; kept as is, a second backward
    // would add into it twice (3 instead of 2 in each).
    let a = Var::leaf(Tensor::zeros(&[4], DType::F64));
    let b = Var::leaf(Tensor::zeros(&[4], DType::F64));
    let y = a.add(&b).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    y.backward().unwrap();
    for v in [&a, &b] {
        assert_eq!(v.grad().unwrap().to_vec::<f64>().unwrap(), vec![2.0; 4]);
    }
    assert!(!a.grad().unwrap().shares_storage(&b.grad().unwrap()));
}

#[test]
fn a_fresh_first_gradient_is_the_leafs_gradient_and_later_ones_add_into_it() {
    // y = sum(x * c): dx = c, a tensor the mul's backward made for x alone
    let x = Var::leaf(Tensor::zeros(&[3], DType::F64));
    let c = Var::constant(Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[3]).unwrap());
    let y = x.mul(&c).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), [1.0, 2.0, 3.0]);
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), [2.0, 4.0, 6.0]);
    // set to none, then again: the same values as the first time
    x.set_grad(None).unwrap();
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), [1.0, 2.0, 3.0]);
}
