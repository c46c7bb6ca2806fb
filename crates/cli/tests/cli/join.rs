//! `brigade train --data 'shard-{rank}.safetensors' --join MODE`: a file per rank, of any length
//! (uneven inputs, PyTorch's Join), under the thread backend.

use std::path::Path;

use brigade_models::save_safetensors;
use brigade_tensor::{DType, Rng, Tensor};

use crate::common::{cat, dir, fails, losses, ok, s, MLP};

/// Rank `rank`'s file for the small MLP: `rows` rows of its own.
fn shard(dir: &Path, rank: usize, rows: usize) {
    let mut rng = Rng::new(20 + rank as u64);
    let x = Tensor::randn(&[rows, 16], 1.0, DType::F32, &mut rng);
    let labels: Vec<i64> = x
        .to_vec::<f32>()
        .unwrap()
        .chunks(16)
        .map(|r| (0..4).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as i64)
        .collect();
    let y = Tensor::from_vec(labels, &[rows]).unwrap();
    let path = dir.join(format!("shard-{rank}.safetensors"));
    save_safetensors(&path, &[("inputs".into(), x), ("targets".into(), y)], None).unwrap();
}

#[test]
fn per_rank_files_of_different_lengths_train_with_join() {
    let d = dir("join-shards");
    // rank 0: 5 steps of 8 rows, rank 1: 3 (and 4 rows left over, not read)
    shard(&d, 0, 40);
    shard(&d, 1, 28);
    let pattern = d.join("shard-{rank}.safetensors");
    let base = cat(&[
        &["train"],
        MLP,
        &[
            "--world-size",
            "2",
            "--batch-size",
            "8",
            "--steps",
            "100",
            "--optimizer",
            "sgd",
        ],
        &["--data", s(&pattern)],
    ]);
    // without --join: one error line before step 0 naming the shortest and the longest rank
    let e = fails(&base);
    assert!(
        e.contains("shortest: rank 1 with 28 rows") && e.contains("longest: rank 0 with 40") && e.contains("--join"),
        "{e}"
    );
    let l = d.join("losses.csv");
    let run = |mode: &str| -> serde_json::Value {
        let out = ok(&cat(&[&base, &["--join", mode, "--json", "--losses", s(&l)]]));
        serde_json::from_str(out.lines().last().unwrap()).unwrap()
    };
    let initial = run("divide-initial");
    assert_eq!(
        initial["steps_run"], 5,
        "--steps counts the longest rank's: the data ends at step 5"
    );
    assert_eq!(initial["joined_at"], serde_json::json!([null, 3]));
    assert_eq!(initial["data_ended"], 5);
    assert_eq!(initial["join"], "divide-initial");
    assert_eq!(losses(&l).len(), 5);
    let active = run("divide-active");
    assert_eq!(active["steps_run"], 5);
    // the steps both ranks train are the same; after rank 1 joined the divisor differs
    assert_eq!(active["first_loss"], initial["first_loss"]);
    assert_ne!(active["last_loss"], initial["last_loss"]);
    // the text summary names each rank's join
    let out = ok(&cat(&[&base, &["--join", "divide-initial"]]));
    assert!(
        out.contains(
            "join (divide-initial): joined rank 0 never, rank 1 at step 3; every rank's data had ended at step 5"
        ),
        "{out}"
    );
    // throw: one error line at step 3 naming rank 1, the finished steps' losses kept
    let e = fails(&cat(&[&base, &["--join", "throw", "--losses", s(&l)]]));
    assert!(
        e.contains("step 3: rank 1's data ended") && e.contains("--join throw"),
        "{e}"
    );
    assert_eq!(losses(&l).len(), 3);
    // a rank without its file is named
    let e = fails(&cat(&[
        &["train"],
        MLP,
        &[
            "--world-size",
            "3",
            "--batch-size",
            "8",
            "--steps",
            "3",
            "--join",
            "throw",
        ],
        &["--data", s(&pattern)],
    ]));
    assert!(e.contains("rank 2's file") && e.contains("shard-2.safetensors"), "{e}");
    // --val-fraction cuts one file: refused with per-rank files
    let e = fails(&cat(&[
        &base,
        &["--join", "throw", "--eval-every", "2", "--val-fraction", "0.2"],
    ]));
    assert!(e.contains("--val-fraction") && e.contains("--eval-data"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}
