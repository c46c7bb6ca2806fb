//! One GPU as other crates see it: [`CudaHandle`] (no cudarc type in its signatures).

#[cfg(feature = "cuda")]
use std::sync::Arc;

use crate::{DType, Device, Result};

pub use super::compare::{compare_outputs, GemmTiming, OutputComparison};

/// One CUDA device, opened: what code outside the tensor crate may ask of a GPU directly.
pub struct CudaHandle {
    #[cfg(feature = "cuda")]
    dev: Arc<super::CudaDevice>,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl std::fmt::Debug for CudaHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaHandle({})", self.device())
    }
}

impl CudaHandle {
    /// Opens CUDA device `ordinal` (probed first: a missing driver, library or GPU, or a
    /// build without the `cuda` feature, is a typed `DeviceUnavailable`).
    pub fn open(ordinal: usize) -> Result<CudaHandle> {
        #[cfg(feature = "cuda")]
        {
            Ok(CudaHandle {
                dev: super::CudaDevice::get(ordinal)?,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(super::probe::Unavailable::NotBuilt.on(Device::Cuda(ordinal)))
        }
    }

    /// The device.
    pub fn device(&self) -> Device {
        #[cfg(feature = "cuda")]
        {
            self.dev.location()
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self.never {}
        }
    }

    /// The architecture its kernels are compiled for (`sm_90` on an H100/H200).
    pub fn arch(&self) -> String {
        #[cfg(feature = "cuda")]
        {
            self.dev.arch().to_string()
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self.never {}
        }
    }

    /// Waits until the device's compute stream finished its work.
    pub fn synchronize(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            self.dev.synchronize()
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self.never {}
        }
    }

    /// Brigade's matmul beside a direct cuBLAS call for `[m, k, n]` in `dtype` (F32, F16 or
    /// BF16; f16/bf16 accumulate in f32 on both sides) on the same device buffers: seconds per
    /// call (medians of `reps`), and the two outputs compared element by element (relative
    /// tolerance 1e-5 in f32, 1e-2 in f16/bf16; they run the same cuBLAS routine, so they
    /// normally agree exactly).
    pub fn gemm_vs_cublas(&self, mkn: [usize; 3], dtype: DType, reps: usize) -> Result<GemmTiming> {
        #[cfg(feature = "cuda")]
        {
            super::bench::gemm_vs_cublas(&self.dev, mkn, dtype, reps)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (mkn, dtype, reps);
            match self.never {}
        }
    }
}
