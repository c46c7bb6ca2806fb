//! Differentiable sorting and indexing ops on [`Var`]: `topk` and `sort` (the values carry the
//! gradient, the `I64` indices are plain tensors), `gather` / `index_select` and their
//! adjoints `scatter_add` / `index_add`. Each backward is the adjoint op on the same index.

use brigade_tensor::Tensor;

use crate::{Result, Var};

/// Zeros of `x`'s shape, dtype and device, with `g` added where `ids` points along `dim`:
/// the gradient of picking `x`'s elements at `ids`.
fn scattered(x: &Tensor, dim: usize, ids: &Tensor, g: &Tensor) -> Result<Tensor> {
    Ok(Tensor::zeros_on(x.shape(), x.dtype(), x.device())?.scatter_add(dim, ids, g)?)
}

impl Var {
    /// The `k` largest elements of each last-dim row and their `I64` positions
    /// ([`Tensor::topk`]: largest first, ties lowest position first, NaN largest). The
    /// gradient flows to the picked elements.
    pub fn topk(&self, k: usize) -> Result<(Var, Tensor)> {
        let x = self.value();
        let (vals, ids) = x.topk(k)?;
        Ok((self.picked("topk", vals, ids.clone())?, ids))
    }

    /// Each last-dim row sorted and the `I64` positions of its values ([`Tensor::sort`]:
    /// stable, NaNs last ascending and first descending). The gradient flows back to the
    /// positions the values came from.
    pub fn sort(&self, descending: bool) -> Result<(Var, Tensor)> {
        let (vals, ids) = self.value().sort(descending)?;
        Ok((self.picked("sort", vals, ids.clone())?, ids))
    }

    /// `vals`, the elements of this var at `ids` along the last dim, as a var whose gradient
    /// goes back to those positions.
    fn picked(&self, op: &'static str, vals: Tensor, ids: Tensor) -> Result<Var> {
        let x = self.value();
        let dim = x.rank() - 1;
        Ok(Var::from_op(op, vals, &[self], move |g| {
            Ok(vec![Some(scattered(&x, dim, &ids, g)?)])
        }))
    }

    /// Elements picked along `dim` by an `I64` index of the output's shape
    /// ([`Tensor::gather`]); the gradient is scatter-added back.
    pub fn gather(&self, dim: usize, ids: &Tensor) -> Result<Var> {
        let x = self.value();
        let out = x.gather(dim, ids)?;
        let ids = ids.clone();
        Ok(Var::from_op("gather", out, &[self], move |g| {
            Ok(vec![Some(scattered(&x, dim, &ids, g)?)])
        }))
    }

    /// Slices `ids[i]` along `dim` ([`Tensor::index_select`]); the gradient is index-added
    /// back.
    pub fn index_select(&self, dim: usize, ids: &Tensor) -> Result<Var> {
        let x = self.value();
        let out = x.index_select(dim, ids)?;
        let ids = ids.clone();
        Ok(Var::from_op("index_select", out, &[self], move |g| {
            let zeros = Tensor::zeros_on(x.shape(), x.dtype(), x.device())?;
            Ok(vec![Some(zeros.index_add(dim, &ids, g)?)])
        }))
    }

    /// This var with `src` added at the positions `ids` names along `dim`
    /// ([`Tensor::scatter_add`]). Gradients: this var's is the output's; `src`'s is the
    /// output's gradient gathered at `ids`.
    pub fn scatter_add(&self, dim: usize, ids: &Tensor, src: &Var) -> Result<Var> {
        let out = self.value().scatter_add(dim, ids, &src.value())?;
        let ids = ids.clone();
        Ok(Var::from_op("scatter_add", out, &[self, src], move |g| {
            Ok(vec![Some(g.clone()), Some(g.gather(dim, &ids)?)])
        }))
    }

    /// This var with slice `i` of `src` along `dim` added to slice `ids[i]`
    /// ([`Tensor::index_add`]). Gradients: this var's is the output's; `src`'s is the
    /// output's gradient's slices `ids[i]`.
    pub fn index_add(&self, dim: usize, ids: &Tensor, src: &Var) -> Result<Var> {
        let out = self.value().index_add(dim, ids, &src.value())?;
        let ids = ids.clone();
        Ok(Var::from_op("index_add", out, &[self, src], move |g| {
            Ok(vec![Some(g.clone()), Some(g.index_select(dim, &ids)?)])
        }))
    }
}
