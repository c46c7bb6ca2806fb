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
    /// The counting fake device with this ordinal (`brigade_tensor::fake`): host memory behind
    /// the device contract, for tests. It counts every host<->device transfer and host wait,
    /// refuses any host access that does not go through the contract, and checks that its
    /// streams are ordered by events, so the device logic of a training step is tested on the
    /// CPU. Each ordinal keeps its own counts.
    Fake(usize),
}

impl Device {
    /// True for [`Device::Cpu`].
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// True for memory the host cannot read directly (CUDA, and the fake device that stands
    /// in for it in tests): every read goes through a copy out.
    pub fn is_device(&self) -> bool {
        !self.is_cpu()
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Fake(i) => write!(f, "fake:{i}"),
        }
    }
}
