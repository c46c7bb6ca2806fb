//! Brigade's tensors: n-d arrays as shared storage plus a layout (shape, strides in
//! elements, offset), on a [`Device`]. Every op checks its operands here (`ops/`) and runs
//! on the backend that holds them, through one narrow device contract (`backend.rs`);
//! the CPU backend (`cpu/`) has kernels for everything the MLP and GPT models need.
//!
//! Views (transpose, permute, narrow, broadcast, reshape of contiguous data) cost no
//! copy; ops return new tensors; a handful of in-place methods write through views,
//! which is how gradients live inside flat DDP buckets. Compute is f32 (f64 for
//! gradient checks); f16/bf16 are storage formats. The device is part of every tensor:
//! a device this build cannot serve yields [`TensorError::DeviceUnavailable`].

#![warn(missing_docs)]

mod backend;
mod composed;
mod cpu;
pub mod cuda;
mod device;
mod dtype;
mod error;
mod host_memory;
mod layout;
mod ops;
mod rng;
mod storage;
mod tensor;
pub mod testing;
mod threads;

pub use cpu::gemm_threads_for;
pub use device::Device;
pub use dtype::{DType, Element, Float};
pub use error::{Result, TensorError};
pub use host_memory::retain_freed_host_memory;
pub use layout::{broadcast_shape, contiguous_strides, Layout};
pub use ops::{AdamWStep, AttentionSaved, LayerNormSaved, SgdStep};
pub use rng::Rng;
pub use storage::Storage;
pub use tensor::Tensor;
pub use threads::{compute_threads, set_compute_threads};
