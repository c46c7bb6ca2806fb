//! GEMM on the GPU: Brigade's matmul (plan + cuBLAS) beside a direct cuBLAS call on the same
//! buffers, same shapes, same run ([`CudaHandle::gemm_vs_cublas`], which `brigade bench gemm
//! --device cuda` also prints). Ignored by default (it needs a GPU and takes seconds);
//! `scripts/gpu-check.sh` runs it with `--ignored` and reads the JSON it writes to
//! `$BRIGADE_BENCH_OUT`. The two outputs are compared element by element: a wrong output fails
//! the test whatever the speed (the speed goal, >= 0.95x cuBLAS, is the script's PASS or MISS).

use std::io::Write;

use brigade_tensor::cuda::CudaHandle;
use brigade_tensor::DType;

#[test]
#[ignore = "a benchmark: needs a GPU; run by scripts/gpu-check.sh"]
fn gemm_4096_brigade_vs_direct_cublas() {
    let dev = match CudaHandle::open(0) {
        Ok(d) => d,
        Err(e) if brigade_tensor::testing::cuda_required() => {
            panic!("gemm_4096_brigade_vs_direct_cublas: BRIGADE_REQUIRE_CUDA=1 but {e}")
        }
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED gemm_4096_brigade_vs_direct_cublas: needs a GPU: {e}"
            );
            return;
        }
    };
    let n = 4096usize;
    let flops = 2.0 * (n as f64).powi(3);
    let mut rows = vec![];
    let mut wrong = vec![];
    for dtype in [DType::F32, DType::BF16] {
        let t = dev.gemm_vs_cublas([n, n, n], dtype, 10).unwrap();
        let o = t.outputs;
        rows.push(format!(
            "{{\"dtype\":\"{dtype}\",\"n\":{n},\"brigade_s\":{:.6},\"cublas_s\":{:.6},\"brigade_tflops\":{:.2},\"cublas_tflops\":{:.2},\"ratio\":{:.3},\"outputs_equal\":{},\"mismatches\":{},\"worst_abs_diff\":{:e},\"worst_index\":{}}}",
            t.brigade_s,
            t.cublas_s,
            flops / t.brigade_s / 1e12,
            flops / t.cublas_s / 1e12,
            t.cublas_s / t.brigade_s,
            o.passed(),
            o.mismatches,
            o.worst_abs_diff,
            o.worst_index
        ));
        if !o.passed() {
            wrong.push(format!(
                "{dtype}: {} of {} elements differ beyond {:e} (worst {:e} at {})",
                o.mismatches, o.elements, o.rel_tol, o.worst_abs_diff, o.worst_index
            ));
        }
    }
    let json = format!("[{}]\n", rows.join(","));
    print!("{json}");
    if let Ok(path) = std::env::var("BRIGADE_BENCH_OUT") {
        std::fs::write(&path, &json).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
    assert!(
        wrong.is_empty(),
        "Brigade's GEMM output differs from cuBLAS's: {}",
        wrong.join("; ")
    );
}
