//! Every kernel name a launch in `cuda/ops/` can ask for is in its file's compiled CUBIN: a name typo
//! would otherwise first show on a GPU. Needs NVRTC (CI has it; elsewhere the test says it
//! skipped).

use super::super::nvrtc::{self, KernelFile, COPY, ELEMENTWISE, INDEXING, LINK, NN, OPTIM, REDUCE};
use super::{binary_kernel, unary_kernel};
use crate::backend::{BinaryOp, UnaryOp};

fn has_symbol(cubin: &[u8], name: &str) -> bool {
    let needle: Vec<u8> = [&[0u8][..], name.as_bytes(), &[0u8][..]].concat();
    cubin.windows(needle.len()).any(|w| w == needle.as_slice())
}

#[test]
fn every_launched_kernel_exists_in_its_cubin() {
    if !super::super::probe::nvrtc_present() {
        crate::testing::report_skip("cuda::ops::kernel_names", &"libnvrtc is not on LD_LIBRARY_PATH");
        return;
    }
    // every float storage: f16 and bf16 compute in f32 (the embedding's backward widens to f32)
    let floats = ["f32", "f64", "f16", "bf16"];
    let all = ["f32", "f64", "f16", "bf16", "i64", "u8", "i8"];
    let mut want: Vec<(KernelFile, String)> = vec![];
    let unary = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Ln,
        UnaryOp::Sqrt,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::Sqr,
        UnaryOp::Affine { mul: 1.0, add: 0.0 },
        UnaryOp::Powf(2.0),
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Abs,
        UnaryOp::Sign,
        UnaryOp::Round,
        UnaryOp::Clamp { min: -1.0, max: 1.0 },
        UnaryOp::InRange { min: -1.0, max: 1.0 },
        UnaryOp::IsZero,
    ];
    let binary = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::ReluBackward,
        BinaryOp::GeluBackward,
    ];
    for t in floats {
        want.extend(
            unary
                .iter()
                .map(|&op| (ELEMENTWISE, format!("{}_{t}", unary_kernel(op).0))),
        );
        want.extend(
            binary
                .iter()
                .map(|&op| (ELEMENTWISE, format!("{}_{t}", binary_kernel(op)))),
        );
        want.push((COPY, format!("scaled_add_{t}")));
        for k in ["sum_rows", "max_rows"] {
            want.push((REDUCE, format!("{k}_{t}")));
        }
        for k in [
            "softmax_rows",
            "softmax_backward_rows",
            "layer_norm_rows",
            "layer_norm_backward_dx",
            "layer_norm_dwdb_partial",
            "column_sum",
            "causal_fill",
            "mean_f64",
        ] {
            want.push((NN, format!("{k}_{t}")));
        }
        for i in ["i64", "u8"] {
            for k in ["embedding", "cross_entropy_rows", "cross_entropy_backward"] {
                want.push((NN, format!("{k}_{t}_{i}")));
            }
            if matches!(t, "f32" | "f64") {
                want.push((NN, format!("embedding_backward_{t}_{i}")));
                want.push((INDEXING, format!("scatter_add_lines_{t}_{i}")));
            }
        }
        for k in ["sort_tiles", "merge_runs"] {
            want.push((INDEXING, format!("{k}_{t}")));
        }
    }
    for b in [1, 2, 4, 8] {
        for k in ["gather", "fill", "scatter"] {
            want.push((COPY, format!("{k}_b{b}")));
        }
    }
    for b in [2, 4, 8] {
        for i in ["i64", "u8"] {
            want.push((INDEXING, format!("gather_along_b{b}_{i}")));
        }
    }
    for s in all {
        for d in all {
            want.push((COPY, format!("cast_{s}_{d}")));
        }
    }
    want.push((OPTIM, "sgd_step_f32".into()));
    want.push((OPTIM, "adamw_step_f32".into()));
    want.push((LINK, "spin_ns".into()));
    let mut missing = vec![];
    for file in nvrtc::KERNEL_FILES {
        let cubin = nvrtc::compile(file, "sm_80").expect("compiles").cubin;
        for (f, name) in &want {
            if f.name == file.name && !has_symbol(&cubin, name) {
                missing.push(format!("{name} in {}", file.name));
            }
        }
    }
    assert!(missing.is_empty(), "kernels launched but not compiled: {missing:?}");
    assert!(!has_symbol(
        &nvrtc::compile(LINK, "sm_80").unwrap().cubin,
        "no_such_kernel"
    ));
}
