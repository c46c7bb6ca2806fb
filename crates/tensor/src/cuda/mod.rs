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
//!
//! Rooms: [`probe`] (is CUDA there?), [`device`] (context, stream, cuBLAS handle, kernel
//! cache), [`nvrtc`] (the `.cu` sources in `kernels/` and their compilation), [`element`]
//! (typed device buffers), [`storage`] (allocation, copies, gathers, casts, fills),
//! [`gemm_plan`] (views to cuBLAS arguments, pure) and `gemm` (the cuBLAS calls), `ops`
//! (launch wrappers for the remaining kernels), [`launch`] (grid shapes, the layout
//! argument). The wrappers follow the device contract of `crate::backend` (device-seam
//! branch) method for method; `contract.rs` implements it by forwarding.

pub mod bench;
pub mod device;
pub mod element;
mod gemm;
pub mod gemm_plan;
pub mod launch;
pub mod nvrtc;
mod ops;
pub mod probe;
pub mod storage;

pub use device::CudaDevice;
pub use probe::Unavailable;
pub use storage::CudaStorage;

// The device contract (`crate::backend`) implemented by forwarding to the wrappers above;
// `crate::storage::DeviceStorage::Cuda` dispatches to it.
mod contract;

// Tensors share storage across rank threads: the CUDA types must be Send + Sync.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CudaStorage>();
    send_sync::<CudaDevice>();
};
