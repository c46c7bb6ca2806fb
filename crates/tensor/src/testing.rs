//! Running one op test on every device the machine has: [`crate::test_device!`].

use std::io::Write;

use crate::{DType, Device, Result, Tensor};

/// `device` if this build and machine can allocate on it, else the typed reason why not
/// (a CUDA device without a CUDA backend, driver or GPU).
pub fn device_if_available(device: Device) -> Result<Device> {
    Tensor::zeros_on(&[1], DType::U8, device).map(|_| device)
}

/// True when `BRIGADE_REQUIRE_CUDA=1`: the GPU check sets it, so that a CUDA test that
/// cannot find its GPU fails instead of skipping.
pub fn cuda_required() -> bool {
    std::env::var("BRIGADE_REQUIRE_CUDA").as_deref() == Ok("1")
}

/// Tells the person running the tests that `test` did not run and why, on the process's
/// own stderr (not the test harness's captured output), so a skip is never a silent pass.
pub fn report_skip(test: &str, why: &dyn std::fmt::Display) {
    let _ = writeln!(std::io::stderr(), "{test} SKIPPED: {why}");
}

/// Defines one `#[test]` per device for a test function `fn name(device: Device)`: a
/// module `name` with `cpu` (always runs), `fake` (always runs, on the counting fake
/// device `fake:0`: the CPU's numbers behind the device contract) and `cuda` (runs on
/// `cuda:0` when this build and machine have it, else reports on stderr that it skipped and
/// why; with `BRIGADE_REQUIRE_CUDA=1` a skip is a failure), as candle's `test_device!` does.
#[macro_export]
macro_rules! test_device {
    ($name:ident) => {
        mod $name {
            #[test]
            fn cpu() {
                super::$name($crate::Device::Cpu)
            }

            #[test]
            fn fake() {
                super::$name($crate::Device::Fake(0))
            }

            #[test]
            fn cuda() {
                match $crate::testing::device_if_available($crate::Device::Cuda(0)) {
                    Ok(d) => super::$name(d),
                    Err(why) if $crate::testing::cuda_required() => {
                        panic!(
                            "{}: BRIGADE_REQUIRE_CUDA=1 but {why}",
                            concat!(module_path!(), "::cuda")
                        )
                    }
                    Err(why) => $crate::testing::report_skip(concat!(module_path!(), "::cuda"), &why),
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::device_if_available;
    use crate::Device;

    #[test]
    fn the_cuda_instance_runs_exactly_when_cuda_0_is_usable() {
        // test_device!'s cuda instance runs the op test iff this is Ok: it must agree with
        // the probe (a GPU machine runs every op test on cuda:0; elsewhere the reason is
        // the probe's, e.g. the missing libcuda.so.1).
        match crate::cuda::probe::require(0) {
            Ok(()) => assert_eq!(device_if_available(Device::Cuda(0)), Ok(Device::Cuda(0))),
            Err(missing) => assert_eq!(device_if_available(Device::Cuda(0)), Err(missing.on(Device::Cuda(0)))),
        }
        assert_eq!(device_if_available(Device::Cpu), Ok(Device::Cpu));
    }
}
