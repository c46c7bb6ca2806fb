//! Raw handles of device memory, streams and events: how device buffers reach the NCCL
//! collectives while this crate knows no tensors. The tensor crate hands out the numbers
//! (`Storage::device_memory`, `Stream::raw_handle`, `Event::raw_handle`); `ddp` passes them
//! across; only [`crate::nccl`] (with the `cuda` feature) turns them back into CUDA objects,
//! in `unsafe` calls whose callers promise that they are live.

use crate::DType;

/// A contiguous run of device memory: the address of its first element, its element count
/// and type, and the CUDA device it lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpan {
    /// The `CUdeviceptr` of the first element.
    pub ptr: u64,
    /// Number of elements.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
    /// The CUDA device ordinal.
    pub ordinal: usize,
}

impl DeviceSpan {
    /// Bytes covered.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }
}

/// A CUDA stream (`CUstream`) of some device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawStream(pub u64);

/// A CUDA event (`CUevent`) of some device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawEvent(pub u64);
