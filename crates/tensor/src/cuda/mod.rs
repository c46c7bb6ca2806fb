//! The CUDA backend: device buffers, cuBLAS GEMMs and NVRTC-compiled kernels.
//!
//! Built with the `cuda` cargo feature (on by default): cudarc loads the CUDA libraries at
//! run time (`dynamic-loading`), so building needs no CUDA, and a machine without a driver,
//! a library or a GPU gets a typed [`probe::Unavailable`] from [`probe::require`] instead of
//! cudarc's panic. Without the feature this module keeps only its public face: the probe
//! answers [`probe::Unavailable::NotBuilt`], and `--device cuda` is the same one-line error.
//!
//! **Compile-checked only.** No part of this module has run on a GPU yet: it is
//! type-checked, its kernels are compiled by NVRTC for sm_80 and sm_90 in CI, the pure parts
//! (the cuBLAS argument mapping) are tested on the CPU, and its device logic (streams,
//! events, no host reads inside a step) is the counting fake device's, tested on the CPU.
//! `scripts/gpu-check.sh` is the prepared first run on hardware.
//!
//! Public: [`probe`] (is CUDA there? do the kernels compile?) and [`CudaHandle`] (one GPU:
//! its architecture, a synchronize, the GEMM benchmark against cuBLAS). Everything else is
//! private: tensors reach a GPU through [`crate::Device::Cuda`], streams and events through
//! [`crate::Stream`] and [`crate::Event`], raw memory through
//! [`crate::Storage::device_memory`]; no cudarc type appears in a public signature.
//!
//! Rooms (with the feature): `device` (context, compute stream, cuBLAS handles, kernel cache,
//! memory pool, deferred frees), `streams` (the contract's streams and events, the spin
//! kernel), `nvrtc` (the `.cu` sources in `kernels/` and their compilation), `element` (typed
//! device buffers), `storage` (allocation, copies in and out, the keep-alive rule), `ops` (the
//! rest of the device contract: memory, elementwise, reductions, attention in `mod.rs`, the
//! layers in `nn.rs`, in-place updates in `inplace.rs`), `gemm_plan` (views to cuBLAS
//! arguments, pure) and `gemm` (the contract's matrix products, the cuBLAS calls), `launch`
//! (grid shapes, the layout argument), `bench` (GEMM against cuBLAS).

mod compare;
mod handle;
pub mod probe;

pub use handle::{compare_outputs, CudaHandle, GemmTiming, OutputComparison};

#[cfg(feature = "cuda")]
mod bench;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod element;
#[cfg(feature = "cuda")]
mod gemm;
#[cfg(feature = "cuda")]
mod gemm_plan;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod nvrtc;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod storage;
#[cfg(feature = "cuda")]
mod streams;

#[cfg(feature = "cuda")]
pub(crate) use device::CudaDevice;
#[cfg(feature = "cuda")]
pub(crate) use device::CudaStreamRef;
#[cfg(feature = "cuda")]
pub(crate) use storage::CudaStorage;
#[cfg(feature = "cuda")]
pub(crate) use streams::CudaEventRef;

// Tensors share storage across rank threads: the CUDA types must be Send + Sync.
#[cfg(feature = "cuda")]
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CudaStorage>();
    send_sync::<CudaDevice>();
    send_sync::<CudaStreamRef>();
    send_sync::<CudaEventRef>();
};
