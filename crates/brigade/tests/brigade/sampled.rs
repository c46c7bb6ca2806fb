//! Reading the data through a distributed sampler (`DataOrder::Sampled`, `--shuffle`): every row
//! once per epoch across the ranks, the same seed the same order, N ranks == one rank on the same
//! global batches, a resume mid-epoch on the same row of the same permutation, and every rank's
//! length known before step 0.

use std::sync::Mutex;

use brigade::config::CheckpointConfig;
use brigade::launch::LaunchConfig;
use brigade::models::{Batch, Dataset, DistributedSampler, Mlp, MlpConfig, SamplerOptions, SamplerPosition};
use brigade::source::{DataLength, DataOrder, DataSource, Microbatch};
use brigade::{fit, OptimizerConfig, RunReport, TrainConfig};

const ROWS: usize = 48;

/// A dataset that records which rows each rank gathered, in order.
struct Recording {
    inner: Dataset,
    seen: Mutex<Vec<(usize, Vec<usize>)>>,
}

impl Recording {
    fn new() -> Recording {
        Recording {
            inner: Dataset::teacher(ROWS, 6, 3, 1).unwrap(),
            seen: Mutex::new(vec![]),
        }
    }

    /// Every row rank `rank` read, in order.
    fn rows_of(&self, rank: usize) -> Vec<usize> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|(r, _)| *r == rank)
            .flat_map(|(_, rows)| rows.clone())
            .collect()
    }
}

impl DataSource for Recording {
    fn batch(&self, mb: &Microbatch) -> brigade::Result<Batch> {
        DataSource::batch(&self.inner, mb)
    }

    fn num_rows(&self) -> Option<usize> {
        Some(self.inner.len())
    }

    fn gather(&self, rank: usize, rows: &[usize]) -> brigade::Result<Batch> {
        self.seen.lock().unwrap().push((rank, rows.to_vec()));
        DataSource::gather(&self.inner, rank, rows)
    }

    fn fingerprint(&self) -> Option<String> {
        DataSource::fingerprint(&self.inner)
    }
}

fn config(steps: usize, batch: usize, order: DataOrder) -> TrainConfig {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.2,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    {
        let mut c = TrainConfig::new(steps, batch, sgd);
        c.model.name = "mlp".into();
        c.runtime.compute_threads = Some(1);
        c.data.order = order;
        c
    }
}

fn run(world: usize, cfg: &TrainConfig, data: &Recording) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(world),
        cfg,
        |_| Ok(data),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![6, 16, 3]), 0)?)),
    )
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{what}: step {s}: {x} vs {y}");
    }
}

#[test]
fn every_row_once_per_epoch_across_the_ranks_and_the_same_seed_the_same_order() {
    // 48 rows, 2 ranks of 4 rows: 6 steps an epoch; 12 steps are two epochs
    let data = Recording::new();
    let report = run(2, &config(12, 4, DataOrder::shuffle(7, false)), &data).unwrap();
    assert_eq!(report.outcome.rank_lengths, DataLength::PerEpoch(vec![24, 24]));
    assert_eq!(report.outcome.sampler, Some(SamplerPosition { epoch: 2, index: 0 }));
    let (r0, r1) = (data.rows_of(0), data.rows_of(1));
    assert_eq!((r0.len(), r1.len()), (48, 48));
    let mut epochs = vec![];
    for e in 0..2 {
        let mut rows: Vec<usize> = r0[e * 24..(e + 1) * 24]
            .iter()
            .chain(&r1[e * 24..(e + 1) * 24])
            .copied()
            .collect();
        epochs.push(rows.clone());
        rows.sort_unstable();
        assert_eq!(
            rows,
            (0..ROWS).collect::<Vec<_>>(),
            "epoch {e}: every row once across the ranks"
        );
    }
    assert_ne!(epochs[0], epochs[1], "each epoch its own permutation");
    assert_ne!(r0[..24], (0..24).collect::<Vec<_>>()[..], "shuffled, not in order");

    let again = Recording::new();
    run(2, &config(12, 4, DataOrder::shuffle(7, false)), &again).unwrap();
    assert_eq!(
        (again.rows_of(0), again.rows_of(1)),
        (r0.clone(), r1),
        "the same seed, the same order"
    );
    let other = Recording::new();
    run(2, &config(12, 4, DataOrder::shuffle(8, false)), &other).unwrap();
    assert_ne!(other.rows_of(0), r0, "another seed, another order");
}

#[test]
fn two_ranks_equal_one_rank_on_the_same_global_batches() {
    let (a, b) = (Recording::new(), Recording::new());
    let two = run(2, &config(9, 4, DataOrder::shuffle(3, false)), &a).unwrap();
    let one = run(1, &config(9, 8, DataOrder::shuffle(3, false)), &b).unwrap();
    assert_close(
        &two.outcome.losses(),
        &one.outcome.losses(),
        "2 ranks x 4 rows vs 1 rank x 8 rows, shuffled",
    );
    // the same rows per step: rank 0 and 1 of a step together are the one rank's batch
    let (r0, r1, whole) = (a.rows_of(0), a.rows_of(1), b.rows_of(0));
    for s in 0..9 {
        let mut two_ranks: Vec<usize> = r0[s * 4..s * 4 + 4]
            .iter()
            .chain(&r1[s * 4..s * 4 + 4])
            .copied()
            .collect();
        let mut one_rank = whole[s * 8..s * 8 + 8].to_vec();
        two_ranks.sort_unstable();
        one_rank.sort_unstable();
        assert_eq!(two_ranks, one_rank, "step {s}");
    }
    for ((n, x), (_, y)) in two.outcome.params.iter().zip(&one.outcome.params) {
        let (x, y) = (x.to_f64_vec().unwrap(), y.to_f64_vec().unwrap());
        assert_close(&x, &y, n);
    }
}

#[test]
fn a_resume_mid_epoch_lands_on_the_same_row_of_the_same_permutation() {
    let dir = crate::common::tmp("sampled", "resume");
    let ckpt = dir.join("run.ckpt");
    let order = DataOrder::shuffle(5, false);
    let straight_data = Recording::new();
    let straight = run(2, &config(10, 4, order), &straight_data).unwrap();
    // 6 steps an epoch: stop at step 8, row 8 of epoch 1
    let first = {
        let mut c = config(8, 4, order);
        c.runtime.checkpoint = CheckpointConfig {
            path: Some(ckpt.clone()),
            ..CheckpointConfig::default()
        };
        c
    };
    let stopped = run(2, &first, &Recording::new()).unwrap();
    assert_eq!(stopped.outcome.sampler, Some(SamplerPosition { epoch: 1, index: 8 }));
    let resume = {
        let mut c = config(10, 4, order);
        c.runtime.checkpoint = CheckpointConfig {
            resume: Some(ckpt.clone()),
            ..CheckpointConfig::default()
        };
        c
    };
    let resumed_data = Recording::new();
    let resumed = run(2, &resume, &resumed_data).unwrap();
    assert_eq!(resumed.outcome.first_step, 8);
    assert_eq!(resumed.outcome.losses(), straight.outcome.losses()[8..], "bit for bit");
    assert_eq!(resumed_data.rows_of(0), straight_data.rows_of(0)[32..], "the same rows");
    assert_eq!(resumed_data.rows_of(1), straight_data.rows_of(1)[32..], "the same rows");

    // in order, another seed, or another world size: refused, naming what differs
    let e = run(
        2,
        &{
            let mut c = resume.clone();
            c.data.order = DataOrder::InOrder;
            c
        },
        &Recording::new(),
    )
    .err()
    .expect("rows in order")
    .to_string();
    assert!(e.contains("data order") && e.contains("rows in order"), "{e}");
    let e = run(
        2,
        &{
            let mut c = resume.clone();
            c.data.order = DataOrder::shuffle(6, false);
            c
        },
        &Recording::new(),
    )
    .err()
    .expect("another seed")
    .to_string();
    assert!(e.contains("seed=5") && e.contains("seed=6"), "{e}");
    let e = run(1, &resume, &Recording::new()).err().expect("one rank").to_string();
    assert!(e.contains("world size"), "{e}");
}

#[test]
fn the_default_order_is_rows_in_order_and_endless() {
    let data = Recording::new();
    let report = run(2, &config(3, 4, DataOrder::InOrder), &data).unwrap();
    assert_eq!(report.outcome.rank_lengths, DataLength::Endless);
    assert_eq!(report.outcome.sampler, None);
    assert!(
        data.rows_of(0).is_empty(),
        "rows in order are read by Microbatch::first_row, not gathered"
    );
}

/// Rank r reads its own file of `lens[r]` rows (a file per rank).
struct PerRank {
    files: Vec<Dataset>,
}

impl DataSource for PerRank {
    fn batch(&self, mb: &Microbatch) -> brigade::Result<Batch> {
        Ok(self.files[mb.rank].batch(mb.index * mb.rows, mb.rows)?)
    }

    fn gather(&self, rank: usize, rows: &[usize]) -> brigade::Result<Batch> {
        Ok(self.files[rank].gather(rows)?)
    }

    fn sampler(&self, rank: usize, _world: usize, options: SamplerOptions) -> brigade::Result<DistributedSampler> {
        Ok(DistributedSampler::new(self.files[rank].len(), 1, 0, options)?)
    }
}

#[test]
fn files_of_different_lengths_per_rank_are_reported_before_step_0() {
    let per_rank = PerRank {
        files: vec![
            Dataset::teacher(40, 6, 3, 1).unwrap(),
            Dataset::teacher(24, 6, 3, 2).unwrap(),
        ],
    };
    let order = DataOrder::shuffle(0, false);
    assert_eq!(
        per_rank.rank_lengths(2, &order).unwrap(),
        DataLength::PerEpoch(vec![40, 24])
    );
    assert_eq!(per_rank.rank_lengths(2, &order).unwrap().batches(8), Some(vec![5, 3]));
    // without a join mode the trainer refuses uneven lengths before any step, naming the
    // shortest and the longest rank
    let e = fit(
        &LaunchConfig::threads(2),
        &config(3, 8, order),
        |_| Ok(per_rank),
        |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![6, 16, 3]), 0)?)),
    )
    .err()
    .expect("uneven")
    .to_string();
    assert!(e.contains("rank 1 with 24") && e.contains("rank 0 with 40"), "{e}");
}
