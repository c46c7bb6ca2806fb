//! `brigade bench gemm`: Brigade's matmul beside the `gemm` crate called directly.

use crate::common;

use common::{fails, ok};

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
    assert!(fails(&["bench", "gemm", "--dtypes", "bf16"]).contains("f32 only"));
    // no GPU here (nor in CI): one line saying what is missing
    assert!(fails(&["bench", "gemm", "--device", "cuda"]).contains("cuda:0"));
}
