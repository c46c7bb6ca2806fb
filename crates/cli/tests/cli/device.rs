//! `--device`: `cpu` (the default) changes nothing; asking for CUDA on a machine that cannot
//! serve it is one error line naming what is missing, before step 0. The CUDA training path
//! itself needs a GPU (none here or in CI): these tests say so and skip that part.

use crate::common;

use brigade_models::load_safetensors_with_metadata;
use brigade_tensor::cuda::probe;
use brigade_tensor::Device;
use common::*;

/// Why CUDA device 0 cannot be used here, or `None` on a machine with a usable GPU.
fn cuda_missing() -> Option<String> {
    probe::require(0).err().map(|u| u.on(Device::Cuda(0)).to_string())
}

#[test]
fn asking_for_cuda_without_it_is_one_error_line_naming_what_is_missing_before_step_0() {
    let Some(missing) = cuda_missing() else {
        eprintln!("SKIPPED asking_for_cuda_without_it: cuda:0 is usable on this machine");
        return;
    };
    let d = dir("device-missing");
    for device in ["cuda", "cuda:0"] {
        for world in ["1", "2"] {
            let ck = d.join(format!("ck-{device}-{world}.safetensors").replace(':', "-"));
            let losses = d.join(format!("losses-{device}-{world}.csv").replace(':', "-"));
            let e = fails(
                &[
                    &["train"],
                    MLP,
                    &["--steps", "2", "--device", device, "--world-size", world],
                    &["--checkpoint", s(&ck), "--losses", s(&losses)],
                ]
                .concat(),
            );
            assert_eq!(e.trim_end(), format!("error: {missing}"), "--device {device}");
            if !cfg!(feature = "cuda") {
                // a CPU-only build (no cudarc) says so, in the same one line
                assert!(e.contains("`cuda` cargo feature"), "{e}");
            } else if !probe::driver_present() {
                assert!(e.contains("libcuda.so.1"), "{e}");
            }
            // Nothing ran: no step's loss, no checkpoint.
            assert!(
                !ck.exists() && !losses.exists(),
                "--device {device}: outputs were written"
            );
        }
    }
}

#[test]
fn a_gpu_the_driver_does_not_have_is_named() {
    let e = fails(&[&["train"], MLP, &["--steps", "1", "--device", "cuda:9999"]].concat());
    assert!(e.contains("cuda:9999"), "{e}");
}

#[test]
fn a_malformed_device_is_a_usage_error() {
    let out = brigade(&[&["train"], MLP, &["--steps", "1", "--device", "gpu"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
}

#[test]
fn device_cpu_is_the_default_and_trains_the_same() {
    let d = dir("device-cpu");
    let (a, b) = (d.join("default.safetensors"), d.join("cpu.safetensors"));
    let (la, lb) = (d.join("default.csv"), d.join("cpu.csv"));
    let run = |ck: &std::path::Path, losses: &std::path::Path, extra: &[&str]| {
        ok(&[
            &["train"],
            MLP,
            &["--steps", "3", "--accum", "2", "--world-size", "2"],
            &["--checkpoint", s(ck), "--losses", s(losses)],
            extra,
        ]
        .concat())
    };
    run(&a, &la, &[]);
    run(&b, &lb, &["--device", "cpu"]);
    // Every tensor of the checkpoint (parameters and optimizer state), bit for bit.
    let values = |p: &std::path::Path| -> Vec<(String, Vec<u64>)> {
        let (tensors, _) = load_safetensors_with_metadata(p).unwrap();
        let mut v: Vec<_> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.to_f64_vec().unwrap().iter().map(|x| x.to_bits()).collect()))
            .collect();
        v.sort();
        v
    };
    let (va, vb) = (values(&a), values(&b));
    assert!(!va.is_empty() && va == vb, "the checkpoints' tensors differ");
    assert_eq!(
        std::fs::read_to_string(&la).unwrap(),
        std::fs::read_to_string(&lb).unwrap(),
        "losses differ"
    );
}
