//! 16-bit float storage (`bf16`, `f16`) through every float op: each op's output against the
//! same op in f64 on the same rounded inputs, rounded once. Computing in f32 and rounding at
//! the output gives the f64 reference rounded to the dtype for nearly every element, and never
//! more than one unit in the last place away; computing in 16 bits (a GEMM accumulating in
//! bf16, a softmax summing in bf16) misses by many. On the CPU, the counting fake device and,
//! where one opens, GPU 0 (the GPU check runs these tests there).

use brigade_tensor::{DType, Device, Rng, Tensor};

/// The CPU, the counting fake device and, where one opens, GPU 0 (`BRIGADE_REQUIRE_CUDA=1`, as
/// `scripts/gpu-check.sh` sets it, turns a missing GPU into a failure).
fn devices() -> Vec<Device> {
    let mut all = vec![Device::Cpu, Device::Fake(0)];
    match brigade_tensor::testing::device_if_available(Device::Cuda(0)) {
        Ok(gpu) => all.push(gpu),
        Err(e) if brigade_tensor::testing::cuda_required() => panic!("BRIGADE_REQUIRE_CUDA=1 but {e}"),
        Err(_) => {}
    }
    all
}
const HALVES: [DType; 2] = [DType::BF16, DType::F16];

/// Explicit mantissa bits of a 16-bit float.
fn mantissa_bits(d: DType) -> i32 {
    match d {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => unreachable!(),
    }
}

/// One unit in the last place of `x` in `d` (normal range).
fn ulp(x: f64, d: DType) -> f64 {
    let e = if x == 0.0 { -14 } else { x.abs().log2().floor() as i32 };
    2f64.powi(e.max(-14) - mantissa_bits(d))
}

/// `x` rounded to `d` through f32 (the conversion every kernel output takes).
fn round_to(x: f64, d: DType) -> f64 {
    Tensor::from_vec(vec![x as f32], &[1])
        .unwrap()
        .to_dtype(d)
        .unwrap()
        .to_f64_vec()
        .unwrap()[0]
}

/// A `[shape]` tensor of N(0, std) values rounded to `d`, on `dev`, and the same values in f64.
fn pair(shape: &[usize], std: f64, d: DType, dev: Device, rng: &mut Rng) -> (Tensor, Tensor) {
    let h = Tensor::randn(shape, std, DType::F32, rng).to_dtype(d).unwrap();
    let w = h.to_dtype(DType::F64).unwrap();
    (h.to_device(dev).unwrap(), w.to_device(dev).unwrap())
}

/// `got` (16-bit) against the f64 reference: every element within one ulp of the reference
/// (plus `abs` for results that cancel to near zero), and at least 97% equal to the
/// reference rounded.
fn check(op: &str, got: &Tensor, reference: &Tensor, abs: f64) {
    let d = got.dtype();
    assert!(matches!(d, DType::BF16 | DType::F16), "{op}: output dtype {d}");
    assert_eq!(got.shape(), reference.shape(), "{op}");
    let (g, r) = (got.to_f64_vec().unwrap(), reference.to_f64_vec().unwrap());
    let mut exact = 0;
    let mut worst = (0.0, 0);
    for (i, (&g, &r)) in g.iter().zip(&r).enumerate() {
        if g == round_to(r, d) || (g.is_infinite() && g == r) {
            exact += 1;
        }
        let err = if g == r { 0.0 } else { (g - r).abs() / (ulp(r, d) + abs) };
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= 1.0,
        "{op} {d}: element {i} is {} against {} (f64), {:.2} ulp",
        g[i],
        r[i],
        worst.0
    );
    assert!(
        exact * 100 >= g.len() * 97,
        "{op} {d}: only {exact} of {} elements are the f64 reference rounded",
        g.len()
    );
}

#[test]
fn elementwise_ops_round_the_f32_result_once() {
    let mut rng = Rng::new(1);
    for dev in devices() {
        for d in HALVES {
            let (x, xw) = pair(&[37, 29], 1.0, d, dev, &mut rng);
            let (y, yw) = pair(&[37, 29], 1.0, d, dev, &mut rng);
            let (row, roww) = pair(&[29], 1.0, d, dev, &mut rng);
            let pos = x.sqr().unwrap().add_scalar(0.5).unwrap();
            let posw = pos.to_dtype(DType::F64).unwrap();
            type Un = fn(&Tensor) -> brigade_tensor::Result<Tensor>;
            let unary: [(&str, Un); 6] = [
                ("neg", Tensor::neg),
                ("exp", Tensor::exp),
                ("relu", Tensor::relu),
                ("gelu", Tensor::gelu),
                ("sqr", Tensor::sqr),
                ("affine", |t| t.affine(0.3, -0.7)),
            ];
            for (op, f) in unary {
                // f32's gelu cancels in `1 + erf(x)` for x << 0: an absolute error of its own
                let abs = if op == "gelu" { 1e-6 } else { 0.0 };
                check(op, &f(&x).unwrap(), &f(&xw).unwrap(), abs);
            }
            check("ln", &pos.ln().unwrap(), &posw.ln().unwrap(), 0.0);
            check("sqrt", &pos.sqrt().unwrap(), &posw.sqrt().unwrap(), 0.0);
            check("powf", &pos.powf(1.5).unwrap(), &posw.powf(1.5).unwrap(), 0.0);
            type Bin = fn(&Tensor, &Tensor) -> brigade_tensor::Result<Tensor>;
            let binary: [(&str, Bin); 5] = [
                ("add", Tensor::add),
                ("sub", Tensor::sub),
                ("mul", Tensor::mul),
                ("relu_backward", Tensor::relu_backward),
                ("gelu_backward", Tensor::gelu_backward),
            ];
            for (op, f) in binary {
                let abs = if op == "gelu_backward" { 1e-6 } else { 0.0 };
                check(op, &f(&x, &y).unwrap(), &f(&xw, &yw).unwrap(), abs);
            }
            check("div", &x.div(&pos).unwrap(), &xw.div(&posw).unwrap(), 0.0);
            // a broadcast row and a transposed view
            check("add (broadcast)", &x.add(&row).unwrap(), &xw.add(&roww).unwrap(), 0.0);
            let (xt, xtw) = (x.t().unwrap(), xw.t().unwrap());
            check("mul (transposed)", &xt.mul(&xt).unwrap(), &xtw.mul(&xtw).unwrap(), 0.0);
        }
    }
}

#[test]
fn reductions_and_gemms_accumulate_in_f32() {
    let mut rng = Rng::new(2);
    for dev in devices() {
        for d in HALVES {
            let (x, xw) = pair(&[8, 300], 1.0, d, dev, &mut rng);
            // a sum of 300 terms: summed in f32 it is the rounded reference to within an ulp
            check("sum", &x.sum(&[1], false).unwrap(), &xw.sum(&[1], false).unwrap(), 1e-4);
            check(
                "sum (leading)",
                &x.sum(&[0], false).unwrap(),
                &xw.sum(&[0], false).unwrap(),
                1e-4,
            );
            check(
                "max",
                &x.max_dim(1, false).unwrap(),
                &xw.max_dim(1, false).unwrap(),
                0.0,
            );
            let (a, aw) = pair(&[24, 256], 1.0, d, dev, &mut rng);
            let (b, bw) = pair(&[256, 40], 1.0, d, dev, &mut rng);
            check("matmul", &a.matmul(&b).unwrap(), &aw.matmul(&bw).unwrap(), 1e-3);
            let (bt, btw) = (
                b.t().unwrap().contiguous().unwrap(),
                bw.t().unwrap().contiguous().unwrap(),
            );
            check(
                "matmul (transposed rhs)",
                &a.matmul(&bt.t().unwrap()).unwrap(),
                &aw.matmul(&btw.t().unwrap()).unwrap(),
                1e-3,
            );
            let (bias, biasw) = pair(&[40], 1.0, d, dev, &mut rng);
            check(
                "matmul_bias",
                &a.matmul_bias(&b, &bias).unwrap(),
                &aw.matmul_bias(&bw, &biasw).unwrap(),
                1e-3,
            );
            let (p, pw) = pair(&[3, 24, 256], 1.0, d, dev, &mut rng);
            let (q, qw) = pair(&[3, 256, 16], 1.0, d, dev, &mut rng);
            check(
                "matmul (batched)",
                &p.matmul(&q).unwrap(),
                &pw.matmul(&qw).unwrap(),
                1e-3,
            );
        }
    }
}

#[test]
fn softmax_layer_norm_and_the_loss_compute_in_f32() {
    let mut rng = Rng::new(3);
    for dev in devices() {
        for d in HALVES {
            let (x, xw) = pair(&[12, 200], 2.0, d, dev, &mut rng);
            let (g, gw) = pair(&[12, 200], 1.0, d, dev, &mut rng);
            let (y, yw) = (x.softmax_last().unwrap(), xw.softmax_last().unwrap());
            check("softmax", &y, &yw, 0.0);
            check(
                "log_softmax",
                &x.log_softmax_last().unwrap(),
                &xw.log_softmax_last().unwrap(),
                0.0,
            );
            // the backward from the rounded forward output, on both sides
            let yr = y.to_dtype(DType::F64).unwrap();
            check(
                "softmax_backward",
                &y.softmax_backward(&g).unwrap(),
                &yr.softmax_backward(&gw).unwrap(),
                1e-6,
            );

            let (w, ww) = pair(&[200], 1.0, d, dev, &mut rng);
            let (b, bw) = pair(&[200], 1.0, d, dev, &mut rng);
            let (ln, saved) = x.layer_norm(&w, &b, 1e-5).unwrap();
            let (lnw, savedw) = xw.layer_norm(&ww, &bw, 1e-5).unwrap();
            check("layer_norm", &ln, &lnw, 1e-6);
            check("layer_norm mean", &saved.mean, &savedw.mean, 1e-6);
            check("layer_norm rstd", &saved.rstd, &savedw.rstd, 0.0);
            let rounded = brigade_tensor::LayerNormSaved {
                mean: saved.mean.to_dtype(DType::F64).unwrap(),
                rstd: saved.rstd.to_dtype(DType::F64).unwrap(),
            };
            let (dx, dw, db) = x.layer_norm_backward(&w, &saved, &g).unwrap();
            let (dxw, dww, dbw) = xw.layer_norm_backward(&ww, &rounded, &gw).unwrap();
            check("layer_norm_backward dx", &dx, &dxw, 1e-4);
            check("layer_norm_backward dw", &dw, &dww, 1e-4);
            check("layer_norm_backward db", &db, &dbw, 1e-4);

            let targets = Tensor::from_vec((0..12i64).map(|i| (i * 17) % 200).collect(), &[12])
                .unwrap()
                .to_device(dev)
                .unwrap();
            let (loss, probs) = x.cross_entropy(&targets).unwrap();
            let (lossw, probsw) = xw.cross_entropy(&targets).unwrap();
            check("cross_entropy loss", &loss, &lossw, 0.0);
            check("cross_entropy probs", &probs, &probsw, 0.0);
            let pr = probs.to_dtype(DType::F64).unwrap();
            check(
                "cross_entropy_backward",
                &probs.cross_entropy_backward(&targets, 1.0).unwrap(),
                &pr.cross_entropy_backward(&targets, 1.0).unwrap(),
                0.0,
            );
        }
    }
}

#[test]
fn embeddings_masks_attention_and_accumulation_take_16_bit_storage() {
    let mut rng = Rng::new(4);
    for dev in devices() {
        for d in HALVES {
            let (table, tablew) = pair(&[50, 16], 1.0, d, dev, &mut rng);
            let ids = Tensor::from_vec(vec![3i64, 7, 3, 49, 0, 7], &[6])
                .unwrap()
                .to_device(dev)
                .unwrap();
            let rows = table.embedding(&ids).unwrap();
            assert_eq!(
                rows.to_f64_vec().unwrap(),
                tablew.embedding(&ids).unwrap().to_f64_vec().unwrap()
            );
            let (g, gw) = pair(&[6, 16], 1.0, d, dev, &mut rng);
            check(
                "embedding_backward",
                &g.embedding_backward(&ids, 50).unwrap(),
                &gw.embedding_backward(&ids, 50).unwrap(),
                0.0,
            );

            let (s, sw) = pair(&[2, 5, 5], 1.0, d, dev, &mut rng);
            let masked = s.causal_fill(f64::NEG_INFINITY).unwrap();
            assert_eq!(masked.dtype(), d);
            assert_eq!(
                masked.to_f64_vec().unwrap(),
                sw.causal_fill(f64::NEG_INFINITY).unwrap().to_f64_vec().unwrap()
            );

            let (qkv, qkvw) = pair(&[2, 9, 24], 1.0, d, dev, &mut rng);
            let (y, saved) = qkv.causal_attention(2, 0.25).unwrap();
            let (yw, savedw) = qkvw.causal_attention(2, 0.25).unwrap();
            check("causal_attention", &y, &yw, 1e-3);
            check("causal_attention probs", &saved.probs, &savedw.probs, 1e-6);
            let (gy, gyw) = pair(&[2, 9, 8], 1.0, d, dev, &mut rng);
            let rounded = brigade_tensor::AttentionSaved {
                probs: saved.probs.to_dtype(DType::F64).unwrap(),
            };
            check(
                "causal_attention_backward",
                &qkv.causal_attention_backward(&saved, &gy, 2, 0.25).unwrap(),
                &qkvw.causal_attention_backward(&rounded, &gyw, 2, 0.25).unwrap(),
                1e-3,
            );

            // gradient accumulation into a view of a flat 16-bit buffer
            let flat = Tensor::zeros_on(&[40], d, dev).unwrap();
            let view = flat.flat_view(8, &[4, 4]).unwrap();
            let (a, aw) = pair(&[4, 4], 1.0, d, dev, &mut rng);
            let (b, bw) = pair(&[4, 4], 1.0, d, dev, &mut rng);
            view.add_assign(&a).unwrap();
            view.add_scaled_assign(&b, 0.5).unwrap();
            check(
                "add_scaled_assign",
                &view,
                &aw.add(&bw.mul_scalar(0.5).unwrap()).unwrap(),
                0.0,
            );
            let all = flat.to_f64_vec().unwrap();
            assert!(
                all[..8].iter().chain(&all[24..]).all(|&v| v == 0.0),
                "outside the view stays zero"
            );
        }
    }
}
