//! Every CUDA kernel against Brigade's CPU ops on the same data (forward and backward),
//! on GPU 0. These need a GPU: without one each test says plainly that it skipped and why
//! (`scripts/gpu-check.sh` sets `BRIGADE_REQUIRE_CUDA=1`, which turns a skip into a failure).

use std::io::Write;
use std::sync::Arc;

use brigade_tensor::cuda::{CudaDevice, CudaStorage};
use brigade_tensor::{DType, Layout, Rng, Tensor};

/// GPU 0, or `None` after saying why the test skipped.
fn gpu_or_skip(test: &str) -> Option<Arc<CudaDevice>> {
    match CudaDevice::get(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("BRIGADE_REQUIRE_CUDA").as_deref() == Ok("1") => {
            panic!("{test}: BRIGADE_REQUIRE_CUDA=1 but {e}")
        }
        Err(e) => {
            // The real stderr, so a plain `cargo test` shows the skip.
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: needs a GPU: {e}");
            None
        }
    }
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, 1.0, DType::F64, &mut Rng::new(seed))
}

/// The tensor's contiguous f64 data on the GPU.
fn up(dev: &Arc<CudaDevice>, t: &Tensor) -> CudaStorage {
    CudaStorage::from_host(dev, &t.contiguous().unwrap().to_vec::<f64>().unwrap()).unwrap()
}

fn up_ids(dev: &Arc<CudaDevice>, ids: &[i64]) -> CudaStorage {
    CudaStorage::from_host(dev, ids).unwrap()
}

fn c(shape: &[usize]) -> Layout {
    Layout::contiguous(shape)
}

/// Worst absolute difference, reported with its position.
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (i, d) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .enumerate()
        .fold((0, 0.0), |a, (i, d)| if d > a.1 || d.is_nan() { (i, d) } else { a });
    assert!(
        d <= tol,
        "{what}: worst element {i}: GPU {} vs CPU {} (|diff| {d} > {tol})",
        got[i],
        want[i]
    );
}

fn host(s: &CudaStorage) -> Vec<f64> {
    s.to_host::<f64>().unwrap()
}

#[test]
fn unary_and_binary_kernels_match_the_cpu() {
    let Some(dev) = gpu_or_skip("unary_and_binary_kernels_match_the_cpu") else {
        return;
    };
    let x = randn(&[4, 6], 1);
    let xt = x.t().unwrap(); // a transposed view: kernels read it in place
    let gx = up(&dev, &x);
    let lt = c(&[4, 6]).transpose(0, 1).unwrap();
    let pos = x.sqr().unwrap().add_scalar(0.5).unwrap();
    let gpos = up(&dev, &pos);
    let cases: Vec<(&str, f64, f64, Tensor, &CudaStorage, Layout)> = vec![
        ("neg", 0.0, 0.0, xt.neg().unwrap(), &gx, lt.clone()),
        ("exp", 0.0, 0.0, xt.exp().unwrap(), &gx, lt.clone()),
        ("ln", 0.0, 0.0, pos.ln().unwrap(), &gpos, c(&[4, 6])),
        ("sqrt", 0.0, 0.0, pos.sqrt().unwrap(), &gpos, c(&[4, 6])),
        ("relu", 0.0, 0.0, xt.relu().unwrap(), &gx, lt.clone()),
        ("gelu", 0.0, 0.0, xt.gelu().unwrap(), &gx, lt.clone()),
        ("sqr", 0.0, 0.0, xt.sqr().unwrap(), &gx, lt.clone()),
        ("affine", 2.5, -1.0, xt.affine(2.5, -1.0).unwrap(), &gx, lt.clone()),
        ("powf", 1.5, 0.0, pos.powf(1.5).unwrap(), &gpos, c(&[4, 6])),
    ];
    for (name, p0, p1, want, g, l) in cases {
        let got = g.unary_kernel(&l, name, p0, p1).unwrap();
        assert_close(name, &host(&got), &want.to_vec::<f64>().unwrap(), 1e-12);
    }
    // broadcasting: [3,1] with [4] -> [3,4]
    let (a, b) = (randn(&[3, 1], 2), randn(&[4], 3));
    let (ga, gb) = (up(&dev, &a), up(&dev, &b));
    let (la, lb) = (
        c(&[3, 1]).broadcast_to(&[3, 4]).unwrap(),
        c(&[4]).broadcast_to(&[3, 4]).unwrap(),
    );
    let want = |f: fn(&Tensor, &Tensor) -> brigade_tensor::Result<Tensor>| f(&a, &b).unwrap().to_vec::<f64>().unwrap();
    for (name, w) in [
        ("add", want(Tensor::add)),
        ("sub", want(Tensor::sub)),
        ("mul", want(Tensor::mul)),
        ("div", want(Tensor::div)),
        ("relu_backward", want(Tensor::relu_backward)),
        ("gelu_backward", want(Tensor::gelu_backward)),
    ] {
        let got = ga.binary_kernel(&la, &gb, &lb, name).unwrap();
        assert_close(name, &host(&got), &w, 1e-12);
    }
}

#[test]
fn reductions_copies_and_casts_match_the_cpu() {
    let Some(dev) = gpu_or_skip("reductions_copies_and_casts_match_the_cpu") else {
        return;
    };
    let x = randn(&[3, 4, 5], 4);
    let g = up(&dev, &x);
    let l = c(&[3, 4, 5]);
    assert_close(
        "sum dim 1",
        &host(&g.reduce(&l, &[1], false).unwrap()),
        &x.sum(&[1], false).unwrap().to_vec().unwrap(),
        1e-12,
    );
    assert_close(
        "sum dims 0,2",
        &host(&g.reduce(&l, &[0, 2], false).unwrap()),
        &x.sum(&[0, 2], false).unwrap().to_vec().unwrap(),
        1e-12,
    );
    assert_close(
        "max dim 2",
        &host(&g.reduce(&l, &[2], true).unwrap()),
        &x.max_dim(2, false).unwrap().to_vec().unwrap(),
        0.0,
    );
    let p = l.permute(&[2, 0, 1]).unwrap();
    assert_close(
        "gather",
        &host(&g.copy_strided(&p).unwrap()),
        &x.permute(&[2, 0, 1]).unwrap().to_vec().unwrap(),
        0.0,
    );
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::I64, DType::U8] {
        let back = g
            .to_dtype(&p, dtype)
            .unwrap()
            .to_dtype(&c(&[5, 3, 4]), DType::F64)
            .unwrap();
        let want = x
            .permute(&[2, 0, 1])
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        assert_close(
            &format!("cast via {dtype:?}"),
            &host(&back),
            &want.to_vec().unwrap(),
            0.0,
        );
    }
    // fill and accumulate through a narrowed view of a flat buffer (a bucket)
    let mut flat = CudaStorage::zeros(&dev, DType::F64, 10).unwrap();
    let view = Layout::contiguous(&[10])
        .narrow(0, 4, 6)
        .unwrap()
        .reshape(&[2, 3])
        .unwrap();
    flat.fill(&view, 1.5).unwrap();
    let src = up(&dev, &Tensor::ones(&[2, 3], DType::F64));
    flat.add_scaled_assign(&view, (&src, &c(&[2, 3])), 2.0).unwrap();
    assert_eq!(host(&flat), vec![0.0, 0.0, 0.0, 0.0, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5]);
    // copy through a transposed view, bit for bit (-0.0 stays -0.0), and an integer dtype
    let mut dst = CudaStorage::zeros(&dev, DType::F64, 6).unwrap();
    let src = CudaStorage::from_host(&dev, &[-0.0f64, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    dst.copy_from(&c(&[3, 2]).transpose(0, 1).unwrap(), (&src, &c(&[2, 3])))
        .unwrap();
    let got = host(&dst);
    assert_eq!(got, vec![-0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    assert!(got[0].is_sign_negative(), "-0.0 must survive the copy");
    let mut ids = CudaStorage::zeros(&dev, DType::I64, 4).unwrap();
    ids.copy_from(
        &Layout::contiguous(&[4]).narrow(0, 1, 2).unwrap(),
        (&up_ids(&dev, &[7, -9]), &c(&[2])),
    )
    .unwrap();
    assert_eq!(ids.to_host::<i64>().unwrap(), vec![0, 7, -9, 0]);
    // no dims to reduce: a copy of the view
    assert_close(
        "reduce over no dims",
        &host(&g.reduce(&p, &[], false).unwrap()),
        &x.permute(&[2, 0, 1]).unwrap().to_vec().unwrap(),
        0.0,
    );
}

#[test]
fn matmul_through_cublas_matches_the_cpu_for_every_layout() {
    let Some(dev) = gpu_or_skip("matmul_through_cublas_matches_the_cpu_for_every_layout") else {
        return;
    };
    let (b, t, h, hd) = (2, 5, 3, 4);
    let q = randn(&[b, t, h, hd], 5);
    let k = randn(&[b, t, h, hd], 6);
    let (gq, gk) = (up(&dev, &q), up(&dev, &k));
    let lq = c(&[b, t, h, hd]).permute(&[0, 2, 1, 3]).unwrap();
    let lk = lq.transpose(2, 3).unwrap();
    let want = q
        .permute(&[0, 2, 1, 3])
        .unwrap()
        .matmul(&k.permute(&[0, 2, 1, 3]).unwrap().transpose(2, 3).unwrap())
        .unwrap();
    assert_close(
        "q · kᵀ",
        &host(&gq.matmul(&lq, &gk, &lk).unwrap()),
        &want.to_vec().unwrap(),
        1e-12,
    );
    let (x, w) = (randn(&[7, 5], 7), randn(&[3, 5], 8));
    let (gx, gw) = (up(&dev, &x), up(&dev, &w));
    let want = x.matmul(&w.t().unwrap()).unwrap();
    let got = gx
        .matmul(&c(&[7, 5]), &gw, &c(&[3, 5]).transpose(0, 1).unwrap())
        .unwrap();
    assert_close("x · wᵀ", &host(&got), &want.to_vec().unwrap(), 1e-12);
    // a broadcast row as the lhs needs the gather fallback
    let row = c(&[1, 5]).broadcast_to(&[7, 5]).unwrap();
    let got = gx.matmul(&row, &gw, &c(&[3, 5]).transpose(0, 1).unwrap()).unwrap();
    let want = x
        .narrow(0, 0, 1)
        .unwrap()
        .broadcast_to(&[7, 5])
        .unwrap()
        .matmul(&w.t().unwrap())
        .unwrap();
    assert_close("broadcast lhs", &host(&got), &want.to_vec().unwrap(), 1e-12);
    // f32 (true f32: TF32 would miss 1e-4 on k = 512), f16 and bf16 with f32 accumulation
    let (a, bm) = (randn(&[64, 512], 9), randn(&[512, 48], 10));
    let want = a.matmul(&bm).unwrap().to_vec::<f64>().unwrap();
    for (dtype, tol) in [(DType::F32, 1e-3), (DType::BF16, 0.5), (DType::F16, 0.1)] {
        let (ga, gb) = (
            up(&dev, &a).to_dtype(&c(&[64, 512]), dtype).unwrap(),
            up(&dev, &bm).to_dtype(&c(&[512, 48]), dtype).unwrap(),
        );
        let got = ga
            .matmul(&c(&[64, 512]), &gb, &c(&[512, 48]))
            .unwrap()
            .to_dtype(&c(&[64, 48]), DType::F64)
            .unwrap();
        assert_close(&format!("{dtype:?} GEMM"), &host(&got), &want, tol);
    }
}

#[test]
fn nn_kernels_and_their_backwards_match_the_cpu() {
    let Some(dev) = gpu_or_skip("nn_kernels_and_their_backwards_match_the_cpu") else {
        return;
    };
    let x = randn(&[6, 300], 11); // rows longer than a block
    let g = randn(&[6, 300], 12);
    let (gx, gg, l) = (up(&dev, &x), up(&dev, &g), c(&[6, 300]));
    for log in [false, true] {
        let y = if log { x.log_softmax_last() } else { x.softmax_last() }.unwrap();
        let gy = gx.softmax_last(&l, log).unwrap();
        assert_close("softmax", &host(&gy), &y.to_vec().unwrap(), 1e-12);
        let want = if log {
            y.log_softmax_backward(&g)
        } else {
            y.softmax_backward(&g)
        }
        .unwrap();
        assert_close(
            "softmax backward",
            &host(&gy.softmax_backward(&l, &gg, &l, log).unwrap()),
            &want.to_vec().unwrap(),
            1e-12,
        );
    }
    let (w, b) = (randn(&[300], 13), randn(&[300], 14));
    let (gw, gb, lw) = (up(&dev, &w), up(&dev, &b), c(&[300]));
    let (y, saved) = x.layer_norm(&w, &b, 1e-5).unwrap();
    let (gy, gm, gr) = gx.layer_norm(&l, (&gw, &lw), (&gb, &lw), 1e-5).unwrap();
    assert_close("layer norm", &host(&gy), &y.to_vec().unwrap(), 1e-10);
    let (dx, dw, db) = x.layer_norm_backward(&w, &saved, &g).unwrap();
    let (gdx, gdw, gdb) = gx
        .layer_norm_backward(&l, (&gw, &lw), (&gm, &c(&[6])), (&gr, &c(&[6])), (&gg, &l))
        .unwrap();
    assert_close("layer norm dx", &host(&gdx), &dx.to_vec().unwrap(), 1e-10);
    assert_close("layer norm dw", &host(&gdw), &dw.to_vec().unwrap(), 1e-10);
    assert_close("layer norm db", &host(&gdb), &db.to_vec().unwrap(), 1e-10);
    // embedding with a repeated id, and its scatter-add backward
    let table = randn(&[5, 3], 15);
    let ids = [4i64, 0, 4, 2];
    let idt = Tensor::from_vec(ids.to_vec(), &[4]).unwrap();
    let (gt, gi) = (up(&dev, &table), up_ids(&dev, &ids));
    let e = gt.embedding(&c(&[5, 3]), (&gi, &c(&[4]))).unwrap();
    assert_close(
        "embedding",
        &host(&e),
        &table.embedding(&idt).unwrap().to_vec().unwrap(),
        0.0,
    );
    let ge = randn(&[4, 3], 16);
    let back = up(&dev, &ge)
        .embedding_backward(&c(&[4, 3]), (&gi, &c(&[4])), 5)
        .unwrap();
    assert_close(
        "embedding backward",
        &host(&back),
        &ge.embedding_backward(&idt, 5).unwrap().to_vec().unwrap(),
        1e-12,
    );
    let bad = up_ids(&dev, &[1, 5]);
    assert!(
        gt.embedding(&c(&[5, 3]), (&bad, &c(&[2]))).is_err(),
        "id 5 of a 5-row table must be refused"
    );
    // causal mask on [2, 3, 4] scores (t < s)
    let s = randn(&[2, 3, 4], 17);
    let got = up(&dev, &s).causal_fill(&c(&[2, 3, 4]), -1e9).unwrap();
    assert_close(
        "causal fill",
        &host(&got),
        &s.causal_fill(-1e9).unwrap().to_vec().unwrap(),
        0.0,
    );
    // cross-entropy and its backward
    let logits = randn(&[4, 7], 18);
    let targets = [6i64, 0, 3, 3];
    let tt = Tensor::from_vec(targets.to_vec(), &[4]).unwrap();
    let (loss, probs) = logits.cross_entropy(&tt).unwrap();
    let (gl, gp) = up(&dev, &logits)
        .cross_entropy(&c(&[4, 7]), (&up_ids(&dev, &targets), &c(&[4])))
        .unwrap();
    assert_close("cross-entropy", &host(&gl), &loss.to_vec().unwrap(), 1e-12);
    assert_close("probs", &host(&gp), &probs.to_vec().unwrap(), 1e-12);
    let gb = gp
        .cross_entropy_backward(&c(&[4, 7]), (&up_ids(&dev, &targets), &c(&[4])), 0.5)
        .unwrap();
    assert_close(
        "cross-entropy backward",
        &host(&gb),
        &probs.cross_entropy_backward(&tt, 0.5).unwrap().to_vec().unwrap(),
        1e-12,
    );
}

#[test]
fn fused_optimizer_steps_match_the_cpu_arithmetic_bit_for_bit() {
    let Some(dev) = gpu_or_skip("fused_optimizer_steps_match_the_cpu_arithmetic_bit_for_bit") else {
        return;
    };
    let n = 1000;
    let v = |seed| {
        Tensor::randn(&[n], 1.0, DType::F32, &mut Rng::new(seed))
            .to_vec::<f32>()
            .unwrap()
    };
    let (p0, g) = (v(20), v(21));
    let l = c(&[n]);
    // SGD, as crates/autograd/src/optim.rs: two steps with momentum and weight decay
    let (lr, mom, wd) = (0.1f32, 0.9f32, 0.01f32);
    let (mut p, mut buf) = (p0.clone(), vec![0f32; n]);
    for first in [true, false] {
        for i in 0..n {
            let mut gi = g[i] + wd * p[i];
            buf[i] = if first { gi } else { mom * buf[i] + gi };
            gi = buf[i];
            p[i] -= lr * gi;
        }
    }
    let (mut gp, gg) = (
        CudaStorage::from_host(&dev, &p0).unwrap(),
        CudaStorage::from_host(&dev, &g).unwrap(),
    );
    let mut gbuf = CudaStorage::zeros(&dev, DType::F32, n).unwrap();
    for first in [true, false] {
        gp.sgd_step(&l, (&gg, &l), Some((&mut gbuf, &l)), lr, mom, wd, first)
            .unwrap();
    }
    assert_eq!(gp.to_host::<f32>().unwrap(), p, "SGD parameters");
    assert_eq!(gbuf.to_host::<f32>().unwrap(), buf, "SGD momentum buffer");
    // AdamW step 1 with PyTorch's defaults and lr 1e-3
    let (lr, b1, b2, eps, wdecay) = (1e-3f64, 0.9f64, 0.999f64, 1e-8f64, 0.01f64);
    let s = [
        (1.0 - lr * wdecay) as f32,
        b1 as f32,
        (1.0 - b1) as f32,
        b2 as f32,
        (1.0 - b2) as f32,
        (lr / (1.0 - b1)) as f32,
        (1.0 - b2).sqrt() as f32,
        eps as f32,
    ];
    let (mut p, mut m, mut vv) = (p0.clone(), vec![0f32; n], vec![0f32; n]);
    for i in 0..n {
        p[i] *= s[0];
        m[i] = s[1] * m[i] + s[2] * g[i];
        vv[i] = s[3] * vv[i] + s[4] * g[i] * g[i];
        p[i] -= s[5] * m[i] / (vv[i].sqrt() / s[6] + s[7]);
    }
    let mut gp = CudaStorage::from_host(&dev, &p0).unwrap();
    let (mut gm, mut gv) = (
        CudaStorage::zeros(&dev, DType::F32, n).unwrap(),
        CudaStorage::zeros(&dev, DType::F32, n).unwrap(),
    );
    gp.adamw_step(&l, (&gg, &l), (&mut gm, &l), (&mut gv, &l), s).unwrap();
    assert_eq!(gp.to_host::<f32>().unwrap(), p, "AdamW parameters");
    assert_eq!(gm.to_host::<f32>().unwrap(), m, "AdamW exp_avg");
    assert_eq!(gv.to_host::<f32>().unwrap(), vv, "AdamW exp_avg_sq");
}
