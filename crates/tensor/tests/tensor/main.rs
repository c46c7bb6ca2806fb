//! brigade-tensor's integration tests: the CUDA backend (probe, NVRTC compile, every op against the
//! CPU on a device: the fake device here, cuda:0 on a GPU; GEMM bench) and the fake device.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod cpu_gemm;
#[cfg(feature = "cuda")]
mod cuda_bench;
#[cfg(feature = "cuda")]
mod cuda_nvrtc;
mod cuda_ops;
mod cuda_probe;
mod fake_device;
mod half_ops;
