//! Sorting and moving elements by integer index on the CPU: the sort of each row (behind
//! `sort`, `argsort` and `topk`), gather and scatter-add along a dim. 16-bit storages are
//! widened to f32 (exactly) and the values rounded back once.

use super::f16_storage::{half_dtype, narrow, widen};
use super::{float_kernel, indices, same, view};
use crate::backend::Indexing;
use crate::{contiguous_strides, Buffer, Element, Float, Layout, Result};

/// The first `k` positions of `row` in sorted order, ties (and NaNs) by lower position: the
/// order compares (value, position), a total order, so a partial selection before the sort
/// of the first `k` gives exactly the first `k` of the full stable sort. Each element becomes
/// one integer key holding its value's rank (numbers as `<` orders them, `-0.0 == 0.0`,
/// NaN above every number and equal to another NaN) and its position, so the
/// O(n) selection and the sort compare integers.
fn sorted_positions<T: Float>(row: &[T], descending: bool, k: usize) -> Vec<usize> {
    if k == 0 {
        return vec![];
    }
    if std::mem::size_of::<T>() <= 4 && row.len() <= u32::MAX as usize {
        // an f32 is exactly its f64: ranked on 32 bits, the position below
        let key = |(p, x): (usize, &T)| {
            let rank = ordered_f32(x.to_f64() as f32, descending);
            (u64::from(rank) << 32) | p as u64
        };
        let keys = row.iter().enumerate().map(key).collect();
        return first_k(keys, k, |key| (key & u64::from(u32::MAX)) as usize);
    }
    let key = |(p, x): (usize, &T)| (u128::from(ordered_f64(x.to_f64(), descending)) << 64) | p as u128;
    let keys = row.iter().enumerate().map(key).collect();
    first_k(keys, k, |key| key as u64 as usize)
}

/// The `k` smallest keys in order, each as its position.
fn first_k<K: Ord + Copy>(mut keys: Vec<K>, k: usize, position: impl Fn(K) -> usize) -> Vec<usize> {
    if k < keys.len() {
        keys.select_nth_unstable(k - 1);
        keys.truncate(k);
    }
    keys.sort_unstable();
    keys.into_iter().map(position).collect()
}

/// `x`'s rank in the sort's order (reversed when `descending`) as an unsigned integer:
/// `-0.0` as `0.0`, every NaN above `+inf`.
fn ordered_f32(x: f32, descending: bool) -> u32 {
    let rank = if x.is_nan() {
        u32::MAX
    } else {
        let bits = (x + 0.0).to_bits();
        if bits >> 31 == 1 {
            !bits
        } else {
            bits | 1 << 31
        }
    };
    if descending {
        !rank
    } else {
        rank
    }
}

/// [`ordered_f32`] for an f64.
fn ordered_f64(x: f64, descending: bool) -> u64 {
    let rank = if x.is_nan() {
        u64::MAX
    } else {
        let bits = (x + 0.0).to_bits();
        if bits >> 63 == 1 {
            !bits
        } else {
            bits | 1 << 63
        }
    };
    if descending {
        !rank
    } else {
        rank
    }
}

/// The storage offset in a contiguous `[shape]` tensor of index-tensor element `at`, with
/// the coordinate along `dim` replaced by `id`.
fn target(at: &[usize], strides: &[usize], dim: usize, id: usize) -> usize {
    at.iter()
        .zip(strides)
        .enumerate()
        .map(|(d, (&c, &s))| if d == dim { id * s } else { c * s })
        .sum()
}

/// Calls `f(element, offset in self)` for each element of the index tensor in row-major order.
fn for_each_target(
    self_shape: &[usize],
    ids_shape: &[usize],
    dim: usize,
    idx: &[usize],
    mut f: impl FnMut(usize, usize),
) {
    let strides = contiguous_strides(self_shape);
    let mut at = vec![0usize; ids_shape.len()];
    for (e, &id) in idx.iter().enumerate() {
        f(e, target(&at, &strides, dim, id));
        for d in (0..at.len()).rev() {
            at[d] += 1;
            if at[d] < ids_shape[d] {
                break;
            }
            at[d] = 0;
        }
    }
}

impl Indexing for Buffer {
    fn sort_last(&self, l: &Layout, descending: bool, k: usize) -> Result<(Buffer, Buffer)> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            let (v, i) = x.sort_last(&xl, descending, k)?;
            return Ok((narrow(v, h), i));
        }
        float_kernel!("sort", self, xs: T => {
            let xs = view(xs, l);
            let n = l.shape().last().copied().unwrap_or(1);
            let rows = xs.len().checked_div(n).unwrap_or(0);
            let (mut vals, mut ids) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
            for r in 0..rows {
                let row = &xs[r * n..(r + 1) * n];
                for p in sorted_positions(row, descending, k) {
                    vals.push(row[p]);
                    ids.push(p as i64);
                }
            }
            Ok((T::wrap(vals), Buffer::I64(ids)))
        })
    }

    fn gather(&self, l: &Layout, dim: usize, ids: (&Buffer, &Layout)) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            return Ok(narrow(x.gather(&xl, dim, ids)?, h));
        }
        let idx = indices("gather", ids.0, ids.1)?;
        float_kernel!("gather", self, xs: T => {
            let xs = view(xs, l);
            let mut out = vec![T::ZERO; idx.len()];
            for_each_target(l.shape(), ids.1.shape(), dim, &idx, |e, o| out[e] = xs[o]);
            Ok(T::wrap(out))
        })
    }

    fn scatter_add(&self, l: &Layout, dim: usize, ids: (&Buffer, &Layout), src: (&Buffer, &Layout)) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            let (s, sl) = widen(src.0, src.1);
            return Ok(narrow(x.scatter_add(&xl, dim, ids, (&s, &sl))?, h));
        }
        let idx = indices("scatter_add", ids.0, ids.1)?;
        float_kernel!("scatter_add", self, xs: T => {
            let mut out = view(xs, l).to_vec();
            let src = view(same::<T>("scatter_add", src.0)?, src.1);
            for_each_target(l.shape(), ids.1.shape(), dim, &idx, |e, o| out[o] += src[e]);
            Ok(T::wrap(out))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::cmp::Ordering;

    use super::*;

    /// The sort's total order as a comparator: numbers as `<` orders them, NaN above every
    /// number and equal to another NaN.
    fn nan_last(a: f64, b: f64) -> Ordering {
        match (a.partial_cmp(&b), a.is_nan(), b.is_nan()) {
            (Some(o), _, _) => o,
            (None, true, true) => Ordering::Equal,
            (None, true, false) => Ordering::Greater,
            (None, false, _) => Ordering::Less,
        }
    }

    /// The first `k` of the full stable sort under [`nan_last`].
    fn stable_sort(row: &[f64], descending: bool, k: usize) -> Vec<usize> {
        let mut pos: Vec<usize> = (0..row.len()).collect();
        pos.sort_by(|&i, &j| {
            let o = nan_last(row[i], row[j]);
            if descending {
                o.reverse()
            } else {
                o
            }
        });
        pos.truncate(k);
        pos
    }

    /// Rows full of ties: signed zeros, both NaNs, infinities, repeated numbers, subnormals.
    fn tied_row(len: usize, seed: u64) -> Vec<f64> {
        let pool = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            2.5,
            -2.5,
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e-40,
            -1e-40,
            3.0e38,
            0.1,
        ];
        let mut state = seed;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                pool[(state >> 33) as usize % pool.len()]
            })
            .collect()
    }

    #[test]
    fn the_selection_is_the_first_k_of_the_stable_sort_ties_by_lower_position() {
        for (len, seed) in [(1, 1), (7, 2), (64, 3), (1000, 4)] {
            let row = tied_row(len, seed);
            let row32: Vec<f32> = row.iter().map(|&x| x as f32).collect();
            let want32: Vec<f64> = row32.iter().map(|&x| f64::from(x)).collect();
            for descending in [false, true] {
                for k in [1, 2, len / 3, len - 1, len] {
                    let k = k.max(1);
                    let want = stable_sort(&row, descending, k);
                    assert_eq!(
                        sorted_positions(&row, descending, k),
                        want,
                        "f64 len {len} k {k} desc {descending}"
                    );
                    let want = stable_sort(&want32, descending, k);
                    assert_eq!(
                        sorted_positions(&row32, descending, k),
                        want,
                        "f32 len {len} k {k} desc {descending}"
                    );
                }
            }
        }
    }
}
