//! The CPU's GEMM libraries side by side: oneDNN (loaded at run time) and the `gemm` crate each
//! match an f64 reference on plain, transposed, strided, batched and biased products, the path
//! chosen is reported, and oneDNN's results do not change from run to run with two rank threads.
//! Where oneDNN is not installed its halves are skipped, except under `CI=true` (CI installs
//! `libdnnl2`), where that is a failure.

use std::sync::Mutex;

use brigade_tensor::{cpu_gemm_name, set_compute_threads, set_cpu_gemm, CpuGemm, DType, Rng, Tensor};

/// The tests here switch the process's GEMM library; one at a time.
static SWITCH: Mutex<()> = Mutex::new(());

/// The paths this machine can run: the `gemm` crate, and oneDNN where it loads.
fn paths() -> Vec<CpuGemm> {
    match set_cpu_gemm(CpuGemm::OneDnn) {
        Ok(()) => vec![CpuGemm::GemmCrate, CpuGemm::OneDnn],
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => panic!("CI=true but {e}"),
        Err(_) => vec![CpuGemm::GemmCrate],
    }
}

/// `got` (f32) against the same product in f64 on the same values: within 1e-5 of the
/// reference's magnitude (sums of up to 70 products of N(0,1) values, rounded in f32).
fn close(what: &str, path: CpuGemm, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what} ({path:?})");
    let (g, w) = (got.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()) * 8.0,
            "{what} ({path:?}): element {i} is {g}, the f64 reference {w}"
        );
    }
}

#[test]
fn both_libraries_match_f64_on_strided_transposed_and_batched_products() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(5);
    let f32s = |shape: &[usize], rng: &mut Rng| {
        let t = Tensor::randn(shape, 1.0, DType::F32, rng);
        let w = t.to_dtype(DType::F64).unwrap();
        (t, w)
    };
    let (a, aw) = f32s(&[37, 53], &mut rng);
    let (b, bw) = f32s(&[53, 29], &mut rng);
    let (wt, wtw) = f32s(&[29, 53], &mut rng); // a weight, used through its transpose
    let (wide, widew) = f32s(&[37, 70], &mut rng); // columns 5..58 of it: row stride 70
    let (bias, biasw) = f32s(&[29], &mut rng);
    let (p, pw) = f32s(&[3, 33, 17], &mut rng); // used as [3, 17, 33]
    let (q, qw) = f32s(&[3, 33, 9], &mut rng);
    let (big, bigw) = f32s(&[130, 96], &mut rng); // large enough to run threaded
    let (big2, big2w) = f32s(&[96, 140], &mut rng);
    for path in paths() {
        set_cpu_gemm(path).unwrap();
        close("plain", path, &a.matmul(&b).unwrap(), &aw.matmul(&bw).unwrap());
        let (t, tw) = (wt.t().unwrap(), wtw.t().unwrap());
        close("transposed rhs", path, &a.matmul(&t).unwrap(), &aw.matmul(&tw).unwrap());
        let (at, atw) = (a.t().unwrap(), aw.t().unwrap());
        close(
            "transposed lhs",
            path,
            &at.matmul(&a).unwrap(),
            &atw.matmul(&aw).unwrap(),
        );
        let (s, sw) = (wide.narrow(1, 5, 53).unwrap(), widew.narrow(1, 5, 53).unwrap());
        close("row stride 70", path, &s.matmul(&b).unwrap(), &sw.matmul(&bw).unwrap());
        close(
            "bias, transposed weight",
            path,
            &a.matmul_bias(&t, &bias).unwrap(),
            &aw.matmul_bias(&tw, &biasw).unwrap(),
        );
        let (pt, ptw) = (p.transpose(1, 2).unwrap(), pw.transpose(1, 2).unwrap());
        close("batched", path, &pt.matmul(&q).unwrap(), &ptw.matmul(&qw).unwrap());
        let (q0, q0w) = (q.narrow(0, 1, 1).unwrap(), qw.narrow(0, 1, 1).unwrap());
        close(
            "broadcast batch",
            path,
            &pt.matmul(&q0).unwrap(),
            &ptw.matmul(&q0w).unwrap(),
        );
        close(
            "threaded",
            path,
            &big.matmul(&big2).unwrap(),
            &bigw.matmul(&big2w).unwrap(),
        );
        // a column vector times a row: k = 1
        let (c, cw) = (a.narrow(1, 0, 1).unwrap(), aw.narrow(1, 0, 1).unwrap());
        let (r, rw) = (b.narrow(0, 0, 1).unwrap(), bw.narrow(0, 0, 1).unwrap());
        close("k = 1", path, &c.matmul(&r).unwrap(), &cw.matmul(&rw).unwrap());
    }
}

#[test]
fn the_path_chosen_is_reported() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    for path in paths() {
        set_cpu_gemm(path).unwrap();
        let name = cpu_gemm_name().unwrap();
        match path {
            CpuGemm::GemmCrate => assert_eq!(name, "gemm crate"),
            // "onednn 2.6.3 (avx512_core)": the version and the instruction set it runs
            CpuGemm::OneDnn => assert!(name.starts_with("onednn 2.") && name.contains('('), "{name}"),
        }
    }
}

/// Two rank threads of two compute threads each, computing the same products three times each:
/// every result equal to the first, bit for bit.
#[test]
fn onednn_results_are_the_same_run_to_run_with_two_rank_threads() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    if !paths().contains(&CpuGemm::OneDnn) {
        return;
    }
    set_cpu_gemm(CpuGemm::OneDnn).unwrap();
    let mut rng = Rng::new(9);
    let x = Tensor::randn(&[256, 384], 1.0, DType::F32, &mut rng);
    let w = Tensor::randn(&[320, 384], 1.0, DType::F32, &mut rng);
    let h = Tensor::randn(&[4, 64, 96], 1.0, DType::F32, &mut rng);
    // one row times a long inner dimension: oneDNN's threads split the sum itself here, so its
    // bits depend on the thread count
    let (u, v) = (
        Tensor::randn(&[1, 65536], 1.0, DType::F32, &mut rng),
        Tensor::randn(&[65536, 48], 1.0, DType::F32, &mut rng),
    );
    let run = || {
        let (x, w, h, u, v) = (x.clone(), w.clone(), h.clone(), u.clone(), v.clone());
        std::thread::spawn(move || {
            set_compute_threads(2);
            (0..3)
                .map(|_| {
                    let y = x.matmul(&w.t().unwrap()).unwrap().to_vec::<f32>().unwrap();
                    let z = h.matmul(&h.transpose(1, 2).unwrap()).unwrap().to_vec::<f32>().unwrap();
                    let s = u.matmul(&v).unwrap().to_vec::<f32>().unwrap();
                    (y, z, s)
                })
                .collect::<Vec<_>>()
        })
    };
    let (r0, r1) = (run(), run());
    let all: Vec<_> = [r0.join().unwrap(), r1.join().unwrap()].concat();
    for (i, r) in all.iter().enumerate() {
        assert!(
            r.0.iter().zip(&all[0].0).all(|(a, b)| a.to_bits() == b.to_bits()),
            "run {i}: the product differs from the first run's"
        );
        assert!(
            r.1.iter().zip(&all[0].1).all(|(a, b)| a.to_bits() == b.to_bits()),
            "run {i}: the batched product differs from the first run's"
        );
        assert!(
            r.2.iter().zip(&all[0].2).all(|(a, b)| a.to_bits() == b.to_bits()),
            "run {i}: the long-sum product differs from the first run's"
        );
    }
}

/// bf16 on either path (oneDNN's AMX matmul where the CPU has AMX): each output the f64 product
/// of the bf16 values rounded once, or one bf16 unit from it (plus 1e-4 where a sum cancels).
#[test]
fn bf16_products_round_once_on_both_paths() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(11);
    let bf = |shape: &[usize], rng: &mut Rng| {
        let t = Tensor::randn(shape, 1.0, DType::F32, rng)
            .to_dtype(DType::BF16)
            .unwrap();
        let w = t.to_dtype(DType::F64).unwrap();
        (t, w)
    };
    let (a, aw) = bf(&[64, 96], &mut rng);
    let (w, ww) = bf(&[48, 96], &mut rng);
    let (bias, biasw) = bf(&[48], &mut rng);
    let (p, pw) = bf(&[4, 32, 64], &mut rng);
    for path in paths() {
        set_cpu_gemm(path).unwrap();
        let cases = [
            (
                "transposed weight",
                a.matmul(&w.t().unwrap()).unwrap(),
                aw.matmul(&ww.t().unwrap()).unwrap(),
            ),
            (
                "bias",
                a.matmul_bias(&w.t().unwrap(), &bias).unwrap(),
                aw.matmul_bias(&ww.t().unwrap(), &biasw).unwrap(),
            ),
            (
                "batched",
                p.matmul(&p.transpose(1, 2).unwrap()).unwrap(),
                pw.matmul(&pw.transpose(1, 2).unwrap()).unwrap(),
            ),
        ];
        for (what, got, want) in cases {
            assert_eq!(got.dtype(), DType::BF16, "{what} ({path:?})");
            let (g, w) = (got.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
            for (i, (g, w)) in g.iter().zip(&w).enumerate() {
                // bf16 keeps 8 significant bits: one unit is 2^(exponent - 7)
                let unit = 2f64.powi(w.abs().max(1e-30).log2().floor() as i32 - 7);
                assert!(
                    (g - w).abs() <= unit * 1.01 + 1e-4,
                    "{what} ({path:?}): element {i} is {g}, the f64 reference {w}"
                );
            }
        }
    }
}

/// A product's output is written whole, whatever its memory held before: each product runs just
/// after a tensor of NaNs of the output's size is freed (the allocator hands that memory out
/// again), on both paths, f32 and f64, plain, batched (one thread and two) and with `k = 0`.
#[test]
fn a_product_writes_every_element_of_its_output() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(9);
    let cases: [(&[usize], &[usize]); 4] = [
        (&[64, 48], &[48, 40]),
        (&[300, 70], &[70, 200]),
        (&[4, 16, 24], &[4, 24, 20]),
        (&[6, 0], &[0, 7]),
    ];
    for path in paths() {
        set_cpu_gemm(path).unwrap();
        for threads in [1, 2] {
            set_compute_threads(threads);
            for dtype in [DType::F32, DType::F64] {
                for (sa, sb) in cases {
                    let a = Tensor::randn(sa, 1.0, dtype, &mut rng);
                    let b = Tensor::randn(sb, 1.0, dtype, &mut rng);
                    let want = a
                        .to_dtype(DType::F64)
                        .unwrap()
                        .matmul(&b.to_dtype(DType::F64).unwrap())
                        .unwrap();
                    let len: usize = want.shape().iter().product();
                    for _ in 0..3 {
                        drop(
                            Tensor::from_vec(vec![f64::NAN; len], &[len])
                                .unwrap()
                                .to_dtype(dtype)
                                .unwrap(),
                        );
                        let got = a.matmul(&b).unwrap();
                        close(
                            &format!("{sa:?} x {sb:?} {dtype:?}, {threads} threads"),
                            path,
                            &got,
                            &want,
                        );
                    }
                }
            }
        }
    }
    set_compute_threads(1);
}
