//! `brigade bench gemm`: Brigade's matmul beside the `gemm` crate called directly; and the CPU
//! GEMM library a run goes through (oneDNN or the `gemm` crate), named where a run reports and
//! one error line when the one forced cannot be used.

use crate::common;

use common::{cat, fails, ok};

#[test]
fn bench_gemm_prints_brigade_beside_the_direct_call_for_every_shape() {
    let json = ok(&[
        "bench",
        "gemm",
        "--shapes",
        "64x96x80,33x17x5",
        "--reps",
        "2",
        "--threads",
        "1",
        "--numpy-gflops",
        "50,10",
        "--json",
    ]);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["shape"], serde_json::json!([64, 96, 80]));
    for r in &rows {
        for k in ["brigade_gflops", "direct_gflops"] {
            let g = r[k].as_f64().unwrap();
            assert!(g.is_finite() && g > 0.0, "{k} {g}");
        }
    }
    assert_eq!(rows[1]["numpy_gflops"], 10.0);
    let table = ok(&["bench", "gemm", "--shapes", "32x32x32", "--reps", "1"]);
    assert!(table.contains("gemm crate") && table.contains("32x32x32"), "{table}");
}

#[test]
fn bench_gemm_refuses_what_it_cannot_measure() {
    assert!(fails(&["bench", "gemm", "--shapes", "64x0x8"]).contains("64x0x8"));
    assert!(fails(&["bench", "gemm", "--shapes", "64x8"]).contains("MxKxN"));
    assert!(fails(&["bench", "gemm", "--reps", "0"]).contains("--reps"));
    assert!(fails(&["bench", "gemm", "--shapes", "8x8x8", "--numpy-gflops", "1,2"])
        .contains("one positive figure per shape"));
    assert!(fails(&["bench", "gemm", "--device", "tpu"]).contains("cpu, cuda or cuda:N"));
    assert!(fails(&["bench", "gemm", "--dtypes", "f8"]).contains("'f8' is not f32, f16 or bf16"));
    // no GPU here (nor in CI): one line saying what is missing
    assert!(fails(&["bench", "gemm", "--device", "cuda"]).contains("cuda:0"));
}

/// `brigade` with these environment variables set.
fn with_env(env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(common::bin());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.args(args).output().expect("run brigade")
}

const TINY_MLP: &[&str] = &[
    "train",
    "--model",
    "mlp",
    "--widths",
    "8,16,4",
    "--batch-size",
    "4",
    "--steps",
    "2",
    "--quiet",
];

#[test]
fn bench_gemm_times_bf16_on_the_cpu_and_names_the_library() {
    let out = with_env(
        &[("BRIGADE_GEMM", "gemm")],
        &[
            "bench",
            "gemm",
            "--shapes",
            "48x40x24",
            "--reps",
            "1",
            "--threads",
            "1",
            "--dtypes",
            "f32,bf16",
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0]["dtype"].as_str(), rows[1]["dtype"].as_str()),
        (Some("f32"), Some("bf16"))
    );
    for r in &rows {
        assert_eq!(r["cpu_gemm"], "gemm crate");
        assert!(r["brigade_gflops"].as_f64().is_some_and(|g| g > 0.0), "{r}");
    }
}

#[test]
fn a_run_names_its_cpu_gemm_and_runs_without_onednn() {
    // no oneDNN where the environment points: the gemm crate, said in the summary
    let out = with_env(
        &[("BRIGADE_ONEDNN", "/nonexistent/libdnnl.so.2")],
        &cat(&[TINY_MLP, &["--json"]]),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["cpu_gemm"], "gemm crate");
    let out = with_env(&[("BRIGADE_GEMM", "gemm")], TINY_MLP);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CPU GEMM: gemm crate"));
    // oneDNN where it loads (CI installs it): named with its version
    let out = with_env(&[("BRIGADE_GEMM", "onednn")], &cat(&[TINY_MLP, &["--json"]]));
    if out.status.success() {
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let name = summary["cpu_gemm"].as_str().unwrap_or_default().to_string();
        assert!(name.starts_with("onednn 2."), "{name}");
    } else {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI=true but oneDNN did not load"
        );
    }
}

#[test]
fn a_forced_library_that_cannot_be_used_is_one_error_line() {
    for (env, says) in [
        (
            vec![
                ("BRIGADE_GEMM", "onednn"),
                ("BRIGADE_ONEDNN", "/nonexistent/libdnnl.so.2"),
            ],
            "/nonexistent/libdnnl.so.2",
        ),
        (vec![("BRIGADE_GEMM", "blas")], "BRIGADE_GEMM=blas"),
    ] {
        for args in [TINY_MLP, &["bench", "gemm", "--shapes", "8x8x8", "--reps", "1"]] {
            let out = with_env(&env, args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{env:?} {args:?} should fail");
            assert!(err.starts_with("error: ") && err.contains(says), "{err}");
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
            assert!(
                out.stdout.is_empty(),
                "no work done: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }
}
