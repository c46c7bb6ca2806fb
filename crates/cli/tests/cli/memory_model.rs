//! The memory model (`memory.predicted_peak_bytes`, what `--memory-budget` and `plan` use)
//! against the run's measured peak (`memory.peak_bytes`, every step's, the first included) over
//! world 1, 2, 4 and 8 and ZeRO 0 to 3: an MLP whose layers fill two buckets of the default caps
//! (the first step's bucket rebuild and ZeRO-1/2's largest bucket landing raise its peak), and
//! the GPT at world 8 with and without checkpointing (`activation_checkpointing.rs` holds it at
//! world 1, 2 and 4).

use super::common::{cat, ok};

/// `(measured, predicted)` peak of a 2-step run with `flags`.
fn peaks(flags: &[&str]) -> (f64, f64) {
    let out = ok(&cat(&[&["train", "--steps", "2", "--json"], flags]));
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let m = &json["memory"];
    (
        m["peak_bytes"].as_f64().unwrap(),
        m["predicted_peak_bytes"].as_f64().unwrap(),
    )
}

fn within_ten_percent(model: &[&str], worlds: &[&str], extra: &[&[&str]]) {
    let mut worst = (0.0f64, String::new());
    for world in worlds {
        for zero in ["0", "1", "2", "3"] {
            for more in extra {
                let flags = cat(&[model, &["--world-size", world, "--zero", zero], more]);
                let (measured, predicted) = peaks(&flags);
                let err = predicted / measured - 1.0;
                if err.abs() > worst.0.abs() {
                    worst = (
                        err,
                        format!("{flags:?}: predicted {predicted} against measured {measured}"),
                    );
                }
            }
        }
    }
    assert!(worst.0.abs() < 0.10, "{:+.1}% at {}", 100.0 * worst.0, worst.1);
}

#[test]
fn the_mlp_s_predicted_peak_meets_the_measured_one_within_ten_percent_at_every_world_and_stage() {
    let mlp = [
        "--model",
        "mlp",
        "--widths",
        // 0.6 M parameters: a first bucket of 1 MiB and a second of 1.3 MB (the 2.2 M of
        // 128-1024-1024-1024-10 took twice the time and checked nothing more: without the
        // landing and rebuild moments both miss by 12% at world 2, ZeRO-1)
        "128,512,512,512,10",
        "--batch-size",
        "16",
    ];
    within_ten_percent(&mlp, &["1", "2", "4", "8"], &[&[]]);
}

#[test]
fn the_gpt_s_predicted_peak_meets_the_measured_one_within_ten_percent_at_world_8() {
    let gpt = [
        "--model",
        "gpt",
        "--d-model",
        "64",
        "--d-ff",
        "256",
        "--context",
        "32",
        "--layers",
        "3",
        "--heads",
        "2",
        "--batch-size",
        "8",
    ];
    within_ten_percent(&gpt, &["8"], &[&[], &["--activation-checkpointing"]]);
}

#[test]
fn the_memory_budget_advises_only_flags_that_combine_with_the_policy_given() {
    // DiLoCo keeps an outer copy of the parameters: 7.19 MiB predicted, over 6 MB; ZeRO-2 would
    // fit, but `--zero` does not combine with `--policy`
    let base = [
        "--model",
        "mlp",
        "--widths",
        "512,512,10",
        "--world-size",
        "2",
        "--steps",
        "3",
        "--batch-size",
        "8",
        "--memory-budget",
        "6",
    ];
    let e = super::common::fails(&super::common::cat(&[&["train"], &base, &["--policy", "diloco:2"]]));
    assert!(
        !e.contains("--zero") && e.contains("--policy zero2 in place of --policy diloco:2 would bring it to"),
        "{e}"
    );
    let d = super::common::dir("budget-advice-study");
    let e = super::common::fails(&super::common::cat(&[
        &["study"],
        &base,
        &[
            "--policy",
            "allreduce,diloco:2",
            "--target-loss",
            "1",
            "--out",
            super::common::s(&d),
        ],
    ]));
    assert!(
        !e.contains("--zero") && e.contains("zero2 in place of diloco:2 would bring it to"),
        "{e}"
    );
}
