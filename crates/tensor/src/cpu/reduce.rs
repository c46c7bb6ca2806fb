//! Reductions over axes on the CPU: sum and max.

use std::borrow::Cow;

use super::f16_storage::{half_dtype, narrow, widen};
use super::{float_kernel, gather, same, view};
use crate::backend::{Reduce, ReduceOp};
use crate::threads::par_rows_mut;
use crate::Buffer;
use crate::{Float, Layout, Result};

/// Reduces `dims` of the view with `row(&[T]) -> T` applied to each run of reduced elements.
fn reduce_rows<T: Float>(
    s: &Buffer,
    l: &Layout,
    dims: &[usize],
    row: impl Fn(&[T]) -> T + Sync + Send,
) -> Result<Buffer> {
    let kept: Vec<usize> = (0..l.rank()).filter(|d| !dims.contains(d)).collect();
    let perm: Vec<usize> = kept.iter().chain(dims.iter()).copied().collect();
    let r: usize = dims.iter().map(|&d| l.shape()[d]).product();
    let out_n: usize = kept.iter().map(|&d| l.shape()[d]).product();
    let lp = l.permute(&perm)?;
    let src: Cow<'_, [T]> = if lp.is_contiguous() {
        Cow::Borrowed(view(same::<T>("reduce", s)?, &lp))
    } else {
        Cow::Owned(gather::<T>(s, &lp, "reduce")?)
    };
    let mut out = vec![T::ZERO; out_n];
    par_rows_mut(&mut out, 1, |i, o| o[0] = row(&src[i * r..(i + 1) * r]));
    Ok(T::wrap(out))
}

/// Sum over the leading `k` dims of a contiguous view: adds rows, which vectorises.
fn sum_leading<T: Float>(data: &[T], l: &Layout, k: usize) -> Buffer {
    let lead: usize = l.shape()[..k].iter().product();
    let cols: usize = l.shape()[k..].iter().product();
    let src = view(data, l);
    let mut out = vec![T::ZERO; cols];
    for r in 0..lead {
        for (o, &v) in out.iter_mut().zip(&src[r * cols..(r + 1) * cols]) {
            *o += v;
        }
    }
    T::wrap(out)
}

impl Reduce for Buffer {
    fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Buffer> {
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            return Ok(narrow(x.reduce(&xl, dims, op)?, h));
        }
        let s = self;
        float_kernel!("reduce", s, data: T => match op {
            ReduceOp::Sum => {
                let leading = !dims.is_empty() && dims.iter().enumerate().all(|(i, &v)| i == v) && dims.len() < l.rank();
                if leading && l.is_contiguous() {
                    return Ok(sum_leading::<T>(data, l, dims.len()));
                }
                reduce_rows::<T>(s, l, dims, |r| r.iter().copied().sum())
            }
            ReduceOp::Max => {
                // any NaN wins, wherever it comes (PyTorch's max; the CUDA kernel's rule)
                reduce_rows::<T>(s, l, dims, |r| r.iter().copied().fold(T::NEG_INFINITY, |a, b| if !a.is_nan() && (b > a || b.is_nan()) { b } else { a }))
            }
        })
    }
}
