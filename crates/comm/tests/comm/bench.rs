//! The bandwidth benchmark's arithmetic and plumbing (not its speed).

use brigade_comm::bench::{format_bytes, parse_size, run_comm_bench, CommBenchConfig};

#[test]
fn sizes_parse_and_print_in_binary_units() {
    assert_eq!(parse_size("4096"), Ok(4096));
    assert_eq!(parse_size("64K"), Ok(64 << 10));
    assert_eq!(parse_size("16MiB"), Ok(16 << 20));
    assert_eq!(parse_size("1G"), Ok(1 << 30));
    assert!(parse_size("lots").is_err());
    // a size that does not fit in usize is an error, not a wrapped-around shift
    assert!(parse_size("18446744073709551615K").unwrap_err().contains("more bytes"));
    assert!(parse_size("17179869184G").is_err());
    assert_eq!(format_bytes(16 << 20), "16 MiB");
    assert_eq!(format_bytes(1000), "1000 B");
}

#[test]
fn report_rows_follow_the_nccl_tests_definitions() {
    let cfg = CommBenchConfig {
        world_size: 4,
        sizes: vec![4096, 1 << 16],
        iters: Some(3),
        memcpy_bytes: 1 << 20,
    };
    let report = run_comm_bench(&cfg).unwrap();
    assert_eq!(report.rows.len(), 2);
    assert!(report.memcpy_bw > 0.0);
    for (row, bytes) in report.rows.iter().zip([4096, 1 << 16]) {
        assert_eq!((row.bytes, row.iters), (bytes, 3));
        assert!((row.algbw - bytes as f64 / row.time_s).abs() / row.algbw < 1e-9);
        assert!((row.busbw - row.algbw * 1.5).abs() / row.busbw < 1e-9); // 2(n-1)/n at n = 4
    }
    if std::path::Path::new("/proc/stat").exists() {
        // Linux counts the hypervisor's stolen time (zero on bare metal), for every size.
        assert!(
            report.rows.iter().all(|r| r.stolen_s.is_some_and(|s| s >= 0.0)),
            "{:?}",
            report.rows
        );
    }
    let table = report.to_table();
    assert!(
        table.contains("64 KiB") && table.contains("busbw") && table.contains("stolen ms"),
        "{table}"
    );
}
