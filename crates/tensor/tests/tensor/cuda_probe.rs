//! Asking for a CUDA device never panics: on a machine without a driver, a library or a
//! GPU the answer is a typed `DeviceUnavailable` naming what is missing; on a GPU machine
//! device 0 opens and a device that does not exist is refused by number.

use brigade_tensor::cuda::probe::{self, Unavailable};
use brigade_tensor::cuda::CudaHandle;
use brigade_tensor::{Device, TensorError};

#[test]
fn a_missing_driver_library_or_device_is_a_typed_error_not_a_panic() {
    match probe::require(0) {
        Err(why) => {
            // This machine cannot serve CUDA: opening the device must say why, by name.
            let err = CudaHandle::open(0).expect_err("probe said unavailable, so opening must fail");
            let TensorError::DeviceUnavailable { device, reason } = err else {
                panic!("wrong error kind: {err:?}")
            };
            assert_eq!(device, Device::Cuda(0));
            assert_eq!(reason, why.to_string());
            let names = match &why {
                Unavailable::Driver => "libcuda.so.1",
                Unavailable::Cublas => "libcublas",
                Unavailable::Nvrtc => "libnvrtc",
                Unavailable::NoDevice { .. } => "no CUDA device 0",
                Unavailable::DriverCall { .. } => "CUDA driver failed",
                Unavailable::NotBuilt => "`cuda` cargo feature",
            };
            assert!(reason.contains(names), "{reason:?} should name {names}");
            if !cfg!(feature = "cuda") {
                assert_eq!(why, Unavailable::NotBuilt, "a build without the feature says so");
            } else if !probe::driver_present() {
                assert_eq!(
                    why,
                    Unavailable::Driver,
                    "without libcuda the driver is what is reported"
                );
            }
        }
        Ok(()) => {
            // A GPU machine: device 0 opens, and a device beyond the count is refused by number.
            let dev = CudaHandle::open(0).expect("device 0");
            assert_eq!(dev.device(), Device::Cuda(0));
            let count = probe::device_count().expect("device count");
            match CudaHandle::open(count) {
                Err(TensorError::DeviceUnavailable { reason, .. }) => {
                    assert!(reason.contains(&format!("no CUDA device {count}")), "{reason}")
                }
                other => panic!("device {count} of {count} must be refused, got {other:?}"),
            }
        }
    }
}
