//! `--backend nccl`: without `--device cuda` it is one usage error line; on a machine without
//! a usable GPU or libnccl, one error line naming what is missing, under every reducer policy
//! (`--comm-hook fp16|bf16|powersgd`, `--zero 1|2`); never a panic, and nothing is trained or
//! written. NCCL itself needs a GPU (none here or in CI): scripts/gpu-check.sh.

use crate::common;

use brigade_tensor::cuda::probe;
use brigade_tensor::Device;
use common::*;

/// Whether libnccl loads (a build without the `cuda` feature has no NCCL: the probe's error
/// comes first there).
fn require_nccl() -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        brigade_comm::nccl::require_nccl().map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(())
    }
}

#[test]
fn nccl_without_a_cuda_device_is_one_usage_error_line() {
    let d = dir("nccl-cpu");
    let losses = d.join("losses.csv");
    for world in ["1", "2"] {
        let e = fails(
            &[
                &["train"],
                MLP,
                &["--steps", "1", "--backend", "nccl", "--world-size", world],
                &["--losses", s(&losses)],
            ]
            .concat(),
        );
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(
            e.starts_with("error: --backend nccl") && e.contains("--device cuda"),
            "{e}"
        );
        assert!(!losses.exists());
    }
}

#[test]
fn nccl_on_a_machine_without_gpu_or_libnccl_names_what_is_missing() {
    let missing = match (probe::require(0), require_nccl()) {
        (Err(u), _) => u.on(Device::Cuda(0)).to_string(),
        (Ok(()), Err(e)) => e,
        (Ok(()), Ok(())) => {
            eprintln!("SKIPPED nccl_on_a_machine_without_gpu_or_libnccl: cuda:0 and libnccl are usable here");
            return;
        }
    };
    let d = dir("nccl-missing");
    let losses = d.join("losses.csv");
    for world in ["1", "2"] {
        for policy in POLICIES {
            let e = fails(
                &[
                    &["train"],
                    MLP,
                    &[
                        "--steps",
                        "1",
                        "--backend",
                        "nccl",
                        "--device",
                        "cuda",
                        "--world-size",
                        world,
                    ],
                    policy,
                    &["--losses", s(&losses)],
                ]
                .concat(),
            );
            assert_eq!(e.trim_end(), format!("error: {missing}"), "{policy:?}");
            assert!(!losses.exists());
        }
    }
}

/// Every reducer policy the CLI names runs over `--backend nccl` (none is refused as a flag).
const POLICIES: [&[&str]; 6] = [
    &[],
    &["--comm-hook", "fp16"],
    &["--comm-hook", "bf16"],
    &["--comm-hook", "powersgd"],
    &["--zero", "1"],
    &["--zero", "2"],
];
