//! `brigade train --data 'shard-{rank}.safetensors' --join MODE`: a file per rank, of any length
//! (uneven inputs, PyTorch's Join), under the thread backend.

use std::path::Path;

use brigade_tensor::Tensor;

use crate::common::{argmax_rows, cat, dir, fails, losses, ok, s, write_rows, MLP};

/// Rank `rank`'s file for the small MLP: `rows` rows of its own.
fn shard(dir: &Path, rank: usize, rows: usize) {
    let (x, y) = argmax_rows(rows, 16, 4, 20 + rank as u64);
    write_rows(&dir.join(format!("shard-{rank}.safetensors")), x, y, 16);
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
}

/// `rows` rows for the reference MLP (512 inputs, 10 classes), rank `rank`'s own.
fn reference_shard(path: &Path, rank: usize, rows: usize) {
    let (x, y) = argmax_rows(rows, 512, 10, 30 + rank as u64);
    write_rows(path, x, y, 512);
}

#[test]
fn three_reference_ranks_of_8_5_and_3_batches_train_as_the_replay_under_either_divisor() {
    use brigade::models::{Dataset, MlpConfig, ModelKind};
    // world 3, files of 8, 5 and 3 batches of 32 rows of the reference MLP's inputs and
    // classes, an MLP of two hidden layers of 256, SGD lr 0.1 without momentum: rank 2 joins at
    // step 3, rank 1 at step 5
    let d = dir("join-reference");
    let batches = [8usize, 5, 3];
    let file = |r: usize| d.join(format!("shard-{r}.safetensors"));
    for (r, &n) in batches.iter().enumerate() {
        reference_shard(&file(r), r, n * 32);
    }
    let kind = ModelKind::Mlp(MlpConfig::new(vec![512, 256, 256, 10]));
    let data: Vec<Dataset> = (0..3)
        .map(|r| Dataset::from_safetensors(file(r), &kind).unwrap())
        .collect();
    let pattern = d.join("shard-{rank}.safetensors");
    for mode in ["divide-initial", "divide-active"] {
        let save = d.join(format!("{mode}.safetensors"));
        ok(&[
            "train",
            "--quiet",
            "--world-size",
            "3",
            "--widths",
            "512,256,256,10",
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
            "--steps",
            "8",
            "--join",
            mode,
            "--data",
            s(&pattern),
            "--save",
            s(&save),
        ]);
        // The replay: one process, each step the sum of the gradients of the ranks with data
        // divided by 3 (divide-initial) or by their number (divide-active), then SGD. It rounds
        // as the ranks do (an f32 sum in rank order, a joined rank adding zeros, divided by the
        // world size; under divide-active then times 3 / active): a replay that sums in f64
        // differs from the run by a few ulps a step, and where one of the ReLUs' inputs sits
        // within those ulps of zero, the two take different sides of the kink and part ways
        // (4e-4 of the movement, seen with the reference widths under divide-initial from step 6).
        let m = kind.build(0).unwrap();
        let params = m.params().params().to_vec();
        let initial: Vec<Vec<f64>> = params.iter().map(|p| p.value().to_f64_vec().unwrap()).collect();
        let sgd = brigade::OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        };
        let mut opt = sgd.build(params.clone());
        for step in 0..8 {
            let active: Vec<usize> = (0..3).filter(|&r| step < batches[r]).collect();
            let mut sum: Vec<Vec<f32>> = initial.iter().map(|v| vec![0.0; v.len()]).collect();
            for &r in &active {
                m.params().zero_grad().unwrap();
                m.loss(&data[r].batch(step * 32, 32).unwrap())
                    .unwrap()
                    .backward()
                    .unwrap();
                for (acc, p) in sum.iter_mut().zip(&params) {
                    let g = p.grad().unwrap().to_vec::<f32>().unwrap();
                    acc.iter_mut().zip(g).for_each(|(a, g)| *a += g);
                }
            }
            let rescale = (mode == "divide-active" && active.len() < 3).then(|| 3.0 / active.len() as f64);
            for (acc, p) in sum.iter().zip(&params) {
                let g = p.grad().unwrap();
                let mean: Vec<f32> = acc
                    .iter()
                    .map(|a| a / 3.0)
                    .map(|q| rescale.map_or(q, |f| (f64::from(q) * f) as f32))
                    .collect();
                g.copy_from(&Tensor::from_vec(mean, g.shape()).unwrap()).unwrap();
            }
            opt.step().unwrap();
        }
        // |run - replay| / |replay - initial|, over every parameter
        let saved: std::collections::HashMap<String, Tensor> =
            brigade_models::load_safetensors(&save).unwrap().into_iter().collect();
        let (mut off, mut moved) = (0.0f64, 0.0f64);
        for ((name, replayed), initial) in m.params().named_values().iter().zip(&initial) {
            let run = saved[name].to_f64_vec().unwrap();
            for ((a, b), i) in run.iter().zip(replayed.to_f64_vec().unwrap()).zip(initial) {
                off += (a - b).powi(2);
                moved += (b - i).powi(2);
            }
        }
        let rel = (off / moved).sqrt();
        assert!(
            rel < 1e-5,
            "{mode}: the run is {rel} of the parameters' movement off the replay"
        );
    }
    // the divisors differ from step 3 on
    let (a, b) = (
        std::fs::read(d.join("divide-initial.safetensors")).unwrap(),
        std::fs::read(d.join("divide-active.safetensors")).unwrap(),
    );
    assert_ne!(a, b);
}

#[test]
fn per_rank_files_read_past_their_end_without_join_are_refused() {
    let d = dir("join-even-past-end");
    // two steps of 8 rows on each rank
    shard(&d, 0, 16);
    shard(&d, 1, 16);
    let pattern = d.join("shard-{rank}.safetensors");
    let base = cat(&[
        &["train"],
        MLP,
        &["--world-size", "2", "--batch-size", "8", "--optimizer", "sgd"],
        &["--data", s(&pattern)],
    ]);
    let e = fails(&cat(&[&base, &["--steps", "3"]]));
    assert!(
        e.contains("2 steps") && e.contains("--steps 3") && e.contains("--join"),
        "{e}"
    );
    ok(&cat(&[&base, &["--steps", "2"]]));
    // a sampler's epochs are what --shuffle asks for
    ok(&cat(&[&base, &["--steps", "3", "--shuffle"]]));
}

#[test]
fn the_shuffled_summary_names_each_rank_s_rows() {
    let d = dir("join-shuffle-rows");
    shard(&d, 0, 40);
    shard(&d, 1, 24);
    let pattern = d.join("shard-{rank}.safetensors");
    let out = ok(&cat(&[
        &["train"],
        MLP,
        &[
            "--world-size",
            "2",
            "--batch-size",
            "8",
            "--steps",
            "2",
            "--optimizer",
            "sgd",
        ],
        &["--data", s(&pattern), "--join", "divide-initial", "--shuffle"],
    ]));
    assert!(
        out.contains("data: shuffled, rows per epoch by rank: 40, 24; next (rank 0): epoch 0 row 16"),
        "{out}"
    );
}
