//! Sorting and moving elements by integer index on the CPU: the sort of each row (behind
//! `sort`, `argsort` and `topk`), gather and scatter-add along a dim. 16-bit storages are
//! widened to f32 (exactly) and the values rounded back once.

use std::cmp::Ordering;

use super::f16_storage::{half_dtype, narrow, widen};
use super::{float_kernel, indices, same, view};
use crate::backend::Indexing;
use crate::{contiguous_strides, Buffer, Element, Float, Layout, Result};

/// The sort's total order: numbers as `<` orders them (`-0.0 == 0.0`), NaN above every
/// number and equal to another NaN.
fn nan_last<T: Float>(a: T, b: T) -> Ordering {
    match (
        a.partial_cmp(&b),
        a.partial_cmp(&a).is_none(),
        b.partial_cmp(&b).is_none(),
    ) {
        (Some(o), _, _) => o,
        (None, true, true) => Ordering::Equal,
        (None, true, false) => Ordering::Greater,
        (None, false, _) => Ordering::Less,
    }
}

/// The first `k` positions of `row` in sorted order, ties (and NaNs) by lower position: the
/// order compares (value, position), a total order, so a partial selection before the sort
/// of the first `k` gives exactly the first `k` of the full stable sort.
fn sorted_positions<T: Float>(row: &[T], descending: bool, k: usize) -> Vec<usize> {
    let by = |&i: &usize, &j: &usize| {
        let o = nan_last(row[i], row[j]);
        let o = if descending { o.reverse() } else { o };
        o.then(i.cmp(&j))
    };
    let mut pos: Vec<usize> = (0..row.len()).collect();
    if k == 0 {
        return vec![];
    }
    if k < row.len() {
        pos.select_nth_unstable_by(k - 1, by);
        pos.truncate(k);
    }
    pos.sort_unstable_by(by);
    pos
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
