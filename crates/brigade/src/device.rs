//! `--device`: where a run's tensors live, and which GPU each rank uses.

use brigade_tensor::cuda::probe::{self, Unavailable};
use brigade_tensor::{DType, Device, Tensor};

use crate::error::Result;

/// The `--device` flag: the CPU, or CUDA devices shared out among the ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceArg {
    /// Host memory, CPU kernels (the default).
    #[default]
    Cpu,
    /// CUDA: `cuda` (first GPU `None`: all GPUs from 0) or `cuda:N` (GPUs from N).
    Cuda(Option<usize>),
    /// The counting fake device `fake:N` for every rank (`brigade_tensor::fake`): host memory
    /// behind the device contract, for tests of what a step does to a device (transfers, host
    /// waits). Not a `--device` value: tests set it through the library.
    Fake(usize),
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceArg::Cpu => write!(f, "cpu"),
            DeviceArg::Cuda(None) => write!(f, "cuda"),
            DeviceArg::Cuda(Some(n)) => write!(f, "cuda:{n}"),
            DeviceArg::Fake(n) => write!(f, "fake:{n}"),
        }
    }
}

/// Parses `cpu`, `cuda` or `cuda:N` (clap's value parser for `--device`).
pub fn parse_device(s: &str) -> std::result::Result<DeviceArg, String> {
    match s {
        "cpu" => Ok(DeviceArg::Cpu),
        "cuda" => Ok(DeviceArg::Cuda(None)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(|n| DeviceArg::Cuda(Some(n)))
            .ok_or_else(|| format!("expected cpu, cuda or cuda:N (N a GPU ordinal), got '{s}'")),
    }
}

impl DeviceArg {
    /// The device of `rank`: the CPU, the fake device, or GPU `N + rank % (count - N)` of the
    /// `count` GPUs the driver sees (`N` = 0 for plain `cuda`), opened once here so that a
    /// missing driver, library or GPU (or a build without the `cuda` feature) is one typed
    /// error before the first step.
    pub fn for_rank(self, rank: usize) -> Result<Device> {
        let first = match self {
            DeviceArg::Cpu => return Ok(Device::Cpu),
            DeviceArg::Fake(n) => return Ok(Device::Fake(n)),
            DeviceArg::Cuda(n) => n.unwrap_or(0),
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
    use super::{parse_device, DeviceArg};
    use brigade_tensor::Device;

    #[test]
    fn device_flags_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!(parse_device("cpu"), Ok(DeviceArg::Cpu));
        assert_eq!(parse_device("cuda"), Ok(DeviceArg::Cuda(None)));
        assert_eq!(parse_device("cuda:3"), Ok(DeviceArg::Cuda(Some(3))));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA"] {
            assert!(parse_device(bad).unwrap_err().contains("cpu, cuda or cuda:N"), "{bad}");
        }
        assert_eq!(DeviceArg::Cpu.for_rank(5).unwrap(), Device::Cpu);
        assert_eq!(DeviceArg::Fake(7).for_rank(5).unwrap(), Device::Fake(7));
        assert!(
            parse_device("fake:0").is_err(),
            "the fake device is for tests, not a flag"
        );
    }
}
