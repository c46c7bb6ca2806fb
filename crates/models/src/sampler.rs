//! Which rows each rank reads, epoch by epoch: PyTorch's `DistributedSampler`, as pure,
//! seeded logic.
//!
//! Each epoch has one order of the dataset's rows, the same on every rank: a permutation
//! drawn from `seed + epoch` (or `0..len` without shuffling), padded or cut so that it divides
//! among the ranks ([`Remainder`]); rank `r` of `w` takes positions `r, r + w, r + 2w, ..` of
//! it. So the ranks' shares of an epoch are disjoint and together cover every row, and the
//! rows one global batch reads are the same whatever the number of ranks. Every rank's length
//! is known before step 0 ([`DistributedSampler::rank_lengths`]).
//!
//! The permutation is not PyTorch's (another generator); the semantics are.
//!
//! ```
//! use brigade_models::{DistributedSampler, SamplerOptions};
//!
//! let mut s = DistributedSampler::new(10, 4, 1, SamplerOptions::default()).unwrap();
//! assert_eq!(s.num_samples(), 3); // ceil(10 / 4): padded to 12 rows
//! s.set_epoch(2);
//! let rows = s.indices(); // this rank's 3 rows of epoch 2
//! assert!(rows.iter().all(|&r| r < 10));
//! ```

use brigade_tensor::Rng;

use crate::{ModelError, Result};

/// What happens to the `len % world_size` rows that do not divide evenly among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remainder {
    /// PyTorch's default (`drop_last=False`): rows from the start of the epoch's order are
    /// repeated, so every rank reads `ceil(len / world_size)` rows.
    Pad,
    /// PyTorch's `drop_last=True`: the tail of the epoch's order is dropped, so every rank reads
    /// `floor(len / world_size)` rows.
    Drop,
    /// Neither: every row exactly once per epoch, the first `len % world_size` ranks reading
    /// one row more than the others (uneven inputs, each rank's length known up front).
    Uneven,
}

/// How a [`DistributedSampler`] orders rows; the default is PyTorch's (`shuffle=True`,
/// `seed=0`, `drop_last=False`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplerOptions {
    /// A new permutation each epoch (`true`) or the rows in order.
    pub shuffle: bool,
    /// The permutation of epoch `e` is drawn from `seed + e`; it must be the same on every rank.
    pub seed: u64,
    /// What happens to rows that do not divide among the ranks.
    pub remainder: Remainder,
}

impl Default for SamplerOptions {
    fn default() -> Self {
        SamplerOptions {
            shuffle: true,
            seed: 0,
            remainder: Remainder::Pad,
        }
    }
}

/// Rank `rank`'s share of `len` rows per epoch (see the [module](self) docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world_size: usize,
    rank: usize,
    options: SamplerOptions,
    epoch: u64,
}

impl DistributedSampler {
    /// The sampler of rank `rank` of `world_size` over `len` rows, at epoch 0. Errors on no
    /// rows, no ranks, a rank outside the world, or [`Remainder::Drop`] with fewer rows than
    /// ranks (which would leave every rank without a row).
    pub fn new(len: usize, world_size: usize, rank: usize, options: SamplerOptions) -> Result<DistributedSampler> {
        let err = |m: String| Err(ModelError::Sampler(m));
        if len == 0 {
            return err("the dataset has no rows".into());
        }
        if world_size == 0 || rank >= world_size {
            return err(format!("rank {rank} is not in a world of {world_size} ranks"));
        }
        if options.remainder == Remainder::Drop && len < world_size {
            return err(format!(
                "{len} rows cannot give each of {world_size} ranks one row with drop_last; pad instead, or use fewer ranks"
            ));
        }
        Ok(DistributedSampler {
            len,
            world_size,
            rank,
            options,
            epoch: 0,
        })
    }

    /// Moves to `epoch` (PyTorch's `set_epoch`): call it at the start of each epoch, on every
    /// rank, so that each epoch has its own order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Rows in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The options it was built with.
    pub fn options(&self) -> SamplerOptions {
        self.options
    }

    /// Rows rank `rank` reads per epoch.
    pub fn num_samples_of(&self, rank: usize) -> usize {
        let (n, w) = (self.len, self.world_size);
        match self.options.remainder {
            Remainder::Pad => n.div_ceil(w),
            Remainder::Drop => n / w,
            Remainder::Uneven => n / w + usize::from(rank < n % w),
        }
    }

    /// Rows this rank reads per epoch (PyTorch's `len(sampler)`).
    pub fn num_samples(&self) -> usize {
        self.num_samples_of(self.rank)
    }

    /// Every rank's rows per epoch, by rank: all equal unless [`Remainder::Uneven`].
    pub fn rank_lengths(&self) -> Vec<usize> {
        (0..self.world_size).map(|r| self.num_samples_of(r)).collect()
    }

    /// Rows all ranks read per epoch together (the padded or cut length of the epoch's order).
    pub fn total_size(&self) -> usize {
        self.rank_lengths().iter().sum()
    }

    /// Epoch `epoch`'s order of rows, shared by all ranks: the permutation (or `0..len`),
    /// padded or cut to [`DistributedSampler::total_size`].
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.options.shuffle {
            // Fisher-Yates from `seed + epoch`, as PyTorch seeds its generator
            let mut rng = Rng::new(self.options.seed.wrapping_add(epoch));
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
        }
        let total = self.total_size();
        if total > self.len {
            // padding repeats the order from its start, as often as needed
            let padding: Vec<usize> = order.iter().copied().cycle().take(total - self.len).collect();
            order.extend(padding);
        } else {
            order.truncate(total);
        }
        order
    }

    /// Rank `rank`'s rows of epoch `epoch`, in the order it reads them.
    pub fn indices_of(&self, rank: usize, epoch: u64) -> Vec<usize> {
        self.epoch_order(epoch)
            .into_iter()
            .skip(rank)
            .step_by(self.world_size)
            .collect()
    }

    /// This rank's rows of the current epoch, in order (PyTorch's `iter(sampler)`).
    pub fn indices(&self) -> Vec<usize> {
        self.indices_of(self.rank, self.epoch)
    }

    /// Where this rank stands after reading `consumed` rows from the start of epoch 0, reading
    /// on across epochs: the position a resume continues from.
    pub fn position_after(&self, consumed: u64) -> SamplerPosition {
        let per_epoch = self.num_samples() as u64;
        if per_epoch == 0 {
            return SamplerPosition { epoch: 0, index: 0 };
        }
        SamplerPosition {
            epoch: consumed / per_epoch,
            index: (consumed % per_epoch) as usize,
        }
    }
}

/// A place in a rank's stream of rows: row `index` of its share of epoch `epoch`. What a
/// checkpoint records, so that a resume lands on the same row of the same permutation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SamplerPosition {
    /// The epoch.
    pub epoch: u64,
    /// Rows of this epoch already read by this rank.
    pub index: usize,
}

/// Reads a rank's rows as one stream across epochs, from a [`SamplerPosition`]: each call to
/// [`SamplerCursor::next_rows`] continues where the last stopped, moving to the next epoch's
/// order when one ends. It computes each epoch's order once.
#[derive(Debug, Clone)]
pub struct SamplerCursor {
    sampler: DistributedSampler,
    position: SamplerPosition,
    order: Option<(u64, Vec<usize>)>,
}

impl SamplerCursor {
    /// A cursor over `sampler`'s rank from `position` (an index at or past the end of its
    /// epoch continues with the next epochs).
    pub fn new(sampler: DistributedSampler, position: SamplerPosition) -> Result<SamplerCursor> {
        let per_epoch = sampler.num_samples();
        if per_epoch == 0 {
            return Err(ModelError::Sampler(format!(
                "rank {} has no rows to read",
                sampler.rank()
            )));
        }
        let position = SamplerPosition {
            epoch: position.epoch + (position.index / per_epoch) as u64,
            index: position.index % per_epoch,
        };
        Ok(SamplerCursor {
            sampler,
            position,
            order: None,
        })
    }

    /// Where the next row comes from.
    pub fn position(&self) -> SamplerPosition {
        self.position
    }

    /// The next `n` rows of this rank, crossing into the next epoch(s) when one ends.
    pub fn next_rows(&mut self, n: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let epoch = self.position.epoch;
            if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                let rows = self.sampler.indices_of(self.sampler.rank(), epoch);
                self.order = Some((epoch, rows));
            }
            let rows = &self.order.as_ref().expect("just filled").1;
            let take = (n - out.len()).min(rows.len() - self.position.index);
            out.extend_from_slice(&rows[self.position.index..self.position.index + take]);
            self.position.index += take;
            if self.position.index == rows.len() {
                self.position = SamplerPosition {
                    epoch: epoch + 1,
                    index: 0,
                };
            }
        }
        out
    }
}
