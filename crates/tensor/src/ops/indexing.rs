//! Sorting and moving elements by integer index: `sort`, `argsort` and `topk` along the last
//! dim; `gather`, `scatter_add` and `index_add` along any dim. Indices are `I64` tensors (`U8`
//! is taken too); an index outside its dim is one `OutOfRange` error naming it, checked here
//! before any kernel runs.

use super::nn::check_indices;
use super::{compute_dtype, same_device, same_dtype};
use crate::storage::dispatch;
use crate::{Result, Tensor, TensorError};

/// The size of the last dim (the sorted one).
fn last_dim(op: &'static str, x: &Tensor) -> Result<usize> {
    x.shape().last().copied().ok_or(TensorError::Invalid {
        op,
        msg: "needs rank >= 1 (it works along the last dim)".into(),
    })
}

/// `(values, indices)` of each last-dim row sorted, cut to its first `k`.
fn sort_impl(op: &'static str, x: &Tensor, descending: bool, k: usize) -> Result<(Tensor, Tensor)> {
    compute_dtype(op, x)?;
    let n = last_dim(op, x)?;
    if k > n {
        return Err(TensorError::OutOfRange {
            op,
            msg: format!("k = {k} is larger than the last dim ({n}) of shape {:?}", x.shape()),
        });
    }
    let x = x.contiguous_for(op)?;
    let (v, i) = dispatch!(&*x.storage(op)?, s => s.sort_last(x.layout(), descending, k))?;
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = k;
    Ok((Tensor::from_storage(v, &shape), Tensor::from_storage(i, &shape)))
}

/// An index tensor fits `x` along `dim`: same rank, no larger in any other dim, `dim < rank`.
fn check_index_shape(op: &'static str, x: &Tensor, dim: usize, ids: &Tensor) -> Result<()> {
    if dim >= x.rank() {
        return Err(TensorError::DimOutOfRange { op, dim, rank: x.rank() });
    }
    let fits = ids.rank() == x.rank()
        && (0..x.rank()).all(|d| d == dim || ids.shape()[d] <= x.shape()[d]);
    if fits {
        Ok(())
    } else {
        Err(TensorError::Invalid {
            op,
            msg: format!(
                "the index {:?} must have the rank of the tensor {:?} and be no larger in any dim but {dim}",
                ids.shape(),
                x.shape()
            ),
        })
    }
}

impl Tensor {
    /// The `k` largest elements of each row of the last dim, largest first, and their `I64`
    /// positions in the row: `([.., k], [.., k])`, as `torch.topk(x, k)`. Equal values come
    /// lowest position first; NaN counts as larger than every number (so NaNs come first),
    /// `-0.0` as equal to `0.0`. `k` larger than the last dim is an `OutOfRange` error.
    pub fn topk(&self, k: usize) -> Result<(Tensor, Tensor)> {
        sort_impl("topk", self, true, k)
    }

    /// Each row of the last dim sorted, and the `I64` positions the values came from:
    /// ascending (NaNs last) or `descending` (NaNs first), stable in both directions (equal
    /// values, NaNs among them, keep their order: lower position first). `-0.0` and `0.0`
    /// are equal.
    pub fn sort(&self, descending: bool) -> Result<(Tensor, Tensor)> {
        let n = last_dim("sort", self)?;
        sort_impl("sort", self, descending, n)
    }

    /// The `I64` positions that sort each row of the last dim: the indices of
    /// [`Tensor::sort`], same order rules.
    pub fn argsort(&self, descending: bool) -> Result<Tensor> {
        let n = last_dim("argsort", self)?;
        Ok(sort_impl("argsort", self, descending, n)?.1)
    }

    /// Elements picked along `dim` by an `I64` index of the output's shape:
    /// `out[i][j] = self[ids[i][j]][j]` for `dim = 0`, `self[i][ids[i][j]]` for `dim = 1`
    /// (`torch.gather`). The index has this tensor's rank and is no larger in other dims;
    /// an index value outside `0..self.shape()[dim]` is an `OutOfRange` error.
    pub fn gather(&self, dim: usize, ids: &Tensor) -> Result<Tensor> {
        let op = "gather";
        check_index_shape(op, self, dim, ids)?;
        check_indices(op, ids, self.shape()[dim])?;
        gather_checked(op, self, dim, ids)
    }

    /// A copy of this tensor with `src` added at the positions an `I64` index of `src`'s
    /// shape names along `dim`: `out[ids[i][j]][j] += src[i][j]` for `dim = 0`
    /// (`torch.scatter_add`); repeated positions add up (on the CPU in the index's row-major
    /// order). The index has this tensor's rank and is no larger in other dims; an index
    /// value outside `0..self.shape()[dim]` is an `OutOfRange` error.
    pub fn scatter_add(&self, dim: usize, ids: &Tensor, src: &Tensor) -> Result<Tensor> {
        let op = "scatter_add";
        check_index_shape(op, self, dim, ids)?;
        check_indices(op, ids, self.shape().get(dim).copied().unwrap_or(0))?;
        scatter_add_checked(op, self, dim, ids, src)
    }

    /// A copy of this tensor with slice `i` of `src` along `dim` added to slice `ids[i]`
    /// (`torch.index_add`): `ids` is a 1-d `I64` index of `n` positions, `src` this tensor's
    /// shape with `n` at `dim`; repeated positions add up. An index value outside
    /// `0..self.shape()[dim]` is an `OutOfRange` error.
    pub fn index_add(&self, dim: usize, ids: &Tensor, src: &Tensor) -> Result<Tensor> {
        let op = "index_add";
        if dim >= self.rank() {
            return Err(TensorError::DimOutOfRange { op, dim, rank: self.rank() });
        }
        let n = match ids.shape() {
            [n] => *n,
            s => {
                return Err(TensorError::Invalid {
                    op,
                    msg: format!("the index must be 1-d, got shape {s:?}"),
                })
            }
        };
        let mut want = self.shape().to_vec();
        want[dim] = n;
        if src.shape() != want {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: want,
                rhs: src.shape().to_vec(),
            });
        }
        check_indices(op, ids, self.shape()[dim])?;
        scatter_add_checked(op, self, dim, &spread_index(ids, dim, &want)?, src)
    }

    /// `self.index_select(dim, ids)` (`torch.index_select`): the slices `ids[i]` along `dim`,
    /// `ids` a 1-d `I64` index. The gradient of [`Tensor::index_add`]'s `src`.
    pub fn index_select(&self, dim: usize, ids: &Tensor) -> Result<Tensor> {
        let op = "index_select";
        if dim >= self.rank() {
            return Err(TensorError::DimOutOfRange { op, dim, rank: self.rank() });
        }
        let [n] = ids.shape() else {
            return Err(TensorError::Invalid {
                op,
                msg: format!("the index must be 1-d, got shape {:?}", ids.shape()),
            });
        };
        let mut shape = self.shape().to_vec();
        shape[dim] = *n;
        check_indices(op, ids, self.shape()[dim])?;
        gather_checked(op, self, dim, &spread_index(ids, dim, &shape)?)
    }
}

/// [`Tensor::gather`] once the index's shape and values have been checked.
fn gather_checked(op: &'static str, x: &Tensor, dim: usize, ids: &Tensor) -> Result<Tensor> {
    compute_dtype(op, x)?;
    same_device(op, x, ids)?;
    let xc = x.contiguous_for(op)?;
    let out = dispatch!(&*xc.storage(op)?, s, other => s.gather(xc.layout(), dim, (other(&*ids.storage(op)?)?, ids.layout())))?;
    Ok(Tensor::from_storage(out, ids.shape()))
}

/// [`Tensor::scatter_add`] once the index's shape and values have been checked.
fn scatter_add_checked(op: &'static str, x: &Tensor, dim: usize, ids: &Tensor, src: &Tensor) -> Result<Tensor> {
    compute_dtype(op, x)?;
    same_dtype(op, x, src)?;
    same_device(op, x, src)?;
    same_device(op, x, ids)?;
    if ids.shape() != src.shape() {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: ids.shape().to_vec(),
            rhs: src.shape().to_vec(),
        });
    }
    let (xc, src) = (x.contiguous_for(op)?, src.contiguous_for(op)?);
    let out = dispatch!(&*xc.storage(op)?, s, other => s.scatter_add(
        xc.layout(),
        dim,
        (other(&*ids.storage(op)?)?, ids.layout()),
        (other(&*src.storage(op)?)?, src.layout()),
    ))?;
    Ok(Tensor::from_storage(out, x.shape()))
}

/// A 1-d index `[n]` seen as `shape` (with `n` at `dim`) through stride-0 dims: no copy.
fn spread_index(ids: &Tensor, dim: usize, shape: &[usize]) -> Result<Tensor> {
    let mut one = vec![1; shape.len()];
    one[dim] = shape[dim];
    ids.reshape(&one)?.broadcast_to(shape)
}
