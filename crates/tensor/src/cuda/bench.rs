//! Brigade's GEMM beside a direct cuBLAS call on the same device buffers, the same shapes, in
//! the same run: what `brigade bench gemm --device cuda` and
//! `crates/tensor/tests/tensor/cuda_bench.rs` print. Both outputs are copied out and compared
//! element by element ([`super::compare_outputs`]), so a fast wrong GEMM cannot pass.

use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use super::compare::{compare_outputs, GemmTiming};
use super::device::fault;
use super::{CudaDevice, CudaStorage};
use crate::backend::{BackendStorage, Matmul};
use crate::cuda::element::CudaElement;
use crate::{DType, Layout, Result, TensorError};

/// Median seconds of `reps` calls of `f` (each followed by a device synchronize), after three
/// warm-up calls.
fn median_secs(dev: &CudaDevice, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let s = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The cuBLAS arguments of row-major `C[m,n] = A[m,k]·B[k,n]` with no copy: column-major
/// `Cᵀ[n,m] = Bᵀ[n,k]·Aᵀ[k,m]`, so cuBLAS gets B first.
fn row_major<T>(m: usize, k: usize, n: usize, one: T, zero: T) -> GemmConfig<T> {
    GemmConfig {
        transa: CUBLAS_OP_N,
        transb: CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: one,
        lda: n as i32,
        ldb: k as i32,
        beta: zero,
        ldc: n as i32,
    }
}

/// Times the direct cuBLAS call on copies of `a` and `b` (already cast to `T`); returns the
/// seconds and the output.
fn direct<T>(
    dev: &Arc<CudaDevice>,
    a: &CudaStorage,
    b: &CudaStorage,
    mkn: [usize; 3],
    one: T,
    reps: usize,
) -> Result<(f64, CudaStorage)>
where
    T: CudaElement + DeviceRepr + ValidAsZeroBits + Default,
    cudarc::cublas::CudaBlas: Gemm<T>,
{
    let [m, k, n] = mkn;
    let device = dev.location();
    let s = dev.stream();
    let upload =
        |v: Vec<T>| -> Result<CudaSlice<T>> { s.clone_htod(&v).map_err(|e| fault(device, "copying to the GPU", e)) };
    let (da, db) = (upload(a.to_host::<T>()?)?, upload(b.to_host::<T>()?)?);
    let mut dc = s
        .alloc_zeros::<T>(m * n)
        .map_err(|e| fault(device, "allocating the output", e))?;
    let blas = dev.blas()?;
    let secs = median_secs(dev, reps, || {
        // SAFETY: da holds m*k, db k*n and dc m*n elements, as the config says.
        unsafe { blas.gemm(row_major(m, k, n, one, T::default()), &db, &da, &mut dc) }
            .map_err(|e| fault(device, "cublas gemm", e))
    })?;
    Ok((secs, CudaStorage::from_slice(dev, dc)))
}

/// Brigade's `matmul` and the direct cuBLAS call for `[m, k, n]` in `dtype` (F32, F16 or
/// BF16; f16/bf16 accumulate in f32 on both sides), on deterministic data; outputs compared.
pub(crate) fn gemm_vs_cublas(dev: &Arc<CudaDevice>, mkn: [usize; 3], dtype: DType, reps: usize) -> Result<GemmTiming> {
    let [m, k, n] = mkn;
    let fill = |len: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect() };
    let (la, lb) = (Layout::contiguous(&[m, k]), Layout::contiguous(&[k, n]));
    let a = CudaStorage::from_host(dev, &fill(m * k))?.to_dtype(&la, dtype)?;
    let b = CudaStorage::from_host(dev, &fill(k * n))?.to_dtype(&lb, dtype)?;
    let brigade_s = median_secs(dev, reps, || a.matmul(&la, &b, &lb).map(drop))?;
    let (cublas_s, theirs) = match dtype {
        DType::F32 => direct(dev, &a, &b, mkn, 1.0f32, reps)?,
        DType::F16 => direct(dev, &a, &b, mkn, f16::ONE, reps)?,
        DType::BF16 => direct(dev, &a, &b, mkn, bf16::ONE, reps)?,
        other => {
            return Err(TensorError::UnsupportedDType {
                op: "gemm_vs_cublas",
                dtype: other,
                hint: " (f32, f16 or bf16)",
            })
        }
    };
    let lc = Layout::contiguous(&[m, n]);
    let ours = a.matmul(&la, &b, &lb)?.to_dtype(&lc, DType::F64)?.to_host::<f64>()?;
    let theirs = theirs.to_dtype(&lc, DType::F64)?.to_host::<f64>()?;
    let rel_tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
    Ok(GemmTiming {
        brigade_s,
        cublas_s,
        outputs: compare_outputs(&ours, &theirs, rel_tol),
    })
}
