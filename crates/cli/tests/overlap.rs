//! The simulated network as the sweep measures it: with ranks as threads every rank shares one
//! link, so each bucket's time on the link is the ring model's, whatever the threads' skew.

mod common;

use common::{dir, ok};

#[test]
fn the_sweeps_bucket_times_add_up_to_the_ring_model_of_the_gradient() {
    // mlp 64,256,256,4: 83,460 f32 parameters = 333,840 bytes. 2 ranks on a 1 Gb/s, 20 us link:
    // each bucket costs 2·20 us + S / 125e6 B/s, so the buckets together cost
    // buckets·40 us + 333,840 / 125e6 s = buckets·0.04 ms + 2.67072 ms.
    let out = dir("sweep-link");
    let json = ok(&[
        "sweep",
        "--model",
        "mlp",
        "--widths",
        "64,256,256,4",
        "--world-size",
        "2",
        "--threads-per-rank",
        "1",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--bucket-mb",
        "0.05,1",
        "--first-bucket-mb",
        "0.05",
        "--net-gbps",
        "1",
        "--net-latency-us",
        "20",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        let buckets = r["buckets"].as_f64().unwrap();
        let want = buckets * 0.04 + 333_840.0 / 125e6 * 1e3;
        let got = r["comm_ms"].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 0.01 * want,
            "cap {}: {got} ms on the link, the ring model says {want} ms",
            r["bucket_mb"]
        );
    }
}
