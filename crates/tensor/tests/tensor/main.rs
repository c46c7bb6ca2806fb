//! brigade-tensor's integration tests: the CUDA backend (probe, NVRTC compile, cuBLAS plan, device ops, GEMM bench).
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod cuda_bench;
mod cuda_gemm_plan;
mod cuda_nvrtc;
mod cuda_ops;
mod cuda_probe;
