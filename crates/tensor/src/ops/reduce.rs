//! Reductions over axes: sum, mean, max, and sum-to-shape (the backward of broadcasting).

use crate::threads::par_rows_mut;
use crate::{Float, Result, Tensor, TensorError};

/// Normalises a list of dims: checked, sorted, deduplicated.
fn check_dims(op: &'static str, dims: &[usize], rank: usize) -> Result<Vec<usize>> {
    let mut d = dims.to_vec();
    for &x in &d {
        if x >= rank {
            return Err(TensorError::DimOutOfRange { op, dim: x, rank });
        }
    }
    d.sort_unstable();
    d.dedup();
    Ok(d)
}

fn out_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    let mut out = vec![];
    for (i, &s) in shape.iter().enumerate() {
        if dims.contains(&i) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(s);
        }
    }
    out
}

/// Reduces `dims` of `x` with `row(&[T]) -> T` applied to each run of reduced elements.
fn reduce_rows<T: Float>(
    op: &'static str,
    x: &Tensor,
    dims: &[usize],
    keepdim: bool,
    row: impl Fn(&[T]) -> T + Sync + Send,
) -> Result<Tensor> {
    let dims = check_dims(op, dims, x.rank())?;
    let kept: Vec<usize> = (0..x.rank()).filter(|d| !dims.contains(d)).collect();
    let perm: Vec<usize> = kept.iter().chain(dims.iter()).copied().collect();
    let r: usize = dims.iter().map(|&d| x.shape()[d]).product();
    let out_n: usize = kept.iter().map(|&d| x.shape()[d]).product();
    let xp = x.permute(&perm)?;
    let mut out = vec![T::ZERO; out_n];
    xp.with_contiguous(op, |src: &[T]| {
        par_rows_mut(&mut out, 1, |i, o| o[0] = row(&src[i * r..(i + 1) * r]));
    })?;
    Tensor::from_vec(out, &out_shape(x.shape(), &dims, keepdim))
}

/// Sum over leading dims of a contiguous tensor: adds rows, which vectorises.
fn sum_leading<T: Float>(x: &Tensor, k: usize, keepdim: bool) -> Result<Tensor> {
    let lead: usize = x.shape()[..k].iter().product();
    let cols: usize = x.shape()[k..].iter().product();
    let mut out = vec![T::ZERO; cols];
    x.with_contiguous("sum", |src: &[T]| {
        for r in 0..lead {
            for (o, &v) in out.iter_mut().zip(&src[r * cols..(r + 1) * cols]) {
                *o += v;
            }
        }
    })?;
    let dims: Vec<usize> = (0..k).collect();
    Tensor::from_vec(out, &out_shape(x.shape(), &dims, keepdim))
}

fn sum_impl<T: Float>(x: &Tensor, dims: &[usize], keepdim: bool) -> Result<Tensor> {
    let d = check_dims("sum", dims, x.rank())?;
    let leading = !d.is_empty() && d.iter().enumerate().all(|(i, &v)| i == v) && d.len() < x.rank();
    if leading && x.is_contiguous() {
        return sum_leading::<T>(x, d.len(), keepdim);
    }
    reduce_rows::<T>("sum", x, &d, keepdim, |r| r.iter().copied().sum())
}

impl Tensor {
    /// Sum over `dims` (all of them when empty would be ambiguous: use [`Tensor::sum_all`]).
    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        float_dispatch!("sum", self.dtype(), T => sum_impl::<T>(self, dims, keepdim))
    }

    /// Sum of every element, as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        let dims: Vec<usize> = (0..self.rank()).collect();
        self.sum(&dims, false)
    }

    /// Mean over `dims`.
    pub fn mean(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        let d = check_dims("mean", dims, self.rank())?;
        let n: usize = d.iter().map(|&i| self.shape()[i]).product();
        self.sum(&d, keepdim)?.mul_scalar(1.0 / n.max(1) as f64)
    }

    /// Maximum over one dimension.
    pub fn max_dim(&self, dim: usize, keepdim: bool) -> Result<Tensor> {
        float_dispatch!("max", self.dtype(), T => reduce_rows::<T>("max", self, &[dim], keepdim, |r| {
            r.iter().copied().fold(T::NEG_INFINITY, |a, b| if b > a { b } else { a })
        }))
    }

    /// Sums a (broadcast) tensor down to `shape`: the gradient of broadcasting `shape`
    /// up to `self.shape()`.
    pub fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let err = || TensorError::Broadcast {
            op: "sum_to_shape",
            lhs: self.shape().to_vec(),
            rhs: shape.to_vec(),
        };
        if shape.len() > self.rank() {
            return Err(err());
        }
        let extra = self.rank() - shape.len();
        let mut dims: Vec<usize> = (0..extra).collect();
        for (i, &s) in shape.iter().enumerate() {
            let d = self.shape()[extra + i];
            if s == 1 && d != 1 {
                dims.push(extra + i);
            } else if s != d {
                return Err(err());
            }
        }
        let summed = if dims.is_empty() {
            self.clone()
        } else {
            self.sum(&dims, true)?
        };
        summed.reshape(shape)
    }
}

#[cfg(test)]
mod tests {
    use crate::Tensor;

    #[test]
    fn sums_over_middle_and_leading_dims() {
        // x[i,j,k] = 100 i + 10 j + k over [2,3,2]
        let v: Vec<f64> = (0..2)
            .flat_map(|i| (0..3).flat_map(move |j| (0..2).map(move |k| (100 * i + 10 * j + k) as f64)))
            .collect();
        let x = Tensor::from_vec(v, &[2, 3, 2]).unwrap();
        // sum over j: 3*100i + (0+10+20) + 3k
        assert_eq!(
            x.sum(&[1], false).unwrap().to_vec::<f64>().unwrap(),
            vec![30.0, 33.0, 330.0, 333.0]
        );
        // sum over i: 100 + 2*(10j + k)
        assert_eq!(
            x.sum(&[0], false).unwrap().to_vec::<f64>().unwrap(),
            vec![100.0, 102.0, 120.0, 122.0, 140.0, 142.0]
        );
        assert_eq!(x.max_dim(2, true).unwrap().shape(), &[2, 3, 1]);
        // sum over i and k: (0+100)*2 + 4*10j + (0+1)*2 = 202 + 40j
        assert_eq!(
            x.sum_to_shape(&[3, 1]).unwrap().to_vec::<f64>().unwrap(),
            vec![202.0, 242.0, 282.0]
        );
    }
}
