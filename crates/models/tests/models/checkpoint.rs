//! Safetensors checkpoints: exact round trips, atomic writes, clear errors for missing,
//! corrupt and mismatched files, dtype conversion on load.

use std::collections::HashMap;

use brigade_models::{
    load_params, load_safetensors, load_safetensors_with_metadata, save_params, save_safetensors, Gpt, GptConfig, Mlp,
    MlpConfig, Model, ModelError,
};
use brigade_tensor::{DType, Rng, Tensor};

use crate::common::Scratch;

/// A fresh, empty directory for one test.
fn tmpdir(name: &str) -> Scratch {
    Scratch::dir(name)
}

fn mlp() -> Mlp {
    Mlp::new(MlpConfig::new(vec![6, 5, 3]), 1).unwrap()
}

#[test]
fn every_dtype_round_trips_exactly_with_names_and_metadata() {
    let dir = tmpdir("roundtrip");
    let mut rng = Rng::new(1);
    let base = Tensor::randn(&[3, 4], 1.0, DType::F64, &mut rng);
    let tensors: Vec<(String, Tensor)> = vec![
        ("a.f32".into(), base.to_dtype(DType::F32).unwrap()),
        ("b.f64".into(), base.clone()),
        ("c.f16".into(), base.to_dtype(DType::F16).unwrap()),
        ("d.bf16".into(), base.to_dtype(DType::BF16).unwrap()),
        (
            "e.i64".into(),
            Tensor::from_vec(vec![-3i64, 0, 7, i64::MAX], &[2, 2]).unwrap(),
        ),
        ("f.u8".into(), Tensor::from_vec(vec![0u8, 1, 255], &[3]).unwrap()),
        ("f.i8".into(), Tensor::from_vec(vec![-127i8, 0, 5, 127], &[4]).unwrap()),
        ("g.scalar".into(), Tensor::scalar(2.5, DType::F32)),
        // a non-contiguous view is written in row-major order
        ("h.view".into(), base.t().unwrap()),
    ];
    let meta = HashMap::from([("step".to_string(), "42".to_string())]);
    let path = dir.join("all.safetensors");
    save_safetensors(&path, &tensors, Some(meta.clone())).unwrap();
    let (loaded, got_meta) = load_safetensors_with_metadata(&path).unwrap();
    assert_eq!(got_meta, meta);
    let mut names: Vec<&str> = loaded.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        ["a.f32", "b.f64", "c.f16", "d.bf16", "e.i64", "f.i8", "f.u8", "g.scalar", "h.view"]
    );
    for (name, want) in &tensors {
        let got = &loaded.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!((got.dtype(), got.shape()), (want.dtype(), want.shape()), "{name}");
        let (g, w) = (got.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
        assert!(
            g.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: {g:?} vs {w:?}"
        );
    }
}

fn file_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    names.sort();
    names
}

#[test]
fn save_leaves_no_temporary_file_and_names_a_missing_directory() {
    let dir = tmpdir("atomic");
    let path = dir.join("model.safetensors");
    let m = mlp();
    save_params(m.params(), &path).unwrap();
    // overwrite an existing checkpoint
    save_params(m.params(), &path).unwrap();
    assert_eq!(file_names(&dir), ["model.safetensors"]);
    // a directory that does not exist: an error naming the path, and nothing left behind
    let bad = dir.join("missing-dir").join("x.safetensors");
    let e = save_params(m.params(), &bad).unwrap_err().to_string();
    assert!(e.contains("missing-dir"), "{e}");
    assert_eq!(file_names(&dir), ["model.safetensors"]);
}

/// Set in the child process of [`a_write_that_fails_midway_leaves_the_old_checkpoint_intact`].
const FSIZE_CHILD: &str = "BRIGADE_TEST_FSIZE_CHILD";
/// The file-size limit of that child: far below the size of the checkpoint it writes.
const FSIZE_LIMIT: u64 = 4096;

#[cfg(target_os = "linux")]
#[test]
fn a_write_that_fails_midway_leaves_the_old_checkpoint_intact() {
    // An old checkpoint; then a child process whose file-size limit (RLIMIT_FSIZE, which binds
    // root too, unlike file permissions) makes every write past 4 KiB fail with EFBIG saves a
    // bigger model (17 KiB) to the same path. A save that wrote in place would have truncated
    // the old file by then; an atomic one wrote a temporary file, whatever its name, and
    // removes it.
    let dir = tmpdir("midway");
    let path = dir.join("model.safetensors");
    save_params(mlp().params(), &path).unwrap();
    let old = std::fs::read(&path).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "checkpoint::save_under_a_file_size_limit",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FSIZE_CHILD, &path)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("save failed as expected:"),
        "the child: {text}"
    );
    assert!(text.contains("model.safetensors"), "the error names the path: {text}");
    let now = std::fs::read(&path).unwrap();
    assert!(
        now == old,
        "the old checkpoint must survive intact: {} bytes now, {} before",
        now.len(),
        old.len()
    );
    assert_eq!(
        file_names(&dir),
        ["model.safetensors"],
        "no temporary file is left behind"
    );
    load_params(mlp().params(), &path).unwrap();
}

/// The child of [`a_write_that_fails_midway_leaves_the_old_checkpoint_intact`]; does nothing
/// unless [`FSIZE_CHILD`] names the checkpoint to overwrite.
#[cfg(target_os = "linux")]
#[test]
fn save_under_a_file_size_limit() {
    let Some(path) = std::env::var_os(FSIZE_CHILD) else {
        return;
    };
    #[repr(C)]
    struct Rlimit {
        cur: u64,
        max: u64,
    }
    extern "C" {
        fn setrlimit(resource: i32, limit: *const Rlimit) -> i32;
        fn signal(signum: i32, handler: usize) -> usize;
    }
    const RLIMIT_FSIZE: i32 = 1;
    const SIGXFSZ: i32 = 25;
    const SIG_IGN: usize = 1;
    // SAFETY: plain libc calls on this process, with a valid rlimit; ignoring SIGXFSZ makes
    // the oversized write fail with EFBIG instead of killing the process.
    unsafe {
        assert_ne!(signal(SIGXFSZ, SIG_IGN), usize::MAX, "signal(SIGXFSZ)");
        assert_eq!(
            setrlimit(
                RLIMIT_FSIZE,
                &Rlimit {
                    cur: FSIZE_LIMIT,
                    max: FSIZE_LIMIT
                }
            ),
            0,
            "setrlimit"
        );
    }
    let bigger = Mlp::new(MlpConfig::new(vec![64, 64, 3]), 2).unwrap();
    let e = save_params(bigger.params(), &path).expect_err("a write past the file-size limit must fail");
    println!("save failed as expected: {e}");
}

#[test]
fn duplicate_names_are_refused() {
    let dir = tmpdir("dup");
    let t = Tensor::zeros(&[2], DType::F32);
    let e = save_safetensors(
        dir.join("d.safetensors"),
        &[("x".into(), t.clone()), ("x".into(), t)],
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("'x' appears twice"), "{e}");
}

#[test]
fn missing_and_corrupt_files_are_errors_naming_the_path() {
    let dir = tmpdir("corrupt");
    let missing = dir.join("nope.safetensors");
    let e = load_safetensors(&missing).unwrap_err();
    assert!(
        matches!(e, ModelError::Io { .. }) && e.to_string().contains("nope.safetensors"),
        "{e}"
    );

    let path = dir.join("cut.safetensors");
    save_params(mlp().params(), &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
    let e = load_safetensors(&path).unwrap_err();
    assert!(
        matches!(e, ModelError::Corrupt { .. }) && e.to_string().contains("cut.safetensors"),
        "{e}"
    );

    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"definitely not a checkpoint").unwrap();
    let e = load_params(mlp().params(), &garbage).unwrap_err();
    assert!(
        matches!(e, ModelError::Corrupt { .. }) && e.to_string().contains("garbage.safetensors"),
        "{e}"
    );
}

#[test]
fn params_load_into_a_differently_seeded_model() {
    let dir = tmpdir("params");
    let path = dir.join("gpt.safetensors");
    let cfg = GptConfig {
        vocab: 16,
        d_model: 8,
        n_layers: 1,
        n_heads: 2,
        d_ff: 16,
        context: 4,
        ..GptConfig::default()
    };
    let (a, b) = (Gpt::new(cfg.clone(), 1).unwrap(), Gpt::new(cfg, 2).unwrap());
    let tokens = Tensor::from_vec(vec![1i64, 2, 3, 4], &[1, 4]).unwrap();
    let la = a.logits(&tokens).unwrap().value().to_vec::<f32>().unwrap();
    assert_ne!(la, b.logits(&tokens).unwrap().value().to_vec::<f32>().unwrap());
    save_params(a.params(), &path).unwrap();
    load_params(b.params(), &path).unwrap();
    assert_eq!(la, b.logits(&tokens).unwrap().value().to_vec::<f32>().unwrap());
}

#[test]
fn half_precision_state_dicts_are_converted_to_the_param_dtype() {
    let dir = tmpdir("half");
    let path = dir.join("bf16.safetensors");
    let src = mlp();
    let halves: Vec<(String, Tensor)> = src
        .params()
        .named_values()
        .into_iter()
        .map(|(n, t)| (n, t.to_dtype(DType::BF16).unwrap()))
        .collect();
    save_safetensors(&path, &halves, None).unwrap();
    let dst = Mlp::new(MlpConfig::new(vec![6, 5, 3]), 99).unwrap();
    load_params(dst.params(), &path).unwrap();
    for ((name, want), p) in halves.iter().zip(dst.params().params()) {
        let got = p.value();
        assert_eq!(got.dtype(), DType::F32, "{name}");
        assert_eq!(got.to_f64_vec().unwrap(), want.to_f64_vec().unwrap(), "{name}");
    }
}

/// Saves `tensors`, loads them into the reference-shaped small MLP, returns the error.
fn mismatch(name: &str, tensors: Vec<(String, Tensor)>) -> String {
    let dir = tmpdir(name);
    let path = dir.join("m.safetensors");
    save_safetensors(&path, &tensors, None).unwrap();
    let m = mlp();
    let before = m
        .params()
        .named_values()
        .into_iter()
        .map(|(_, t)| t.to_vec::<f32>().unwrap())
        .collect::<Vec<_>>();
    let e = load_params(m.params(), &path).unwrap_err();
    let after = m
        .params()
        .named_values()
        .into_iter()
        .map(|(_, t)| t.to_vec::<f32>().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(before, after, "a failed load must not modify any parameter");
    assert!(matches!(e, ModelError::CheckpointMismatch { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("m.safetensors"), "{msg}");
    msg
}

#[test]
fn a_mismatched_checkpoint_names_the_first_mismatch() {
    let good = mlp().params().named_values();
    // wrong shape on layers.0.bias AND layers.1.weight: the first one (registration order) is reported
    let mut t = good.clone();
    t[1].1 = Tensor::zeros(&[4], DType::F32);
    t[2].1 = Tensor::zeros(&[5, 3], DType::F32);
    let e = mismatch("shape", t);
    assert!(
        e.contains("'layers.0.bias'") && e.contains("expected shape [5], found [4]"),
        "{e}"
    );

    // missing name
    let t: Vec<_> = good.iter().filter(|(n, _)| n != "layers.1.weight").cloned().collect();
    let e = mismatch("missing", t);
    assert!(
        e.contains("missing parameter 'layers.1.weight'") && e.contains("[3, 5]"),
        "{e}"
    );

    // renamed: the model's name is missing first
    let mut t = good.clone();
    t[3].0 = "layers.1.b".into();
    let e = mismatch("renamed", t);
    assert!(e.contains("missing parameter 'layers.1.bias'"), "{e}");

    // an extra tensor
    let mut t = good.clone();
    t.push(("layers.2.weight".into(), Tensor::zeros(&[1], DType::F32)));
    let e = mismatch("extra", t);
    assert!(e.contains("unexpected tensor 'layers.2.weight'"), "{e}");
}
