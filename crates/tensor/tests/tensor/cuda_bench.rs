//! GEMM speed on the GPU: Brigade's `CudaStorage::matmul` (plan + cuBLAS) beside a direct
//! cuBLAS call on the same buffers, same shapes, same run ([`gemm_vs_cublas`], which
//! `brigade bench gemm --device cuda` also prints). Ignored by default (it measures, it does
//! not check); `scripts/gpu-check.sh` runs it with `--ignored` and collects the JSON it writes
//! to `$BRIGADE_BENCH_OUT`.

use std::io::Write;

use brigade_tensor::cuda::bench::gemm_vs_cublas;
use brigade_tensor::cuda::CudaDevice;
use brigade_tensor::DType;

#[test]
#[ignore = "a benchmark: needs a GPU; run by scripts/gpu-check.sh"]
fn gemm_4096_brigade_vs_direct_cublas() {
    let dev = match CudaDevice::get(0) {
        Ok(d) => d,
        Err(e) if std::env::var("BRIGADE_REQUIRE_CUDA").as_deref() == Ok("1") => {
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
    for dtype in [DType::F32, DType::BF16] {
        let t = gemm_vs_cublas(&dev, [n, n, n], dtype, 10).unwrap();
        rows.push(format!(
            "{{\"dtype\":\"{dtype:?}\",\"n\":{n},\"brigade_s\":{:.6},\"cublas_s\":{:.6},\"brigade_tflops\":{:.2},\"cublas_tflops\":{:.2},\"ratio\":{:.3}}}",
            t.brigade_s,
            t.cublas_s,
            flops / t.brigade_s / 1e12,
            flops / t.cublas_s / 1e12,
            t.cublas_s / t.brigade_s
        ));
    }
    let json = format!("[{}]\n", rows.join(","));
    print!("{json}");
    if let Ok(path) = std::env::var("BRIGADE_BENCH_OUT") {
        std::fs::write(&path, &json).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
}
