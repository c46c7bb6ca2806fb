//! The CUDA backend: device buffers, cuBLAS GEMMs and NVRTC-compiled kernels.
//!
//! Always compiled: cudarc loads the CUDA libraries at run time (`dynamic-loading`), so
//! building needs no CUDA, and a machine without a driver, a library or a GPU gets a
//! typed [`Unavailable`] from [`probe::require`] instead of cudarc's panic.
//!
//! **Compile-checked only.** No part of this module has run on a GPU yet: it is
//! type-checked, its kernels are compiled by NVRTC for sm_80 and sm_90 in CI, and the
//! pure parts (the cuBLAS argument mapping) are tested on the CPU. `scripts/gpu-check.sh`
//! is the prepared first run on hardware.

mod gemm;
pub mod gemm_plan;
pub mod nvrtc;
pub mod probe;

pub use probe::Unavailable;
pub mod device;
pub mod element;
pub mod launch;
mod ops;
pub mod storage;

pub use device::CudaDevice;
pub use storage::CudaStorage;
