//! Each rank's shard of the training data: the [`Trainer`](crate::trainer::Trainer) asks a
//! [`DataSource`] for one [`Microbatch`] at a time, so any data a user has (rows in memory, files
//! per rank, a generator) feeds the same loop as `brigade train`'s [`Dataset`].

use brigade_models::{Batch, Dataset};

use crate::error::Result;

/// Which microbatch the trainer wants: step `step`, microbatch `index` of `accum`, for rank
/// `rank` of `world_size`, `rows` rows long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Microbatch {
    /// The optimizer step (counted from 0, also across a resume).
    pub step: usize,
    /// Which microbatch of the step (`0..accum`); all but the last accumulate under `no_sync`.
    pub index: usize,
    /// Microbatches per step.
    pub accum: usize,
    /// The rank asking.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// Rows per microbatch (the per-rank batch size).
    pub rows: usize,
}

impl Microbatch {
    /// The first row of this microbatch when the data is one sequence of rows, as `brigade
    /// train` shards it: step `s` takes the `world_size * accum * rows` rows from
    /// `s * world_size * accum * rows`, rank `r` the `r`-th block of `accum * rows` of them,
    /// microbatch `j` the `j`-th block of `rows` inside that. So N ranks over batch B give the
    /// gradients of one rank over batch N*B.
    pub fn first_row(&self) -> usize {
        ((self.step * self.world_size + self.rank) * self.accum + self.index) * self.rows
    }
}

/// Training data as the trainer reads it: each rank asks for its own microbatches. `Sync`:
/// one source serves every rank thread.
pub trait DataSource: Sync {
    /// The batch for `mb` (rank `mb.rank`'s share of step `mb.step`). A row-addressed source
    /// returns the `mb.rows` rows from [`Microbatch::first_row`].
    fn batch(&self, mb: &Microbatch) -> Result<Batch>;

    /// What identifies this data in a checkpoint, so that resuming on other data is an error
    /// (`None`: not recorded, not checked).
    fn fingerprint(&self) -> Option<String> {
        None
    }
}

/// The built-in datasets and safetensors data files, sharded by [`Microbatch::first_row`] (wrapping
/// around at the end).
impl DataSource for Dataset {
    fn batch(&self, mb: &Microbatch) -> Result<Batch> {
        Ok(Dataset::batch(self, mb.first_row(), mb.rows)?)
    }

    fn fingerprint(&self) -> Option<String> {
        Some(Dataset::fingerprint(self).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_row_is_step_then_rank_then_microbatch() {
        // world 2, accum 3, 4 rows: a step is 24 rows, a rank's share 12, a microbatch 4.
        let mb = |step, rank, index| Microbatch {
            step,
            index,
            accum: 3,
            rank,
            world_size: 2,
            rows: 4,
        };
        assert_eq!(mb(0, 0, 0).first_row(), 0);
        assert_eq!(mb(0, 0, 2).first_row(), 8);
        assert_eq!(mb(0, 1, 0).first_row(), 12);
        assert_eq!(mb(0, 1, 2).first_row(), 20);
        assert_eq!(mb(1, 0, 0).first_row(), 24);
        assert_eq!(mb(2, 1, 1).first_row(), 48 + 12 + 4);
    }
}
