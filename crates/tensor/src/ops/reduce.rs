//! Reductions over axes: sum, mean, max, and sum-to-shape (the backward of broadcasting).

use super::compute_dtype;
use crate::backend::ReduceOp;
use crate::storage::dispatch;
use crate::{Result, Tensor, TensorError};

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

fn reduce(name: &'static str, x: &Tensor, dims: &[usize], keepdim: bool, op: ReduceOp) -> Result<Tensor> {
    compute_dtype(name, x)?;
    let dims = check_dims(name, dims, x.rank())?;
    let out = dispatch!(&*x.storage(name)?, s => s.reduce(x.layout(), &dims, op))?;
    Ok(Tensor::from_storage(out, &out_shape(x.shape(), &dims, keepdim)))
}

impl Tensor {
    /// Sum over `dims` (all of them when empty would be ambiguous: use [`Tensor::sum_all`]).
    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        reduce("sum", self, dims, keepdim, ReduceOp::Sum)
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
        reduce("max", self, &[dim], keepdim, ReduceOp::Max)
    }

    /// Maximum over `dims` (`torch.amax`); a NaN anywhere in a reduced run gives NaN.
    pub fn amax(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        reduce("amax", self, dims, keepdim, ReduceOp::Max)
    }

    /// Minimum over `dims` (`torch.amin`): `-amax(-x)`, so the same NaN rule.
    pub fn amin(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        compute_dtype("amin", self)?;
        self.neg()?.amax(dims, keepdim)?.neg()
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
    use crate::{test_device, Device, Tensor};

    fn sums_over_middle_and_leading_dims(d: Device) {
        // x[i,j,k] = 100 i + 10 j + k over [2,3,2]
        let v: Vec<f64> = (0..2)
            .flat_map(|i| (0..3).flat_map(move |j| (0..2).map(move |k| (100 * i + 10 * j + k) as f64)))
            .collect();
        let x = Tensor::from_vec(v, &[2, 3, 2]).unwrap().to_device(d).unwrap();
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
        // max over k: 100 i + 10 j + 1
        let m = x.max_dim(2, true).unwrap();
        assert_eq!(m.shape(), &[2, 3, 1]);
        assert_eq!(m.to_vec::<f64>().unwrap(), vec![1.0, 11.0, 21.0, 101.0, 111.0, 121.0]);
        // sum over i and k: (0+100)*2 + 4*10j + (0+1)*2 = 202 + 40j
        assert_eq!(
            x.sum_to_shape(&[3, 1]).unwrap().to_vec::<f64>().unwrap(),
            vec![202.0, 242.0, 282.0]
        );
    }
    test_device!(sums_over_middle_and_leading_dims);

    fn amax_and_amin_over_several_dims(d: Device) {
        // x[i,j,k] = (-1)^k (100 i + 10 j + k) over [2,3,2]
        let v: Vec<f64> = (0..2)
            .flat_map(|i| {
                (0..3).flat_map(move |j| {
                    (0..2).map(move |k| (if k == 0 { 1.0 } else { -1.0 }) * (100 * i + 10 * j + k) as f64)
                })
            })
            .collect();
        let x = Tensor::from_vec(v, &[2, 3, 2]).unwrap().to_device(d).unwrap();
        // over j and k: the largest is 100 i + 20 (k = 0, j = 2), the smallest -(100 i + 21)
        assert_eq!(
            x.amax(&[1, 2], false).unwrap().to_vec::<f64>().unwrap(),
            vec![20.0, 120.0]
        );
        assert_eq!(
            x.amin(&[1, 2], false).unwrap().to_vec::<f64>().unwrap(),
            vec![-21.0, -121.0]
        );
        let m = x.amin(&[0], true).unwrap();
        assert_eq!(m.shape(), &[1, 3, 2]);
        assert_eq!(
            m.to_vec::<f64>().unwrap(),
            vec![0.0, -101.0, 10.0, -111.0, 20.0, -121.0]
        );
        assert!(x.amax(&[3], false).is_err());
    }
    test_device!(amax_and_amin_over_several_dims);
}
