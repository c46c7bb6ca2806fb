//! `brigade bench fit` at a small size: under one budget per rank, ZeRO-3 with every block
//! checkpointed trains a member of the 40-block GPT family several times larger than plain DDP
//! does, each found by its measured peak.

use crate::common;

use common::{fails, ok};

#[test]
fn zero_3_with_checkpointing_fits_a_model_several_times_larger_than_plain_ddp() {
    let json = ok(&[
        "bench",
        "fit",
        "--budget-mib",
        "4",
        "--world-size",
        "4",
        "--blocks",
        "40",
        "--steps",
        "2",
        "--json",
    ]);
    let r: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    let budget = 4u64 << 20;
    for (row, peak) in [
        ("plain", "whole_run_peak_bytes"),
        ("zero_3_whole_run", "whole_run_peak_bytes"),
        ("zero_3_steady", "steady_peak_bytes"),
    ] {
        let p = r[row][peak].as_u64().unwrap_or_else(|| panic!("{row}: {r}"));
        assert!(p <= budget, "{row}: its peak {p} is over the budget: {r}");
    }
    // 4 ranks: the states a quarter of plain DDP's, one block a fortieth of the model, the
    // activations of one block at a time
    let steady = r["ratio_steady"].as_f64().unwrap();
    assert!(steady >= 3.5, "ZeRO-3's largest member / plain DDP's: {steady}: {r}");
    let whole = r["ratio_whole_run"].as_f64().unwrap();
    assert!(
        whole > 1.0,
        "counting the construction, ZeRO-3 still fits more: {whole}: {r}"
    );
}

#[test]
fn bench_fit_refuses_a_budget_or_shape_it_cannot_search() {
    assert!(fails(&["bench", "fit", "--budget-mib", "0"]).contains("--budget-mib"));
    assert!(fails(&["bench", "fit", "--budget-mib", "4", "--steps", "1"]).contains("--steps"));
    assert!(fails(&["bench", "fit", "--budget-mib", "4", "--world-size", "0"]).contains("--world-size"));
    // not even the narrowest member fits 64 KiB: said, not an error
    let none = ok(&[
        "bench",
        "fit",
        "--budget-mib",
        "0.0625",
        "--world-size",
        "2",
        "--blocks",
        "40",
    ]);
    assert!(none.contains("no member fits"), "{none}");
}
