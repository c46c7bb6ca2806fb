//! Where a run's tensors live: on the CPU, or on CUDA devices shared out among the ranks
//! ([`DevicePlacement`]: which GPU each rank uses).

use brigade_tensor::cuda::probe::{self, Unavailable};
use brigade_tensor::{DType, Device, Tensor};

use crate::error::Result;

/// How the ranks are placed on devices: all on the CPU, or each on a CUDA device from a first
/// ordinal on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DevicePlacement {
    /// Host memory, CPU kernels (the default).
    #[default]
    Cpu,
    /// CUDA, rank r on GPU `first + r % (count - first)` of the `count` GPUs the driver sees
    /// (`None`: from GPU 0).
    Cuda(Option<usize>),
    /// The counting fake device `fake:N` for every rank (`brigade_tensor::fake`): host memory
    /// behind the device contract, for tests of what a step does to a device (transfers, host
    /// waits). Not a `--device` value: tests set it through the library.
    Fake(usize),
}

/// `cpu`, `cuda` or `cuda:N`.
impl std::fmt::Display for DevicePlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DevicePlacement::Cpu => write!(f, "cpu"),
            DevicePlacement::Cuda(None) => write!(f, "cuda"),
            DevicePlacement::Cuda(Some(n)) => write!(f, "cuda:{n}"),
            DevicePlacement::Fake(n) => write!(f, "fake:{n}"),
        }
    }
}

impl DevicePlacement {
    /// The device of `rank`: the CPU, the fake device, or GPU `N + rank % (count - N)` of the
    /// `count` GPUs the driver sees (`N` = 0 for plain `cuda`), opened once here so that a
    /// missing driver, library or GPU (or a build without the `cuda` feature) is one typed
    /// error before the first step.
    pub fn for_rank(self, rank: usize) -> Result<Device> {
        let first = match self {
            DevicePlacement::Cpu => return Ok(Device::Cpu),
            DevicePlacement::Fake(n) => return Ok(Device::Fake(n)),
            DevicePlacement::Cuda(n) => n.unwrap_or(0),
        };
        let count = probe::device_count().map_err(|u| u.on(Device::Cuda(first)))?;
        if first >= count {
            return Err(Unavailable::NoDevice { ordinal: first, count }
                .on(Device::Cuda(first))
                .into());
        }
        let device = Device::Cuda(first + rank % (count - first));
        Tensor::zeros_on(&[1], DType::U8, device)?;
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use super::DevicePlacement;
    use brigade_tensor::Device;

    #[test]
    fn the_cpu_placement_puts_every_rank_on_the_cpu() {
        assert_eq!(DevicePlacement::Cpu.for_rank(5).unwrap(), Device::Cpu);
        assert_eq!(DevicePlacement::Cuda(Some(3)).to_string(), "cuda:3");
        assert_eq!(DevicePlacement::Fake(7).for_rank(5).unwrap(), Device::Fake(7));
    }
}
