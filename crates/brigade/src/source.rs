//! Each rank's shard of the training data: the [`Trainer`](crate::trainer::Trainer) asks a
//! [`DataSource`] for one [`Microbatch`] at a time, so any data a user has (rows in memory, files
//! per rank, a generator) feeds the same loop as `brigade train`'s [`Dataset`].
//!
//! Two orders ([`DataOrder`]): rows in order ([`DataOrder::InOrder`], the default: step `s`
//! reads the rows from [`Microbatch::first_row`], wrapping around, with no end), or through a
//! [`DistributedSampler`] ([`DataOrder::Sampled`]: PyTorch's `DistributedSampler`, a seeded
//! permutation per epoch, each rank a disjoint shard, padded or cut so that every rank reads as
//! many rows). A sampled source says before step 0 how many rows each rank reads per epoch
//! ([`DataSource::rank_lengths`]), and each rank reads its rows as one stream across epochs
//! through a [`SamplerCursor`](brigade_models::SamplerCursor) whose position checkpoints record.
//!
//! What a source serves is its own; the rows of a [`Dataset`] (built in, files, text, token
//! shards) are [`brigade_models::data`]'s, which this module reads through [`DataSource`].

use brigade_models::{Batch, Dataset, DistributedSampler, Remainder, SamplerOptions};

use crate::error::{Error, Result};

/// In which order the trainer reads a [`DataSource`]'s rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DataOrder {
    /// Rows in order: step `s`, rank `r`, microbatch `j` read the rows from
    /// [`Microbatch::first_row`] ([`DataSource::batch`]). The source has no end (a dataset
    /// wraps around) and no epochs.
    #[default]
    InOrder,
    /// Each rank reads its shard of every epoch's order, as [`DistributedSampler`] deals it
    /// (shuffled from `seed + epoch` when `shuffle`, padded or cut by `remainder`), one stream
    /// across epochs ([`DataSource::gather`]). [`Remainder::Uneven`] gives the ranks different
    /// lengths: it needs a join mode ([`crate::config::DataConfig::join`]).
    Sampled(SamplerOptions),
}

impl DataOrder {
    /// A seeded shuffle, each rank a disjoint shard; `drop_last` cuts the rows that do not
    /// divide among the ranks instead of repeating rows from the epoch's start.
    pub fn shuffle(seed: u64, drop_last: bool) -> DataOrder {
        DataOrder::Sampled(SamplerOptions {
            shuffle: true,
            seed,
            remainder: if drop_last { Remainder::Drop } else { Remainder::Pad },
        })
    }

    /// How checkpoints record the order (`None` for [`DataOrder::InOrder`], so that checkpoints
    /// of runs in order are as they were); a resume checks it.
    pub fn describe(&self) -> Option<String> {
        match self {
            DataOrder::InOrder => None,
            DataOrder::Sampled(o) => {
                let rem = match o.remainder {
                    Remainder::Pad => "pad",
                    Remainder::Drop => "drop_last",
                    Remainder::Uneven => "uneven",
                };
                Some(format!("sampler shuffle={} seed={} {rem}", o.shuffle, o.seed))
            }
        }
    }
}

/// How many rows each rank reads before its data ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataLength {
    /// No end: the rows wrap around (or are generated).
    Endless,
    /// Rows per epoch of each rank, by rank (every epoch has the same).
    PerEpoch(Vec<usize>),
}

impl DataLength {
    /// Whole microbatches of `rows` rows each rank reads per epoch (`None`: no end).
    pub fn batches(&self, rows: usize) -> Option<Vec<usize>> {
        match self {
            DataLength::Endless => None,
            DataLength::PerEpoch(v) => Some(v.iter().map(|n| n / rows.max(1)).collect()),
        }
    }

    /// Whether every rank reads as many rows (an endless source does).
    pub fn is_even(&self) -> bool {
        match self {
            DataLength::Endless => true,
            DataLength::PerEpoch(v) => v.windows(2).all(|w| w[0] == w[1]),
        }
    }
}

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
    /// The batch for `mb` (rank `mb.rank`'s share of step `mb.step`) under
    /// [`DataOrder::InOrder`]. A row-addressed source returns the `mb.rows` rows from
    /// [`Microbatch::first_row`].
    fn batch(&self, mb: &Microbatch) -> Result<Batch>;

    /// The rows one epoch has, for a [`DistributedSampler`] (`None`: the source cannot be read
    /// by row index, only in order).
    fn num_rows(&self) -> Option<usize> {
        None
    }

    /// Rank `rank`'s rows `rows` (indices its sampler gave, repeats allowed), under
    /// [`DataOrder::Sampled`].
    fn gather(&self, rank: usize, rows: &[usize]) -> Result<Batch> {
        let _ = (rank, rows);
        Err(Error::Config(
            "this data source cannot be read by row index (DataSource::gather), so it cannot be shuffled or sampled; read it in order".into(),
        ))
    }

    /// Rank `rank`'s sampler of `world_size` under `options`: by default one
    /// [`DistributedSampler`] over [`DataSource::num_rows`], each rank a disjoint shard. A
    /// source with its own rows per rank (a file per rank) returns a sampler over that rank's
    /// rows.
    fn sampler(&self, rank: usize, world_size: usize, options: SamplerOptions) -> Result<DistributedSampler> {
        let n = self.num_rows().ok_or_else(|| {
            Error::Config(
                "this data source has no length (DataSource::num_rows), so it cannot be shuffled or sampled; read it in order".into(),
            )
        })?;
        Ok(DistributedSampler::new(n, world_size, rank, options)?)
    }

    /// How many rows each of `world_size` ranks reads per epoch under `order`, known before
    /// step 0 (rows in order never end).
    fn rank_lengths(&self, world_size: usize, order: &DataOrder) -> Result<DataLength> {
        match order {
            DataOrder::InOrder => Ok(DataLength::Endless),
            DataOrder::Sampled(o) => (0..world_size)
                .map(|r| Ok(self.sampler(r, world_size, *o)?.num_samples()))
                .collect::<Result<Vec<_>>>()
                .map(DataLength::PerEpoch),
        }
    }

    /// What identifies this data in a checkpoint, so that resuming on other data is an error
    /// (`None`: not recorded, not checked).
    fn fingerprint(&self) -> Option<String> {
        None
    }
}

/// Implements [`DataSource`] for a pointer to a source by forwarding every method to it.
macro_rules! forward_data_source {
    ($($(#[$doc:meta])* $ptr:ty;)*) => {$(
        $(#[$doc])*
        impl<T: DataSource + ?Sized> DataSource for $ptr {
            fn batch(&self, mb: &Microbatch) -> Result<Batch> {
                (**self).batch(mb)
            }

            fn num_rows(&self) -> Option<usize> {
                (**self).num_rows()
            }

            fn gather(&self, rank: usize, rows: &[usize]) -> Result<Batch> {
                (**self).gather(rank, rows)
            }

            fn sampler(&self, rank: usize, world_size: usize, options: SamplerOptions) -> Result<DistributedSampler> {
                (**self).sampler(rank, world_size, options)
            }

            fn rank_lengths(&self, world_size: usize, order: &DataOrder) -> Result<DataLength> {
                (**self).rank_lengths(world_size, order)
            }

            fn fingerprint(&self) -> Option<String> {
                (**self).fingerprint()
            }
        }
    )*};
}

forward_data_source! {
    /// A borrowed source is the source: one dataset can feed several runs (e.g. a run resumed
    /// between evaluations) without a copy.
    &T;
    /// A boxed source is the source (a program picks its kind of data at run time).
    Box<T>;
}

/// Each rank's own data (a file per rank, of any length: `brigade train --data
/// 'shard-{rank}.safetensors'`): rank `r` reads `shards[r]`'s rows in order, `rows` a
/// microbatch (step `s`, microbatch `j` of `accum`: the rows from `(s * accum + j) * rows`), or
/// shuffled by a sampler over its own rows alone. Its length per rank is its shard's, known
/// before step 0 in either order; shards of different lengths need a join mode
/// ([`crate::config::DataConfig::join`]).
pub struct RankShards {
    shards: Vec<Dataset>,
}

impl RankShards {
    /// Rank `r`'s data is `shards[r]`.
    pub fn new(shards: Vec<Dataset>) -> RankShards {
        RankShards { shards }
    }

    /// The shards, by rank.
    pub fn shards(&self) -> &[Dataset] {
        &self.shards
    }

    fn shard(&self, rank: usize) -> Result<&Dataset> {
        self.shards.get(rank).ok_or_else(|| {
            Error::Data(format!(
                "rank {rank} has no shard: the data has {} (one per rank)",
                self.shards.len()
            ))
        })
    }

    fn check_world(&self, world_size: usize) -> Result<()> {
        if self.shards.len() != world_size {
            return Err(Error::Config(format!(
                "the data has {} per-rank shards but the run has {world_size} ranks: give one shard per rank",
                self.shards.len()
            )));
        }
        Ok(())
    }
}

impl DataSource for RankShards {
    fn batch(&self, mb: &Microbatch) -> Result<Batch> {
        let first = (mb.step * mb.accum + mb.index) * mb.rows;
        Ok(self.shard(mb.rank)?.batch(first, mb.rows)?)
    }

    fn gather(&self, rank: usize, rows: &[usize]) -> Result<Batch> {
        Ok(self.shard(rank)?.gather(rows)?)
    }

    fn sampler(&self, rank: usize, world_size: usize, options: SamplerOptions) -> Result<DistributedSampler> {
        self.check_world(world_size)?;
        Ok(DistributedSampler::new(self.shard(rank)?.len(), 1, 0, options)?)
    }

    fn rank_lengths(&self, world_size: usize, order: &DataOrder) -> Result<DataLength> {
        self.check_world(world_size)?;
        match order {
            DataOrder::InOrder => Ok(DataLength::PerEpoch(self.shards.iter().map(Dataset::len).collect())),
            DataOrder::Sampled(o) => (0..world_size)
                .map(|r| Ok(self.sampler(r, world_size, *o)?.num_samples()))
                .collect::<Result<Vec<_>>>()
                .map(DataLength::PerEpoch),
        }
    }

    fn fingerprint(&self) -> Option<String> {
        let each: Vec<&str> = self.shards.iter().map(Dataset::fingerprint).collect();
        Some(format!("per-rank[{}]", each.join(",")))
    }
}

/// The built-in datasets and data files, sharded by [`Microbatch::first_row`] (wrapping around
/// at the end) in order, or by a [`DistributedSampler`] over all their rows.
impl DataSource for Dataset {
    fn batch(&self, mb: &Microbatch) -> Result<Batch> {
        Ok(Dataset::batch(self, mb.first_row(), mb.rows)?)
    }

    fn num_rows(&self) -> Option<usize> {
        Some(self.len())
    }

    fn gather(&self, _rank: usize, rows: &[usize]) -> Result<Batch> {
        Ok(Dataset::gather(self, rows)?)
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
