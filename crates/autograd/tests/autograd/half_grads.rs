//! Gradients through 16-bit storage: a small transformer-like block (linear, GELU, layer norm,
//! causal attention, the loss in f32) with bf16 or f16 parameters and activations, against the
//! same block in f64 on the same rounded parameters and inputs. Every op rounds its output to
//! 16 bits, so the gradients differ from f64 by the accumulated rounding of a few ops: a small
//! relative error, and the gradients keep the parameters' dtype.

use brigade_autograd::Var;
use brigade_tensor::{DType, Rng, Tensor};

/// The block's loss on `x [2, 6, 12]` with the given parameters, the logits widened to f32
/// (or kept in f64 for the reference) before the loss.
fn loss(params: &[Var], x: &Var, targets: &Tensor, loss_dtype: DType) -> Var {
    let (w_qkv, w_mlp, b_mlp, ln_w, ln_b, w_out) =
        (&params[0], &params[1], &params[2], &params[3], &params[4], &params[5]);
    let qkv = x
        .reshape(&[12, 12])
        .unwrap()
        .matmul(w_qkv)
        .unwrap()
        .reshape(&[2, 6, 36])
        .unwrap();
    let att = qkv.causal_attention(2).unwrap().reshape(&[12, 12]).unwrap();
    let h = att.linear(w_mlp, Some(b_mlp)).unwrap().gelu().unwrap();
    let h = h.layer_norm(ln_w, ln_b, 1e-5).unwrap();
    let logits = h.matmul(w_out).unwrap();
    logits.to_dtype(loss_dtype).unwrap().cross_entropy(targets).unwrap()
}

/// Relative L2 distance of two tensors' values.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

#[test]
fn sixteen_bit_gradients_match_the_f64_block_on_the_same_rounded_inputs() {
    // bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%), f16 11 bits (0.05%);
    // a handful of rounded ops between the loss and a parameter stays within a few of those
    for (d, tol) in [(DType::BF16, 1.2e-2), (DType::F16, 2e-3)] {
        let mut rng = Rng::new(7);
        let shapes: [&[usize]; 6] = [&[12, 36], &[16, 12], &[16], &[16], &[16], &[16, 10]];
        let rounded: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::randn(s, 0.4, DType::F32, &mut rng).to_dtype(d).unwrap())
            .collect();
        let half: Vec<Var> = rounded.iter().map(|t| Var::leaf(t.clone())).collect();
        let wide: Vec<Var> = rounded
            .iter()
            .map(|t| Var::leaf(t.to_dtype(DType::F64).unwrap()))
            .collect();
        let x = Tensor::randn(&[2, 6, 12], 1.0, DType::F32, &mut rng)
            .to_dtype(d)
            .unwrap();
        let targets = Tensor::from_vec((0..12i64).map(|i| (i * 7) % 10).collect(), &[12]).unwrap();

        let lh = loss(&half, &Var::constant(x.clone()), &targets, DType::F32);
        let lw = loss(
            &wide,
            &Var::constant(x.to_dtype(DType::F64).unwrap()),
            &targets,
            DType::F64,
        );
        assert_eq!(lh.value().dtype(), DType::F32, "the loss is computed in f32");
        let (vh, vw) = (lh.value().item().unwrap(), lw.value().item().unwrap());
        assert!((vh - vw).abs() / vw < tol, "{d} loss {vh} against {vw} (f64)");
        lh.backward().unwrap();
        lw.backward().unwrap();
        for (i, (h, w)) in half.iter().zip(&wide).enumerate() {
            let (gh, gw) = (h.grad().unwrap(), w.grad().unwrap());
            assert_eq!(gh.dtype(), d, "parameter {i}'s gradient keeps the parameter's dtype");
            let e = rel(&gh, &gw);
            assert!(
                e < tol,
                "{d} parameter {i}: gradient relative error {e:.2e} (tolerance {tol:.1e})"
            );
        }
    }
}
