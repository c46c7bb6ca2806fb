//! Matrix products: shape checks and batch broadcasting here, the GEMM in the backend
//! (the `gemm` crate on the CPU: transposed views cost nothing).

use super::{compute_dtype, same_device, same_dtype};
use crate::layout::broadcast_shape;
use crate::storage::dispatch;
use crate::storage::DeviceStorage;
use crate::{Result, Tensor, TensorError};

fn matmul_impl(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let op = "matmul";
    compute_dtype(op, a)?;
    same_dtype(op, a, b)?;
    same_device(op, a, b)?;
    if a.rank() < 2 || b.rank() < 2 {
        return Err(TensorError::Invalid {
            op,
            msg: format!("needs rank >= 2 operands, got {:?} x {:?}", a.shape(), b.shape()),
        });
    }
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k) = (a.shape()[ra - 2], a.shape()[ra - 1]);
    let (k2, n) = (b.shape()[rb - 2], b.shape()[rb - 1]);
    if k != k2 {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
        });
    }
    // A batched lhs times a plain matrix: fold the batch into the rows, one big GEMM.
    if rb == 2 && ra > 2 {
        let rows: usize = a.shape()[..ra - 1].iter().product();
        let a2 = a.reshape(&[rows, k])?;
        let out = matmul_impl(&a2, b)?;
        let mut shape = a.shape()[..ra - 1].to_vec();
        shape.push(n);
        return out.reshape(&shape);
    }
    let batch = broadcast_shape(op, &a.shape()[..ra - 2], &b.shape()[..rb - 2])?;
    let nb: usize = batch.iter().product();
    let mut full_a = batch.clone();
    full_a.extend([m, k]);
    let mut full_b = batch.clone();
    full_b.extend([k, n]);
    let la = a.layout().broadcast_to(&full_a)?;
    let lb = b.layout().broadcast_to(&full_b)?;
    let mut out_shape = batch.clone();
    out_shape.extend([m, n]);
    if m * n == 0 {
        return Ok(Tensor::from_storage(
            DeviceStorage::zeros(a.device(), a.dtype(), nb * m * n)?,
            &out_shape,
        ));
    }
    let out = dispatch!(&*a.storage(op)?, s, other => s.matmul(&la, other(&*b.storage(op)?)?, &lb))?;
    Ok(Tensor::from_storage(out, &out_shape))
}

impl Tensor {
    /// Matrix product over the last two dims, batch dims broadcast:
    /// `[.., m, k] x [.., k, n] -> [.., m, n]`.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        matmul_impl(self, rhs)
    }

    /// `self [m, k] x rhs [k, n] + bias [n]`, the bias added to every row (PyTorch's
    /// `addmm`, as a linear layer uses it): one pass over the output instead of a product
    /// and then a broadcast add.
    pub fn matmul_bias(&self, rhs: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let op = "matmul_bias";
        compute_dtype(op, self)?;
        same_dtype(op, self, rhs)?;
        same_dtype(op, self, bias)?;
        same_device(op, self, rhs)?;
        same_device(op, self, bias)?;
        let shapes_fit = self.rank() == 2
            && rhs.rank() == 2
            && self.shape()[1] == rhs.shape()[0]
            && bias.shape() == [rhs.shape()[1]];
        if !shapes_fit {
            return Err(TensorError::Invalid {
                op,
                msg: format!(
                    "needs [m, k] x [k, n] + [n], got {:?} x {:?} + {:?}",
                    self.shape(),
                    rhs.shape(),
                    bias.shape()
                ),
            });
        }
        let (m, n) = (self.shape()[0], rhs.shape()[1]);
        if m * n == 0 {
            return Ok(Tensor::from_storage(
                DeviceStorage::zeros(self.device(), self.dtype(), 0)?,
                &[m, n],
            ));
        }
        let bias = bias.contiguous()?;
        let out = dispatch!(&*self.storage(op)?, s, other => s.matmul_bias(
            self.layout(),
            other(&*rhs.storage(op)?)?,
            rhs.layout(),
            (other(&*bias.storage(op)?)?, bias.layout()),
        ))?;
        Ok(Tensor::from_storage(out, &[m, n]))
    }
}

#[cfg(test)]
mod tests {
    use crate::{test_device, DType, Device, Rng, Tensor};

    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn matches_the_definition_on_plain_transposed_and_batched_operands(d: Device) {
        let mut rng = Rng::new(1);
        let a = Tensor::randn(&[2, 5, 3], 1.0, DType::F64, &mut rng);
        let b = Tensor::randn(&[4, 3], 1.0, DType::F64, &mut rng);
        let (av, bv) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
        let (a, b) = (a.to_device(d).unwrap(), b.to_device(d).unwrap());
        // b is [4,3]; b.t() is the [3,4] view: bt[p][j] = b[j][p]
        let bt: Vec<f64> = (0..3)
            .flat_map(|p| (0..4).map(move |j| (p, j)))
            .map(|(p, j)| bv[j * 3 + p])
            .collect();
        let c = a.matmul(&b.t().unwrap()).unwrap();
        assert_eq!(c.shape(), &[2, 5, 4]);
        let got = c.to_vec::<f64>().unwrap();
        for bi in 0..2 {
            let want = naive(&av[bi * 15..(bi + 1) * 15], &bt, 5, 3, 4);
            for (g, w) in got[bi * 20..(bi + 1) * 20].iter().zip(&want) {
                assert!((g - w).abs() < 1e-12);
            }
        }
        // batch x batch, with a transposed lhs view
        let x = Tensor::randn(&[3, 4, 6], 1.0, DType::F64, &mut rng);
        let y = Tensor::randn(&[3, 4, 2], 1.0, DType::F64, &mut rng);
        let (xv, yv) = (x.to_vec::<f64>().unwrap(), y.to_vec::<f64>().unwrap());
        let (x, y) = (x.to_device(d).unwrap(), y.to_device(d).unwrap());
        let z = x.transpose(1, 2).unwrap().matmul(&y).unwrap();
        assert_eq!(z.shape(), &[3, 6, 2]);
        let zv = z.to_vec::<f64>().unwrap();
        for bi in 0..3 {
            for i in 0..6 {
                for j in 0..2 {
                    let w: f64 = (0..4).map(|p| xv[bi * 24 + p * 6 + i] * yv[bi * 8 + p * 2 + j]).sum();
                    assert!((zv[bi * 12 + i * 2 + j] - w).abs() < 1e-12);
                }
            }
        }
        // a broadcast batch: [1,4,6]^T-free [3,6,4] x [1,4,2] reuses the one rhs matrix
        let y0 = y.narrow(0, 0, 1).unwrap();
        let z = x.transpose(1, 2).unwrap().matmul(&y0).unwrap();
        let zv = z.to_vec::<f64>().unwrap();
        for bi in 0..3 {
            for i in 0..6 {
                for j in 0..2 {
                    let w: f64 = (0..4).map(|p| xv[bi * 24 + p * 6 + i] * yv[p * 2 + j]).sum();
                    assert!((zv[bi * 12 + i * 2 + j] - w).abs() < 1e-12);
                }
            }
        }
    }
    test_device!(matches_the_definition_on_plain_transposed_and_batched_operands);

    fn inner_dimension_mismatch_is_an_error(d: Device) {
        let a = Tensor::zeros_on(&[2, 3], DType::F32, d).unwrap();
        let b = Tensor::zeros_on(&[4, 2], DType::F32, d).unwrap();
        assert!(a.matmul(&b).is_err());
    }
    test_device!(inner_dimension_mismatch_is_an_error);

    fn matmul_bias_is_the_product_plus_the_bias_on_every_row(d: Device) {
        let mut rng = Rng::new(2);
        let x = Tensor::randn(&[5, 3], 1.0, DType::F64, &mut rng);
        let w = Tensor::randn(&[4, 3], 1.0, DType::F64, &mut rng);
        let b = Tensor::randn(&[4], 1.0, DType::F64, &mut rng);
        let (xv, wv, bv) = (
            x.to_vec::<f64>().unwrap(),
            w.to_vec::<f64>().unwrap(),
            b.to_vec::<f64>().unwrap(),
        );
        let (x, w, b) = (
            x.to_device(d).unwrap(),
            w.to_device(d).unwrap(),
            b.to_device(d).unwrap(),
        );
        // y[i][j] = sum_p x[i][p] w[j][p] + b[j], through the transposed view of w
        let y = x.matmul_bias(&w.t().unwrap(), &b).unwrap();
        assert_eq!(y.shape(), &[5, 4]);
        let yv = y.to_vec::<f64>().unwrap();
        for i in 0..5 {
            for j in 0..4 {
                let want: f64 = (0..3).map(|p| xv[i * 3 + p] * wv[j * 3 + p]).sum::<f64>() + bv[j];
                assert!(
                    (yv[i * 4 + j] - want).abs() < 1e-12,
                    "({i}, {j}): {} vs {want}",
                    yv[i * 4 + j]
                );
            }
        }
        // k = 0: the bias alone
        let e = Tensor::zeros_on(&[2, 0], DType::F64, d).unwrap();
        let z = Tensor::zeros_on(&[0, 4], DType::F64, d).unwrap();
        assert_eq!(
            e.matmul_bias(&z, &b).unwrap().to_vec::<f64>().unwrap(),
            [&bv[..], &bv[..]].concat()
        );
        assert!(x.matmul_bias(&w.t().unwrap(), &x).is_err());
    }
    test_device!(matmul_bias_is_the_product_plus_the_bias_on_every_row);
}
