//! Per-op profiling: every recorded op is counted once forward and once backward, under
//! its own name, only inside `profile_ops` and only on the profiling thread.

use brigade_autograd::{profile_ops, Var};
use brigade_tensor::{DType, Rng, Tensor};

fn calls(map: &std::collections::BTreeMap<&'static str, brigade_autograd::OpTime>, op: &str) -> usize {
    map.get(op).map_or(0, |t| t.calls)
}

#[test]
fn each_op_is_counted_forward_and_backward_by_name() {
    let x = Var::leaf(Tensor::randn(&[3, 4], 1.0, DType::F64, &mut Rng::new(0)));
    let w = Var::leaf(Tensor::randn(&[4, 2], 1.0, DType::F64, &mut Rng::new(1)));
    let (r, p) = profile_ops(|| -> brigade_autograd::Result<()> {
        // x is used twice: its two gradients are summed (accumulate_grad)
        let y = x.matmul(&w)?.exp()?.sum_all()?.add(&x.sum_all()?)?;
        y.backward()
    });
    r.unwrap();
    assert_eq!(calls(&p.forward, "matmul"), 1);
    assert_eq!(calls(&p.forward, "exp"), 1);
    assert_eq!(calls(&p.forward, "sum"), 2);
    assert_eq!(calls(&p.forward, "add"), 1);
    for op in ["matmul", "exp", "add"] {
        assert_eq!(calls(&p.backward, op), 1, "{op}: {p:?}");
    }
    assert_eq!(calls(&p.backward, "sum"), 2);
    // one per gradient edge: add 2, sum 1 + 1, exp 1, matmul 2
    assert_eq!(calls(&p.backward, "accumulate_grad"), 7, "{p:?}");
    assert!(p.forward_total() > std::time::Duration::ZERO);
}

#[test]
fn nothing_is_recorded_outside_or_on_other_threads() {
    let x = Var::leaf(Tensor::ones(&[2], DType::F64));
    // ops before the profile are not charged to it
    let y = x.exp().unwrap();
    let (_, p) = profile_ops(|| {
        std::thread::scope(|s| {
            s.spawn(|| x.exp().unwrap().sum_all().unwrap().backward().unwrap());
        });
    });
    assert!(p.forward.is_empty() && p.backward.is_empty(), "{p:?}");
    drop(y);
}
