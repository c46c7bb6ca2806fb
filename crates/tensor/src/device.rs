//! Where a tensor's storage lives.

/// A compute device. Every tensor carries one; CPU kernels are built in, and a device
/// that this build or machine cannot serve answers with [`crate::TensorError::DeviceUnavailable`]
/// instead of panicking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, CPU kernels (GEMM through the `gemm` crate, the rest on rayon).
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// True for [`Device::Cpu`].
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
