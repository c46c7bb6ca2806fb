//! Every op, forward and backward, on a device against the CPU on the same data, in f32 and
//! f64: one harness ([`parity`]) that runs each op through the public `Tensor` API on the CPU
//! and on the device under test and compares the results element by element.
//!
//! On the counting fake device (the CPU's kernels behind the device contract) the harness must
//! be exact, which checks the harness and the fake together, here, on every `cargo test`. On
//! `cuda:0` (the GPU check) it is compared within a per-dtype tolerance; the fused optimizer
//! steps, written to round as the CPU rounds, must match bit for bit. Without a GPU the CUDA
//! tests say that they skipped and why (`BRIGADE_REQUIRE_CUDA=1`, set by
//! `scripts/gpu-check.sh`, turns a skip into a failure).
//!
//! Also here: the NaN rules (a NaN propagates through relu, max, softmax and cross-entropy on
//! every device), run by `test_device!` on the CPU, the fake device and CUDA.

use std::io::Write;

use brigade_tensor::cuda::{compare_outputs, probe};
use brigade_tensor::{test_device, AdamWStep, DType, Device, Rng, SgdStep, Tensor};

/// One op's result on the CPU and on the device.
struct Case {
    name: String,
    cpu: Vec<f64>,
    dev: Vec<f64>,
    /// Relative tolerance on a GPU (the fake device is always compared exactly).
    rel_tol: f64,
}

/// Builds the cases: `cpu_side(x)` and `dev_side(x)` run the same closure on CPU tensors and
/// on their copies on the device.
struct Harness {
    device: Device,
    dtype: DType,
    cases: Vec<Case>,
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

impl Harness {
    fn tol(&self) -> f64 {
        if self.dtype == DType::F64 {
            1e-10
        } else {
            2e-5
        }
    }

    fn on(&self, t: &Tensor) -> Tensor {
        t.to_device(self.device).unwrap()
    }

    fn randn(&self, shape: &[usize], seed: u64) -> Tensor {
        Tensor::randn(shape, 1.0, self.dtype, &mut Rng::new(seed))
    }

    /// Runs `f` on `inputs` (CPU) and on their device copies, adding one case per output.
    fn check(&mut self, name: &str, rel_tol: f64, inputs: &[&Tensor], f: impl Fn(&[Tensor]) -> Vec<Tensor>) {
        let cpu_in: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        let dev_in: Vec<Tensor> = inputs.iter().map(|t| self.on(t)).collect();
        let (want, got) = (f(&cpu_in), f(&dev_in));
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(g.device(), self.device, "{name}: output {i} left the device");
            self.cases.push(Case {
                name: if want.len() > 1 {
                    format!("{name}[{i}]")
                } else {
                    name.to_string()
                },
                cpu: f64s(w),
                dev: f64s(g),
                rel_tol,
            });
        }
    }
}

/// Every op of the contract through the public API, on `device` and on the CPU.
fn parity(device: Device, dtype: DType) -> Vec<Case> {
    let mut h = Harness {
        device,
        dtype,
        cases: Vec::new(),
    };
    let tol = h.tol();
    let x = h.randn(&[6, 9], 1);
    let pos = x.sqr().unwrap().add_scalar(0.5).unwrap();
    // unary ops on a transposed view (kernels read it in place) and on a contiguous one
    h.check("neg/exp/relu/gelu/sqr/affine (transposed)", tol, &[&x], |v| {
        let t = v[0].t().unwrap();
        vec![
            t.neg().unwrap(),
            t.exp().unwrap(),
            t.relu().unwrap(),
            t.gelu().unwrap(),
            t.sqr().unwrap(),
            t.affine(2.5, -1.0).unwrap(),
        ]
    });
    h.check("sin/cos/abs/sign/round/clamp/in_range/is_zero", tol, &[&x], |v| {
        let t = v[0].mul_scalar(3.0).unwrap().t().unwrap();
        vec![
            t.sin().unwrap(),
            t.cos().unwrap(),
            t.abs().unwrap(),
            t.sign().unwrap(),
            t.round().unwrap(),
            t.clamp(-0.5, 0.75).unwrap(),
            t.in_range(-0.5, 0.75).unwrap(),
            t.round().unwrap().is_zero().unwrap(),
        ]
    });
    h.check("ln/sqrt/powf", tol, &[&pos], |v| {
        vec![v[0].ln().unwrap(), v[0].sqrt().unwrap(), v[0].powf(1.5).unwrap()]
    });
    // broadcasting binary ops: [3, 1] with [4]
    let (a, b) = (h.randn(&[3, 1], 2), h.randn(&[4], 3));
    h.check(
        "add/sub/mul/div/relu_backward/gelu_backward (broadcast)",
        tol,
        &[&a, &b],
        |v| {
            vec![
                v[0].add(&v[1]).unwrap(),
                v[0].sub(&v[1]).unwrap(),
                v[0].mul(&v[1]).unwrap(),
                v[0].div(&v[1]).unwrap(),
                v[0].broadcast_to(&[3, 4])
                    .unwrap()
                    .relu_backward(&v[1].broadcast_to(&[3, 4]).unwrap())
                    .unwrap(),
                v[0].broadcast_to(&[3, 4])
                    .unwrap()
                    .gelu_backward(&v[1].broadcast_to(&[3, 4]).unwrap())
                    .unwrap(),
            ]
        },
    );
    // reductions, gathers and casts
    let r = h.randn(&[3, 4, 70], 4);
    h.check("sum/max/permute/sum_to_shape", tol, &[&r], |v| {
        vec![
            v[0].sum(&[1], false).unwrap(),
            v[0].sum(&[0, 2], true).unwrap(),
            v[0].sum(&[2], false).unwrap(),
            v[0].max_dim(2, false).unwrap(),
            v[0].max_dim(0, true).unwrap(),
            v[0].amax(&[0, 2], false).unwrap(),
            v[0].amin(&[1], true).unwrap(),
            v[0].permute(&[2, 0, 1]).unwrap().copy().unwrap(),
            v[0].sum_to_shape(&[4, 1]).unwrap(),
        ]
    });
    h.check("casts (f32, f64, bf16, f16, i64, u8, i8 and back)", 0.0, &[&r], |v| {
        let scaled = v[0].mul_scalar(40.0).unwrap().permute(&[2, 0, 1]).unwrap();
        [
            DType::F32,
            DType::F64,
            DType::BF16,
            DType::F16,
            DType::I64,
            DType::U8,
            DType::I8,
        ]
        .into_iter()
        .map(|d| scaled.to_dtype(d).unwrap().to_dtype(DType::F64).unwrap())
        .collect()
    });
    // matrix products: plain, transposed, attention's permuted views, broadcast batch, linear
    let (m1, m2) = (h.randn(&[7, 33], 5), h.randn(&[33, 12], 6));
    let (q, k) = (h.randn(&[2, 5, 3, 4], 7), h.randn(&[2, 5, 3, 4], 8));
    let bias = h.randn(&[12], 9);
    h.check(
        "matmul (plain, transposed, permuted, linear)",
        tol,
        &[&m1, &m2, &q, &k, &bias],
        |v| {
            let qp = v[2].permute(&[0, 2, 1, 3]).unwrap();
            let kt = v[3].permute(&[0, 2, 1, 3]).unwrap().transpose(2, 3).unwrap();
            vec![
                v[0].matmul(&v[1]).unwrap(),
                v[1].t().unwrap().matmul(&v[0].t().unwrap()).unwrap(),
                qp.matmul(&kt).unwrap(),
                v[0].matmul_bias(&v[1], &v[4]).unwrap(),
                v[0].narrow(0, 0, 1)
                    .unwrap()
                    .broadcast_to(&[7, 33])
                    .unwrap()
                    .matmul(&v[1])
                    .unwrap(),
            ]
        },
    );
    // rows longer than a block; layer norm over enough rows for the two-stage column sums
    let (s, g) = (h.randn(&[6, 300], 10), h.randn(&[6, 300], 11));
    h.check("softmax/log_softmax and backwards", tol, &[&s, &g], |v| {
        let (y, ly) = (v[0].softmax_last().unwrap(), v[0].log_softmax_last().unwrap());
        vec![
            y.softmax_backward(&v[1]).unwrap(),
            ly.log_softmax_backward(&v[1]).unwrap(),
            y,
            ly,
        ]
    });
    let (lx, lg) = (h.randn(&[150, 40], 12), h.randn(&[150, 40], 13));
    let (lw, lb) = (h.randn(&[40], 14), h.randn(&[40], 15));
    h.check(
        "layer_norm and backward (150 rows)",
        tol * 10.0,
        &[&lx, &lw, &lb, &lg],
        |v| {
            let (y, saved) = v[0].layer_norm(&v[1], &v[2], 1e-5).unwrap();
            let (dx, dw, db) = v[0].layer_norm_backward(&v[1], &saved, &v[3]).unwrap();
            vec![y, saved.mean, saved.rstd, dx, dw, db]
        },
    );
    // embedding with repeated ids (its backward adds them up: atomics on a GPU)
    let table = h.randn(&[5, 3], 16);
    let ids = Tensor::from_vec(vec![4i64, 0, 4, 2, 4], &[5]).unwrap();
    let ge = h.randn(&[5, 3], 17);
    h.check("embedding and backward", tol, &[&table, &ids, &ge], |v| {
        vec![
            v[0].embedding(&v[1]).unwrap(),
            v[2].embedding_backward(&v[1], 5).unwrap(),
        ]
    });
    let sc = h.randn(&[2, 3, 4], 18);
    h.check("causal_fill", 0.0, &[&sc], |v| vec![v[0].causal_fill(-1e9).unwrap()]);
    let logits = h.randn(&[4, 37], 19);
    let targets = Tensor::from_vec(vec![36u8, 0, 3, 3], &[4]).unwrap();
    h.check("cross_entropy and backward", tol, &[&logits, &targets], |v| {
        let (loss, probs) = v[0].cross_entropy(&v[1]).unwrap();
        let back = probs.cross_entropy_backward(&v[1], 0.5).unwrap();
        vec![loss, probs, back]
    });
    let (nh, hd) = (3, 4);
    let qkv = h.randn(&[2, 6, 3 * nh * hd], 20);
    let gy = h.randn(&[2, 6, nh * hd], 21);
    h.check("causal_attention and backward", tol * 10.0, &[&qkv, &gy], |v| {
        let scale = 1.0 / (hd as f64).sqrt();
        let (y, saved) = v[0].causal_attention(nh, scale).unwrap();
        let dqkv = v[0].causal_attention_backward(&saved, &v[1], nh, scale).unwrap();
        vec![y, saved.probs, dqkv]
    });
    indexing_cases(&mut h);
    // in place through a narrowed view of a flat buffer (a bucket)
    let src = h.randn(&[2, 3], 22);
    h.check("fill/copy_from/add_assign through a bucket view", tol, &[&src], |v| {
        let flat = Tensor::zeros_on(&[10], v[0].dtype(), v[0].device()).unwrap();
        let view = flat.flat_view(4, &[2, 3]).unwrap();
        view.fill(1.5).unwrap();
        view.add_scaled_assign(&v[0], 2.0).unwrap();
        let other = flat.flat_view(0, &[2, 2]).unwrap();
        other.copy_from(&v[0].narrow(1, 0, 2).unwrap().copy().unwrap()).unwrap();
        vec![flat]
    });
    // the fused optimizer steps (f32 only), bit for bit on every device
    if dtype == DType::F32 {
        let (p, gr) = (h.randn(&[1000], 23), h.randn(&[1000], 24));
        h.check("sgd_step (momentum, weight decay, 2 steps)", 0.0, &[&p, &gr], |v| {
            let p = v[0].copy().unwrap();
            let buf = Tensor::zeros_on(&[1000], DType::F32, p.device()).unwrap();
            for first in [true, false] {
                let hp = SgdStep {
                    lr: 0.1,
                    momentum: 0.9,
                    weight_decay: 0.01,
                    is_first_step: first,
                };
                p.sgd_step(&v[1], Some(&buf), hp).unwrap();
            }
            vec![p, buf]
        });
        h.check("adamw_step (2 steps)", 0.0, &[&p, &gr], |v| {
            let p = v[0].copy().unwrap();
            let (m, s) = (
                Tensor::zeros_on(&[1000], DType::F32, p.device()).unwrap(),
                Tensor::zeros_on(&[1000], DType::F32, p.device()).unwrap(),
            );
            for step in [1, 2] {
                let hp = AdamWStep {
                    lr: 1e-3,
                    betas: (0.9, 0.999),
                    eps: 1e-8,
                    weight_decay: 0.01,
                    step,
                };
                p.adamw_step(&v[1], &m, &s, &hp).unwrap();
            }
            vec![p, m, s]
        });
    }
    h.cases
}

/// Sorting and moving by index, forward and backward, bit for bit on every device: rows
/// sorted in one block (300) and in tiles then merged (4500, and a flat 10000), with ties
/// (kept in position order); gather and scatter-add along each dim with repeated ids (added
/// in the CPU's order, not by atomics), strided and broadcast indices, and a 1-d index_add
/// of 3000 ids, longer than a block.
fn indexing_cases(h: &mut Harness) {
    let ids = |v: Vec<i64>, shape: &[usize]| Tensor::from_vec(v, shape).unwrap();
    let tied = |t: Tensor| t.mul_scalar(2.0).unwrap().round().unwrap();
    let (short, long) = (tied(h.randn(&[5, 300], 25)), tied(h.randn(&[2, 4500], 26)));
    h.check(
        "sort/argsort/topk (rows of 300 and 4500, tied)",
        0.0,
        &[&short, &long],
        |v| {
            let mut out = vec![];
            for x in v {
                for descending in [false, true] {
                    let (s, i) = x.sort(descending).unwrap();
                    out.extend([s, i, x.argsort(descending).unwrap()]);
                }
                let (t, i) = x.topk(37).unwrap();
                out.extend([t, i]);
            }
            out
        },
    );
    let (flat, gk) = (h.randn(&[10000], 27), h.randn(&[100], 28));
    h.check(
        "topk of 10000 and its backward (scatter_add)",
        0.0,
        &[&flat, &gk],
        |v| {
            let (vals, i) = v[0].topk(100).unwrap();
            let zeros = Tensor::zeros_on(&[10000], v[0].dtype(), v[0].device()).unwrap();
            let back = zeros.scatter_add(0, &i, &v[1]).unwrap();
            vec![vals, i, back]
        },
    );
    let base = h.randn(&[6, 9], 29);
    let i1 = ids((0..72).map(|i| (i * 7 + 3) % 9).collect(), &[6, 12]);
    let i0 = ids((0..45).map(|i| (i * 5 + 1) % 6).collect(), &[5, 9]);
    let (s1, s0, gy) = (h.randn(&[6, 12], 30), h.randn(&[5, 9], 31), h.randn(&[6, 9], 32));
    h.check(
        "gather/scatter_add along each dim and backwards (repeated ids)",
        0.0,
        &[&base, &i1, &s1, &i0, &s0, &gy],
        |v| {
            let zeros = Tensor::zeros_on(&[6, 9], v[0].dtype(), v[0].device()).unwrap();
            vec![
                v[0].gather(1, &v[1]).unwrap(),
                v[0].gather(0, &v[3]).unwrap(),
                // a strided index on a strided tensor
                v[0].t().unwrap().gather(0, &v[1].t().unwrap()).unwrap(),
                v[0].scatter_add(1, &v[1], &v[2]).unwrap(),
                v[0].scatter_add(0, &v[3], &v[4]).unwrap(),
                // gather's backward adds the gradient back at its index; scatter_add's
                // gradient for src gathers the output's
                zeros.scatter_add(1, &v[1], &v[2]).unwrap(),
                v[5].gather(0, &v[3]).unwrap(),
            ]
        },
    );
    let sel = ids(vec![4, 0, 4, 2, 5, 4, 1], &[7]);
    let (add, flat_base, flat_src) = (h.randn(&[7, 9], 33), h.randn(&[500], 34), h.randn(&[3000], 35));
    let long_ids = ids((0..3000).map(|i| (i * 37) % 500).collect(), &[3000]);
    h.check(
        "index_add/index_select (broadcast index; 3000 ids into 500)",
        0.0,
        &[&base, &sel, &add, &flat_base, &long_ids, &flat_src],
        |v| {
            vec![
                v[0].index_add(0, &v[1], &v[2]).unwrap(),
                v[0].index_select(0, &v[1]).unwrap(),
                v[3].index_add(0, &v[4], &v[5]).unwrap(),
                v[3].gather(0, &v[4]).unwrap(),
            ]
        },
    );
}

/// Compares every case (exactly when `exact`), printing one line per case; the failures.
fn verdict(device: Device, dtype: DType, cases: &[Case], exact: bool) -> Vec<String> {
    let mut failures = vec![];
    for c in cases {
        let tol = if exact { 0.0 } else { c.rel_tol };
        let cmp = compare_outputs(&c.dev, &c.cpu, tol);
        println!(
            "{device} {dtype}: {:<58} worst |diff| {:.3e} at {} (tolerance {tol:e} relative){}",
            c.name,
            cmp.worst_abs_diff,
            cmp.worst_index,
            if cmp.passed() { "" } else { "  FAIL" }
        );
        if !cmp.passed() {
            failures.push(format!(
                "{}: {} of {} elements outside {tol:e}; worst at {}: device {} vs CPU {}",
                c.name,
                cmp.mismatches,
                cmp.elements,
                cmp.worst_index,
                c.dev.get(cmp.worst_index).copied().unwrap_or(f64::NAN),
                c.cpu.get(cmp.worst_index).copied().unwrap_or(f64::NAN)
            ));
        }
    }
    failures
}

/// GPU 0, or `None` after saying why the test skipped (a failure under BRIGADE_REQUIRE_CUDA=1).
fn gpu_or_skip(test: &str) -> Option<Device> {
    match brigade_tensor::testing::device_if_available(Device::Cuda(0)) {
        Ok(d) => Some(d),
        Err(e) if brigade_tensor::testing::cuda_required() => panic!("{test}: BRIGADE_REQUIRE_CUDA=1 but {e}"),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: needs a GPU: {e}");
            None
        }
    }
}

#[test]
fn f32_ops_match_the_cpu() {
    let Some(d) = gpu_or_skip("cuda_ops::f32_ops_match_the_cpu") else {
        return;
    };
    let failures = verdict(d, DType::F32, &parity(d, DType::F32), false);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn f64_ops_match_the_cpu() {
    let Some(d) = gpu_or_skip("cuda_ops::f64_ops_match_the_cpu") else {
        return;
    };
    let failures = verdict(d, DType::F64, &parity(d, DType::F64), false);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_harness_is_exact_on_the_fake_device_and_catches_one_wrong_element() {
    for dtype in [DType::F32, DType::F64] {
        let d = Device::Fake(3);
        let mut cases = parity(d, dtype);
        assert!(cases.len() >= 40, "{} cases", cases.len());
        let failures = verdict(d, dtype, &cases, true);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        // a doctored result: one element of one op off by 1e-3 (outside every GPU tolerance)
        let c = cases.iter_mut().find(|c| c.name.starts_with("layer_norm")).unwrap();
        c.dev[3] += 1e-3;
        let failures = verdict(d, dtype, &cases, false);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("1 of"), "{}", failures[0]);
    }
}

#[test]
fn the_probe_and_the_test_device_agree() {
    // the CUDA parity tests run exactly when cuda:0 can be used
    let usable = brigade_tensor::testing::device_if_available(Device::Cuda(0)).is_ok();
    assert_eq!(usable, probe::require(0).is_ok());
}

// ---- NaN rules: as on the CPU (PyTorch's), on every device, in f32 and f64

fn nan_propagates_through_relu_max_softmax_and_cross_entropy(d: Device) {
    for dtype in [DType::F32, DType::F64] {
        let on = |v: Vec<f64>, shape: &[usize]| Tensor::from_f64_vec(v, shape, dtype).to_device(d).unwrap();
        let nan = f64::NAN;
        let relu = on(vec![nan, -1.0, 2.0], &[3]).relu().unwrap().to_f64_vec().unwrap();
        assert!(
            relu[0].is_nan() && relu[1] == 0.0 && relu[2] == 2.0,
            "{dtype} relu {relu:?}"
        );
        // a NaN first, in the middle, last: the row's max is NaN wherever it comes; a row
        // without NaN is unaffected
        let rows = on(
            vec![nan, 1.0, 2.0, 1.0, nan, 2.0, 1.0, 2.0, nan, 1.0, 3.0, 2.0],
            &[4, 3],
        );
        let m = rows.max_dim(1, false).unwrap().to_f64_vec().unwrap();
        assert!(m[..3].iter().all(|x| x.is_nan()) && m[3] == 3.0, "{dtype} max {m:?}");
        let s = rows.softmax_last().unwrap().to_f64_vec().unwrap();
        assert!(s[..9].iter().all(|x| x.is_nan()), "{dtype} softmax {s:?}");
        assert!(s[9..].iter().all(|x| x.is_finite()), "{dtype} softmax {s:?}");
        let t = Tensor::from_vec(vec![1i64, 1, 1, 0], &[4])
            .unwrap()
            .to_device(d)
            .unwrap();
        let (loss, _) = rows
            .narrow(0, 3, 1)
            .unwrap()
            .cross_entropy(&t.narrow(0, 3, 1).unwrap())
            .unwrap();
        assert!(loss.item().unwrap().is_finite());
        let (loss, _) = rows.cross_entropy(&t).unwrap();
        assert!(loss.item().unwrap().is_nan(), "{dtype} cross-entropy of a NaN row");
    }
}
test_device!(nan_propagates_through_relu_max_softmax_and_cross_entropy);

/// The sort's order, as the CPU's, on every device and float dtype: NaN above every number
/// (first when descending), `-0.0` equal to `0.0` (so their positions decide), ties by
/// lower position, in rows sorted in one block and in rows of several tiles merged; and
/// scatter-add's sums with repeated ids, 16-bit storages widened to f32 and rounded once.
/// Values and indices equal the CPU's bit for bit.
fn sort_and_scatter_add_match_the_cpu_bit_for_bit_with_nans_and_signed_zeros(d: Device) {
    let pool = [-1.5, -0.0, 0.0, 2.0, 3.25, f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
    let bits = |t: &Tensor| -> Vec<u64> {
        let v = t.to_dtype(DType::F64).unwrap().to_f64_vec().unwrap();
        v.into_iter()
            .map(|x| if x.is_nan() { 1 } else { x.to_bits() })
            .collect()
    };
    let mut rng = Rng::new(41);
    for (rows, n) in [(4, 50), (3, 2600)] {
        let v: Vec<f64> = (0..rows * n).map(|_| pool[rng.below(8) as usize]).collect();
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let cpu = Tensor::from_f64_vec(v.clone(), &[rows, n], dtype);
            let dev = cpu.to_device(d).unwrap();
            for descending in [false, true] {
                let (cv, ci) = cpu.sort(descending).unwrap();
                let (dv, di) = dev.sort(descending).unwrap();
                assert_eq!(
                    di.to_vec::<i64>().unwrap(),
                    ci.to_vec::<i64>().unwrap(),
                    "{dtype} {rows}x{n}"
                );
                assert_eq!(bits(&dv), bits(&cv), "{dtype} {rows}x{n} descending {descending}");
            }
            let (cv, ci) = cpu.topk(7).unwrap();
            let (dv, di) = dev.topk(7).unwrap();
            assert_eq!(di.to_vec::<i64>().unwrap(), ci.to_vec::<i64>().unwrap(), "{dtype} topk");
            assert_eq!(bits(&dv), bits(&cv), "{dtype} topk");
        }
    }
    let ids: Vec<i64> = (0..600).map(|_| rng.below(40) as i64).collect();
    let src: Vec<f64> = (0..600).map(|_| rng.normal()).collect();
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let i = Tensor::from_vec(ids.clone(), &[600]).unwrap();
        let s = Tensor::from_f64_vec(src.clone(), &[600], dtype);
        let base = Tensor::from_f64_vec((0..40).map(|x| x as f64 * 0.1).collect(), &[40], dtype);
        let want = base.index_add(0, &i, &s).unwrap();
        let on = |t: &Tensor| t.to_device(d).unwrap();
        let got = on(&base).index_add(0, &on(&i), &on(&s)).unwrap();
        assert_eq!(bits(&got), bits(&want), "{dtype} index_add");
    }
}
test_device!(sort_and_scatter_add_match_the_cpu_bit_for_bit_with_nans_and_signed_zeros);
