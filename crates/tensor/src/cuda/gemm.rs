//! Matrix products through cuBLAS: the views are mapped to column-major arguments by
//! [`super::gemm_plan::plan_gemm`] (no copies for plain, transposed, narrowed, batched and
//! broadcast-batch operands), then one `gemm` or `gemmStridedBatched` per planned call.
//!
//! f32 runs `cublasSgemm*` in cuBLAS's default math mode: true f32, no TF32 (PyTorch's
//! default). f16 and bf16 run `cublasGemmEx`/`cublasGemmStridedBatchedEx` with
//! `CUBLAS_COMPUTE_32F`: f32 accumulation. f64 runs `cublasDgemm*`.

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
use half::{bf16, f16};

use super::device::fault;
use super::element::CudaElement;
use super::gemm_plan::{plan_gemm, GemmPlan, Operand, PlanError, Transpose};
use super::storage::CudaStorage;
use crate::backend::{BackendStorage, Matmul};
use crate::{DType, Layout, Result, TensorError};

/// An element type cuBLAS multiplies, with its `alpha = 1`, `beta = 0`.
trait GemmElement: CudaElement {
    const ONE: Self;
    const ZERO: Self;
}

impl GemmElement for f32 {
    const ONE: Self = 1.0;
    const ZERO: Self = 0.0;
}
impl GemmElement for f64 {
    const ONE: Self = 1.0;
    const ZERO: Self = 0.0;
}
impl GemmElement for f16 {
    const ONE: Self = f16::ONE;
    const ZERO: Self = f16::ZERO;
}
impl GemmElement for bf16 {
    const ONE: Self = bf16::ONE;
    const ZERO: Self = bf16::ZERO;
}

fn op(t: Transpose) -> cublasOperation_t {
    match t {
        Transpose::No => cublasOperation_t::CUBLAS_OP_N,
        Transpose::Yes => cublasOperation_t::CUBLAS_OP_T,
    }
}

/// Runs every call of `plan`: cuBLAS's `A` is the rhs storage, `B` the lhs storage.
fn run_plan<T: GemmElement>(
    plan: &GemmPlan,
    lhs: &CudaStorage,
    rhs: &CudaStorage,
    out_len: usize,
) -> Result<CudaStorage>
where
    cudarc::cublas::CudaBlas: Gemm<T>,
{
    let opname = "matmul";
    let dev = lhs.cuda_device().clone();
    let mut out = if plan.k == 0 {
        CudaStorage::alloc_zeros::<T>(&dev, out_len)?
    } else {
        CudaStorage::alloc::<T>(&dev, out_len)?
    };
    if plan.k > 0 {
        let (a_all, b_all) = (rhs.data::<T>(opname)?, lhs.data::<T>(opname)?);
        let blas = dev.blas()?;
        let gemm = GemmConfig {
            transa: op(plan.transa),
            transb: op(plan.transb),
            m: plan.m as i32,
            n: plan.n as i32,
            k: plan.k as i32,
            alpha: T::ONE,
            lda: plan.lda as i32,
            ldb: plan.ldb as i32,
            beta: T::ZERO,
            ldc: plan.ldc as i32,
        };
        for call in &plan.calls {
            let oob = || TensorError::OutOfRange {
                op: opname,
                msg: format!("GEMM call at {call:?} outside the storages"),
            };
            let a = a_all.try_slice(call.a..).ok_or_else(oob)?;
            let b = b_all.try_slice(call.b..).ok_or_else(oob)?;
            let mut c = out.try_slice_mut(call.c..).ok_or_else(oob)?;
            // SAFETY: the plan's leading dimensions, strides and counts address only
            // elements inside the views' storages (the layouts were checked against them)
            // and inside the contiguous output of `out_len` elements.
            let r = unsafe {
                if plan.batch_count == 1 {
                    blas.gemm(gemm, &a, &b, &mut c)
                } else {
                    let cfg = StridedBatchedConfig {
                        gemm,
                        batch_size: plan.batch_count as i32,
                        stride_a: plan.stride_a as i64,
                        stride_b: plan.stride_b as i64,
                        stride_c: plan.stride_c as i64,
                    };
                    blas.gemm_strided_batched(cfg, &a, &b, &mut c)
                }
            };
            r.map_err(|e| {
                fault(
                    dev.location(),
                    &format!("cuBLAS GEMM ({:?}, m={} n={} k={})", T::DTYPE, plan.m, plan.n, plan.k),
                    e,
                )
            })?;
        }
    }
    Ok(CudaStorage::from_slice(&dev, out))
}

impl Matmul for CudaStorage {
    /// Batched matrix product `[batch.., m, k] x [batch.., k, n] -> [batch.., m, n]` of two views
    /// (any strides; equal batch dims, broadcast ones with stride 0), through cuBLAS on the
    /// current stream. An operand whose strides no cuBLAS argument can express is gathered first.
    fn matmul(&self, lhs: &Layout, rhs: &CudaStorage, rhs_layout: &Layout) -> Result<CudaStorage> {
        let lhs_s = self;
        let opname = "matmul";
        if lhs_s.dtype() != rhs.dtype() {
            return Err(TensorError::DTypeMismatch {
                op: opname,
                lhs: lhs_s.dtype(),
                rhs: rhs.dtype(),
            });
        }
        lhs_s.check_extent(opname, lhs)?;
        rhs.check_extent(opname, rhs_layout)?;
        let plan = match plan_gemm(lhs, rhs_layout) {
            Ok(p) => p,
            Err(PlanError::NeedsCopy(Operand::Lhs)) => {
                let c = lhs_s.copy_strided(lhs)?;
                return c.matmul(&Layout::contiguous(lhs.shape()), rhs, rhs_layout);
            }
            Err(PlanError::NeedsCopy(Operand::Rhs)) => {
                let c = rhs.copy_strided(rhs_layout)?;
                return lhs_s.matmul(lhs, &c, &Layout::contiguous(rhs_layout.shape()));
            }
            Err(e) => {
                return Err(TensorError::Invalid {
                    op: opname,
                    msg: e.to_string(),
                })
            }
        };
        let r = lhs.rank();
        let out_len: usize =
            lhs.shape()[..r - 2].iter().product::<usize>() * lhs.shape()[r - 2] * rhs_layout.shape()[r - 1];
        if out_len == 0 {
            return Ok(lhs_s.empty_like());
        }
        match lhs_s.dtype() {
            DType::F32 => run_plan::<f32>(&plan, lhs_s, rhs, out_len),
            DType::F64 => run_plan::<f64>(&plan, lhs_s, rhs, out_len),
            DType::F16 => run_plan::<f16>(&plan, lhs_s, rhs, out_len),
            DType::BF16 => run_plan::<bf16>(&plan, lhs_s, rhs, out_len),
            d => Err(TensorError::UnsupportedDType {
                op: opname,
                dtype: d,
                hint: " (cuBLAS GEMMs take f32, f64, f16, bf16)",
            }),
        }
    }
}
