//! Which elements of a bucket each rank owns: the bucket's flat range cut into `world`
//! contiguous pieces of equal length, the last ones padded with zeros where `world` does not
//! divide it (DeepSpeed's and PyTorch's flat-parameter partitioning).

use std::ops::Range;

/// Elements per rank when `numel` elements are cut into `world` equal pieces (rounded up:
/// `world * shard_len(..) - numel` elements of padding).
pub fn shard_len(numel: usize, world: usize) -> usize {
    numel.div_ceil(world.max(1))
}

/// The length of a bucket's buffer once padded to `world` equal pieces.
pub fn padded_len(numel: usize, world: usize) -> usize {
    shard_len(numel, world) * world.max(1)
}

/// One parameter's part of a rank's shard of a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Registration index of the parameter.
    pub param: usize,
    /// Where the piece starts in the parameter's flattened elements.
    pub param_offset: usize,
    /// Where the piece starts in the rank's shard.
    pub shard_offset: usize,
    /// Elements in the piece.
    pub len: usize,
}

impl Piece {
    /// The piece's elements within its parameter.
    pub fn param_range(&self) -> Range<usize> {
        self.param_offset..self.param_offset + self.len
    }
}

/// The pieces of rank `rank`'s shard of a bucket whose parameters `(index, numel)` sit one
/// after another from element 0, in this order (empty pieces are left out; padding belongs
/// to no parameter).
pub fn pieces(params: &[(usize, usize)], world: usize, rank: usize) -> Vec<Piece> {
    let numel: usize = params.iter().map(|&(_, n)| n).sum();
    let per = shard_len(numel, world);
    let (lo, hi) = (rank * per, (rank + 1) * per);
    let mut out = vec![];
    let mut offset = 0;
    for &(param, n) in params {
        let (start, end) = (offset.max(lo), (offset + n).min(hi));
        if start < end {
            out.push(Piece {
                param,
                param_offset: start - offset,
                shard_offset: start - lo,
                len: end - start,
            });
        }
        offset += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{padded_len, pieces, shard_len, Piece};

    #[test]
    fn pieces_tile_the_bucket_and_pad_the_last_shards() {
        // params 7 (10 elements), 3 (4), 5 (1): 15 elements over 4 ranks -> 4 each, 1 padding
        let params = [(7, 10), (3, 4), (5, 1)];
        assert_eq!((shard_len(15, 4), padded_len(15, 4)), (4, 16));
        let p = |param, param_offset, shard_offset, len| Piece {
            param,
            param_offset,
            shard_offset,
            len,
        };
        assert_eq!(pieces(&params, 4, 0), vec![p(7, 0, 0, 4)]);
        assert_eq!(pieces(&params, 4, 1), vec![p(7, 4, 0, 4)]);
        // elements 8..12: the last 2 of param 7, the first 2 of param 3
        assert_eq!(pieces(&params, 4, 2), vec![p(7, 8, 0, 2), p(3, 0, 2, 2)]);
        // elements 12..16: the last 2 of param 3, param 5, one element of padding
        assert_eq!(pieces(&params, 4, 3), vec![p(3, 2, 0, 2), p(5, 0, 2, 1)]);
        // every element of every parameter is owned exactly once
        let mut owned = [0usize; 15];
        let start = |param| {
            params
                .iter()
                .take_while(|&&(q, _)| q != param)
                .map(|&(_, n)| n)
                .sum::<usize>()
        };
        for r in 0..4 {
            for piece in pieces(&params, 4, r) {
                for e in piece.param_range() {
                    owned[start(piece.param) + e] += 1;
                }
            }
        }
        assert_eq!(owned, [1; 15]);
        // more ranks than elements: the last ranks own nothing
        assert_eq!(pieces(&[(0, 2)], 4, 3), vec![]);
        assert_eq!(pieces(&[(0, 2)], 4, 1), vec![p(0, 1, 0, 1)]);
    }
}
