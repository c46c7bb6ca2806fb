//! GEMM speed on the GPU: Brigade's `CudaStorage::matmul` (plan + cuBLAS) beside a direct
//! cuBLAS call on the same buffers, same shapes, same run. Ignored by default (it measures,
//! it does not check); `scripts/gpu-check.sh` runs it with `--ignored` and collects the
//! JSON it writes to `$BRIGADE_BENCH_OUT`.

use std::io::Write;
use std::time::Instant;

use brigade_tensor::cuda::{CudaDevice, CudaStorage};
use brigade_tensor::{DType, Layout};
use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
use cudarc::cublas::{Gemm, GemmConfig};
use half::bf16;

/// Seconds per call of `f`, median of `reps` timed calls after 3 warm-ups.
fn time(dev: &CudaDevice, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    dev.synchronize().unwrap();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            dev.synchronize().unwrap();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[reps / 2]
}

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
    let l = Layout::contiguous(&[n, n]);
    let host: Vec<f32> = (0..n * n).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let mut rows = vec![];
    for dtype in [DType::F32, DType::BF16] {
        let a = CudaStorage::from_host(&dev, &host)
            .unwrap()
            .to_dtype(&l, dtype)
            .unwrap();
        let b = a.to_dtype(&l, dtype).unwrap();
        let brigade = time(&dev, 10, || {
            a.matmul(&l, &b, &l).unwrap();
        });
        // The direct call: row-major C = A·B as column-major Cᵀ = Bᵀ·Aᵀ, no transposes.
        fn cfg<T>(n: usize, one: T, zero: T) -> GemmConfig<T> {
            GemmConfig {
                transa: CUBLAS_OP_N,
                transb: CUBLAS_OP_N,
                m: n as i32,
                n: n as i32,
                k: n as i32,
                alpha: one,
                lda: n as i32,
                ldb: n as i32,
                beta: zero,
                ldc: n as i32,
            }
        }
        let direct = match dtype {
            DType::F32 => {
                let (ha, hb) = (a.to_host::<f32>().unwrap(), b.to_host::<f32>().unwrap());
                let s = dev.stream();
                let (da, db) = (s.clone_htod(&ha).unwrap(), s.clone_htod(&hb).unwrap());
                let mut dc = s.alloc_zeros::<f32>(n * n).unwrap();
                // SAFETY: all three buffers hold n*n elements, as the config says.
                time(&dev, 10, || unsafe {
                    dev.blas().gemm(cfg(n, 1.0f32, 0.0f32), &db, &da, &mut dc).unwrap()
                })
            }
            _ => {
                let (ha, hb) = (a.to_host::<bf16>().unwrap(), b.to_host::<bf16>().unwrap());
                let s = dev.stream();
                let (da, db) = (s.clone_htod(&ha).unwrap(), s.clone_htod(&hb).unwrap());
                let mut dc = s.alloc_zeros::<bf16>(n * n).unwrap();
                // SAFETY: all three buffers hold n*n elements, as the config says.
                time(&dev, 10, || unsafe {
                    dev.blas()
                        .gemm(cfg(n, bf16::ONE, bf16::ZERO), &db, &da, &mut dc)
                        .unwrap()
                })
            }
        };
        rows.push(format!(
            "{{\"dtype\":\"{dtype:?}\",\"n\":{n},\"brigade_s\":{brigade:.6},\"cublas_s\":{direct:.6},\"brigade_tflops\":{:.2},\"cublas_tflops\":{:.2},\"ratio\":{:.3}}}",
            flops / brigade / 1e12,
            flops / direct / 1e12,
            direct / brigade
        ));
    }
    let json = format!("[{}]\n", rows.join(","));
    print!("{json}");
    if let Ok(path) = std::env::var("BRIGADE_BENCH_OUT") {
        std::fs::write(&path, &json).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
}
