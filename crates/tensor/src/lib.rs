//! Brigade's tensors: n-d arrays as shared storage plus a layout (shape, strides in
//! elements, offset), on a [`Device`]. Every op checks its operands here (`ops/`) and runs
//! on the backend that holds them, through one narrow device contract (`backend.rs`);
//! the CPU backend (`cpu/`) has kernels for everything the MLP and GPT models need.
//!
//! Views (transpose, permute, narrow, broadcast, reshape of contiguous data) cost no
//! copy; ops return new tensors; a handful of in-place methods write through views,
//! which is how gradients live inside flat DDP buckets. Compute is f32 (f64 for
//! gradient checks); f16/bf16 are storage formats, i8 a quantized one. The device is part
//! of every tensor: a device this build cannot serve yields
//! [`TensorError::DeviceUnavailable`].
//!
//! Devices: the CPU; CUDA GPUs ([`cuda`], behind the `cuda` cargo feature, on by default);
//! and the counting fake device ([`fake`]), host memory behind the device contract, on which
//! CPU tests check what a step does to a device (transfers, host waits, stream order).
//! [`Stream`] and [`Event`] order work across a device's streams; [`DeviceMemory`] is the
//! raw handle of device memory handed to a collective.

#![warn(missing_docs)]

mod backend;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // CUDA's attention; tested on the CPU
mod composed;
mod cpu;
pub mod cuda;
mod dtype;
mod error;
pub mod fake;
mod host_memory;
mod layout;
mod memory_meter;
mod ops;
mod rng;
mod scope;
#[cfg(all(test, feature = "cuda"))] // a test's path in the system temp dir, removed when it passes
#[path = "../../test-support/scratch.rs"]
mod scratch;
mod storage;
mod stream;
mod tensor;
pub mod testing;
mod threads;

pub use cpu::{cpu_gemm, cpu_gemm_name, gemm_threads_for, set_cpu_gemm, CpuGemm};
pub use dtype::{Buffer, DType, Element, Float};
pub use error::{Result, TensorError};
pub use host_memory::retain_freed_host_memory;
pub use layout::{broadcast_shape, contiguous_strides, Layout};
pub use memory_meter::{MemoryMeter, PartGuard, MEMORY_PARTS};
pub use ops::{AdamWStep, AttentionSaved, LayerNormSaved, SgdStep};
pub use rng::Rng;
pub use storage::{Device, Storage};
pub use stream::{DeviceMemory, Event, Stream};
pub use tensor::Tensor;
pub use threads::{compute_threads, set_compute_threads};
