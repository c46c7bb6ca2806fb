//! The view → cuBLAS argument mapping, checked on the CPU: each plan is executed by a
//! tiny column-major reference GEMM with cuBLAS's exact semantics (`op`, leading
//! dimensions, strided batches, one call per offset triple) over the raw host storage,
//! and must reproduce Brigade's CPU matmul of the same views, for every layout the ops
//! use: plain, transposed, narrowed, batched, broadcast batch, attention's permuted views.

use super::{plan_gemm, transposed_operand, GemmPlan, Operand, PlanError, Transpose};
use crate::{Layout, Rng, Tensor};

/// cuBLAS's `C = op(A) op(B)` for every call and batch of `plan`, column-major, into a
/// zeroed output of `out_len` elements. `a` is the rhs storage, `b` the lhs storage.
fn run_like_cublas(plan: &GemmPlan, a: &[f64], b: &[f64], out_len: usize) -> Vec<f64> {
    let mut c = vec![0.0; out_len];
    let op_a = |off: usize, i: usize, p: usize| match plan.transa {
        Transpose::No => a[off + i + p * plan.lda],
        Transpose::Yes => a[off + p + i * plan.lda],
    };
    let op_b = |off: usize, p: usize, j: usize| match plan.transb {
        Transpose::No => b[off + p + j * plan.ldb],
        Transpose::Yes => b[off + j + p * plan.ldb],
    };
    for call in &plan.calls {
        for bi in 0..plan.batch_count {
            let (oa, ob, oc) = (
                call.a + bi * plan.stride_a,
                call.b + bi * plan.stride_b,
                call.c + bi * plan.stride_c,
            );
            for i in 0..plan.m {
                for j in 0..plan.n {
                    let s: f64 = (0..plan.k).map(|p| op_a(oa, i, p) * op_b(ob, p, j)).sum();
                    c[oc + i + j * plan.ldc] = s;
                }
            }
        }
    }
    c
}

/// A view over a fresh random storage of `len` elements.
fn view(len: usize, layout: Layout, rng: &mut Rng) -> (Vec<f64>, Tensor) {
    let data = Tensor::randn(&[len], 1.0, crate::DType::F64, rng)
        .to_vec::<f64>()
        .unwrap();
    let t = Tensor::from_vec(data.clone(), &[len])
        .unwrap()
        .view_with_layout(layout)
        .unwrap();
    (data, t)
}

/// Plans `lhs · rhs` (views over raw storages), runs the plan like cuBLAS, and compares
/// with the CPU matmul of the same views (batch dims broadcast as matmul does).
fn check(name: &str, lhs: (Vec<f64>, Tensor), rhs: (Vec<f64>, Tensor)) -> GemmPlan {
    let (da, a) = lhs;
    let (db, b) = rhs;
    let want = a.matmul(&b).unwrap();
    let (ra, rb) = (a.rank(), b.rank());
    let batch = crate::broadcast_shape("test", &a.shape()[..ra - 2], &b.shape()[..rb - 2]).unwrap();
    let full = |t: &Tensor, r: usize| {
        let mut s = batch.clone();
        s.extend(&t.shape()[r - 2..]);
        t.layout().broadcast_to(&s).unwrap()
    };
    let plan = plan_gemm(&full(&a, ra), &full(&b, rb)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let got = run_like_cublas(&plan, &db, &da, want.numel());
    let want = want.to_vec::<f64>().unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() < 1e-10,
            "{name}: element {i}: cuBLAS-style {g} vs CPU {w}\nplan: {plan:?}"
        );
    }
    plan
}

fn contiguous(shape: &[usize], rng: &mut Rng) -> (Vec<f64>, Tensor) {
    view(shape.iter().product(), Layout::contiguous(shape), rng)
}

#[test]
fn plain_and_transposed_views_need_no_copy() {
    let mut rng = Rng::new(7);
    // x [5,3] · w [3,4]
    let p = check("plain", contiguous(&[5, 3], &mut rng), contiguous(&[3, 4], &mut rng));
    assert_eq!(
        (p.transa, p.transb, p.lda, p.ldb, p.ldc),
        (Transpose::No, Transpose::No, 4, 3, 4)
    );
    // x · wᵀ with w [4,3] (the linear layer's forward)
    let w = view(12, Layout::contiguous(&[4, 3]).transpose(0, 1).unwrap(), &mut rng);
    let p = check("rhs transposed", contiguous(&[5, 3], &mut rng), w);
    assert_eq!((p.transa, p.lda), (Transpose::Yes, 3));
    // gᵀ · x (the linear layer's weight gradient)
    let g = view(10, Layout::contiguous(&[5, 2]).transpose(0, 1).unwrap(), &mut rng);
    let p = check("lhs transposed", g, contiguous(&[5, 3], &mut rng));
    assert_eq!((p.transb, p.ldb), (Transpose::Yes, 2));
    // both transposed
    let a = view(6, Layout::contiguous(&[3, 2]).transpose(0, 1).unwrap(), &mut rng);
    let b = view(12, Layout::contiguous(&[4, 3]).transpose(0, 1).unwrap(), &mut rng);
    check("both transposed", a, b);
    // a narrowed column block of a wider matrix (qkv.narrow): leading dimension > columns
    let a = view(5 * 9, Layout::contiguous(&[5, 9]).narrow(1, 3, 3).unwrap(), &mut rng);
    let p = check("narrowed lhs", a, contiguous(&[3, 4], &mut rng));
    assert_eq!((p.transb, p.ldb, p.calls[0].b), (Transpose::No, 9, 3));
    // degenerate sizes: vectors and 1x1
    check("m = 1", contiguous(&[1, 3], &mut rng), contiguous(&[3, 4], &mut rng));
    check("n = 1", contiguous(&[5, 3], &mut rng), contiguous(&[3, 1], &mut rng));
    check("k = 1", contiguous(&[5, 1], &mut rng), contiguous(&[1, 4], &mut rng));
    check("1x1", contiguous(&[1, 1], &mut rng), contiguous(&[1, 1], &mut rng));
}

#[test]
fn batched_and_broadcast_batches_are_strided_batched_calls() {
    let mut rng = Rng::new(8);
    let p = check(
        "batched",
        contiguous(&[3, 4, 2], &mut rng),
        contiguous(&[3, 2, 5], &mut rng),
    );
    assert_eq!(
        (p.batch_count, p.calls.len(), p.stride_a, p.stride_b, p.stride_c),
        (3, 1, 10, 8, 20)
    );
    // [b, m, k] x [k, n] broadcast to [b, k, n]: stride 0 on the rhs
    let p = check(
        "broadcast rhs",
        contiguous(&[3, 4, 2], &mut rng),
        contiguous(&[2, 5], &mut rng),
    );
    assert_eq!((p.batch_count, p.stride_a), (3, 0));
    // two batch dims that merge into one: [2,3,m,k] x [2,3,k,n]
    let p = check(
        "merged batch",
        contiguous(&[2, 3, 4, 2], &mut rng),
        contiguous(&[2, 3, 2, 5], &mut rng),
    );
    assert_eq!((p.batch_count, p.calls.len()), (6, 1));
    // [2,1,m,k] x [1,3,k,n]: broadcast on different dims, one call per outer index
    let p = check(
        "cross broadcast",
        contiguous(&[2, 1, 4, 2], &mut rng),
        contiguous(&[1, 3, 2, 5], &mut rng),
    );
    assert_eq!(p.batch_count * p.calls.len(), 6);
    // a batched transposed rhs: [b, n, k] viewed as [b, k, n]
    let kt = view(
        3 * 5 * 2,
        Layout::contiguous(&[3, 5, 2]).transpose(1, 2).unwrap(),
        &mut rng,
    );
    check("batched transposed rhs", contiguous(&[3, 4, 2], &mut rng), kt);
}

#[test]
fn attention_views_map_without_copies() {
    // The GPT's attention: q, k, v are [B, T, H, hd] storages permuted to [B, H, T, hd];
    // scores = q · kᵀ, y = att · v.
    let mut rng = Rng::new(9);
    let (b, t, h, hd) = (2, 5, 3, 4);
    let bthd = Layout::contiguous(&[b, t, h, hd]).permute(&[0, 2, 1, 3]).unwrap();
    let q = view(b * t * h * hd, bthd.clone(), &mut rng);
    let k = view(b * t * h * hd, bthd.transpose(2, 3).unwrap(), &mut rng);
    let p = check("q · kᵀ", q, k);
    assert_eq!(p.transa, Transpose::Yes, "kᵀ is read transposed, not copied");
    assert_eq!(
        (p.batch_count, p.calls.len()),
        (h, b),
        "H products per call, one call per batch row"
    );
    let att = contiguous(&[b, h, t, t], &mut rng);
    let v = view(b * t * h * hd, bthd, &mut rng);
    check("att · v", att, v);
    // the backward's products: transposes of the same views
    let q = view(
        b * t * h * hd,
        Layout::contiguous(&[b, t, h, hd]).permute(&[0, 2, 1, 3]).unwrap(),
        &mut rng,
    );
    let gt = view(
        b * h * t * t,
        Layout::contiguous(&[b, h, t, t]).transpose(2, 3).unwrap(),
        &mut rng,
    );
    check("dk = gᵀ · q", gt, q);
}

#[test]
fn layouts_no_cublas_argument_can_express_need_a_copy() {
    // A row broadcast over the rows of the lhs: stride 0 between rows, 1 between columns.
    let row = Layout::contiguous(&[1, 3]).broadcast_to(&[4, 3]).unwrap();
    assert_eq!(
        plan_gemm(&row, &Layout::contiguous(&[3, 2])),
        Err(PlanError::NeedsCopy(Operand::Lhs))
    );
    // A permutation with neither matrix stride 1.
    let odd = Layout::new(vec![4, 2], vec![2, 8], 0);
    assert_eq!(
        plan_gemm(&Layout::contiguous(&[5, 4]), &odd),
        Err(PlanError::NeedsCopy(Operand::Rhs))
    );
    // Mismatched inner dimensions are a shape error, not a plan.
    assert!(matches!(
        plan_gemm(&Layout::contiguous(&[2, 3]), &Layout::contiguous(&[4, 2])),
        Err(PlanError::Shape { .. })
    ));
    // The operand rule itself: (rows, cols, row stride, col stride).
    assert_eq!(transposed_operand(4, 3, 3, 1), Some((Transpose::No, 3)));
    assert_eq!(transposed_operand(4, 3, 1, 4), Some((Transpose::Yes, 4)));
    assert_eq!(
        transposed_operand(4, 3, 2, 1),
        None,
        "rows overlapping (ld < cols) cannot be expressed"
    );
}
