//! Asking whether CUDA can serve a device, without ever panicking.
//!
//! cudarc loads the CUDA libraries on first use and panics when one is missing; each
//! library's `is_culib_present()` answers the same question without panicking, so every
//! path into cudarc goes through [`require`] first. A build without the `cuda` feature
//! answers [`Unavailable::NotBuilt`] to every question.
//!
//! With the feature, the kernels' NVRTC compilation is here too ([`compile`],
//! [`compile_strict`], [`KERNEL_FILES`]): it needs no GPU, so CI checks that every kernel
//! compiles on a CPU-only machine.

use crate::{Device, TensorError};

#[cfg(feature = "cuda")]
pub use super::nvrtc::{compile, compile_strict, CompileFailure, CompiledKernels, KernelFile, KERNEL_FILES};

/// What is missing when CUDA cannot serve a device: one variant per cause, so the user is
/// told exactly which library or device to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// The CUDA driver library is not installed (no NVIDIA driver on this machine).
    #[error("the CUDA driver library libcuda.so.1 was not found (is an NVIDIA driver installed?)")]
    Driver,
    /// cuBLAS is not on the library path.
    #[error("libcublas was not found (install the CUDA toolkit or the nvidia-cublas wheel and put its lib/ on LD_LIBRARY_PATH)")]
    Cublas,
    /// NVRTC, which compiles Brigade's kernels at run time, is not on the library path.
    #[error("libnvrtc was not found (install the nvidia-cuda-nvrtc wheel and put its lib/ on LD_LIBRARY_PATH)")]
    Nvrtc,
    /// The driver answered but has no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver sees.
        count: usize,
    },
    /// The driver failed while being asked (initialisation, device count, context).
    #[error("the CUDA driver failed during {during}: {detail}")]
    DriverCall {
        /// What was being asked.
        during: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// This build has no CUDA backend (it was built without the `cuda` cargo feature).
    #[error("this build has no CUDA backend (it was built without the `cuda` cargo feature)")]
    NotBuilt,
}

impl Unavailable {
    /// The crate's error for this cause on `device`.
    pub fn on(self, device: Device) -> TensorError {
        TensorError::DeviceUnavailable {
            device,
            reason: self.to_string(),
        }
    }
}

/// True when NVRTC can be loaded (it needs no GPU: kernels compile on any machine).
pub fn nvrtc_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to dlopen the library; no function of it is called.
        unsafe { cudarc::nvrtc::sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// True when the CUDA driver library can be loaded.
pub fn driver_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to dlopen the library; no function of it is called.
        unsafe { cudarc::driver::sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// True when cuBLAS can be loaded.
pub fn cublas_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to dlopen the library; no function of it is called.
        unsafe { cudarc::cublas::sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// How many CUDA devices the driver sees, or why it cannot be asked.
pub fn device_count() -> Result<usize, Unavailable> {
    #[cfg(feature = "cuda")]
    {
        device_count_from_driver()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Unavailable::NotBuilt)
    }
}

#[cfg(feature = "cuda")]
fn device_count_from_driver() -> Result<usize, Unavailable> {
    if !driver_present() {
        return Err(Unavailable::Driver);
    }
    cudarc::driver::result::init().map_err(|e| Unavailable::DriverCall {
        during: "cuInit",
        detail: format!("{e:?}"),
    })?;
    let n = cudarc::driver::result::device::get_count().map_err(|e| Unavailable::DriverCall {
        during: "cuDeviceGetCount",
        detail: format!("{e:?}"),
    })?;
    Ok(n.max(0) as usize)
}

/// Checks everything the CUDA backend needs for device `ordinal` (driver, cuBLAS, NVRTC,
/// the device itself), in that order, so the first missing piece is the one reported.
pub fn require(ordinal: usize) -> Result<(), Unavailable> {
    if cfg!(not(feature = "cuda")) {
        return Err(Unavailable::NotBuilt);
    }
    if !driver_present() {
        return Err(Unavailable::Driver);
    }
    if !cublas_present() {
        return Err(Unavailable::Cublas);
    }
    if !nvrtc_present() {
        return Err(Unavailable::Nvrtc);
    }
    let count = device_count()?;
    if ordinal >= count {
        return Err(Unavailable::NoDevice { ordinal, count });
    }
    Ok(())
}
