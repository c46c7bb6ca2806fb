//! In-place updates through a view: gradient accumulation, zeroing, copies.

use super::{compute_dtype, same_device};
use crate::storage::dispatch;
use crate::{Result, Tensor, TensorError};

impl Tensor {
    /// `self += other` through this view (same shape and dtype).
    pub fn add_assign(&self, other: &Tensor) -> Result<()> {
        self.add_scaled_assign(other, 1.0)
    }

    /// `self += scale * other` through this view (same shape and dtype).
    pub fn add_scaled_assign(&self, other: &Tensor, scale: f64) -> Result<()> {
        let op = "add_assign";
        if self.shape() != other.shape() {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
            });
        }
        if self.dtype() != other.dtype() {
            return Err(TensorError::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: other.dtype(),
            });
        }
        compute_dtype(op, self)?;
        same_device(op, self, other)?;
        // `other` may share storage with `self`: gather it first so no read lock is held
        // while the write lock is taken.
        let src = if other.shares_storage(self) {
            other.copy()?
        } else {
            other.contiguous_for(op)?
        };
        let s = src.storage(op)?;
        dispatch!(&mut *self.storage_mut(op)?, d, other => d.add_scaled_assign(self.layout(), (other(&s)?, src.layout()), scale))
    }

    /// Overwrites this view's elements with `other`'s, bit for bit (same shape and dtype,
    /// any dtype).
    pub fn copy_from(&self, other: &Tensor) -> Result<()> {
        let op = "copy_from";
        if self.shape() != other.shape() {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
            });
        }
        if self.dtype() != other.dtype() {
            return Err(TensorError::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: other.dtype(),
            });
        }
        same_device(op, self, other)?;
        let src = if other.shares_storage(self) {
            other.copy()?
        } else {
            other.contiguous_for(op)?
        };
        let s = src.storage(op)?;
        dispatch!(&mut *self.storage_mut(op)?, d, other => d.copy_from(self.layout(), (other(&s)?, src.layout())))
    }

    /// Sets every element of this view to `v`.
    pub fn fill(&self, v: f64) -> Result<()> {
        dispatch!(&mut *self.storage_mut("fill")?, d => d.fill(self.layout(), v))
    }
}

#[cfg(test)]
mod tests {
    use crate::{test_device, DType, Device, Tensor};

    fn accumulating_into_a_flat_view_writes_the_shared_buffer(d: Device) {
        let flat = Tensor::zeros_on(&[10], DType::F32, d).unwrap();
        let g = flat.flat_view(4, &[2, 3]).unwrap();
        let x = Tensor::ones(&[2, 3], DType::F32).to_device(d).unwrap();
        g.add_assign(&x).unwrap();
        g.add_assign(&x).unwrap();
        assert_eq!(
            flat.to_vec::<f32>().unwrap(),
            vec![0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
        );
        // through a transposed view: flat[4..10] as [2,3], written as its [3,2] transpose
        let t = g.t().unwrap();
        t.add_scaled_assign(
            &Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2])
                .unwrap()
                .to_device(d)
                .unwrap(),
            10.0,
        )
        .unwrap();
        assert_eq!(
            flat.to_vec::<f32>().unwrap(),
            vec![0.0, 0.0, 0.0, 0.0, 12.0, 32.0, 52.0, 22.0, 42.0, 62.0]
        );
    }
    test_device!(accumulating_into_a_flat_view_writes_the_shared_buffer);

    fn a_lent_storage_is_an_error_until_it_comes_back(d: Device) {
        let flat = Tensor::zeros_on(&[4], DType::F32, d).unwrap();
        let view = flat.flat_view(2, &[2]).unwrap();
        let s = flat.lend_storage().unwrap();
        assert_eq!((s.device(), s.dtype(), s.len()), (d, DType::F32, 4));
        assert!(view.to_vec::<f32>().is_err());
        assert!(view
            .add_assign(&Tensor::ones(&[2], DType::F32).to_device(d).unwrap())
            .is_err());
        assert!(view.exp().is_err());
        flat.restore_storage(s).unwrap();
        view.fill(3.0).unwrap();
        assert_eq!(flat.to_vec::<f32>().unwrap(), vec![0.0, 0.0, 3.0, 3.0]);
    }
    test_device!(a_lent_storage_is_an_error_until_it_comes_back);

    fn copy_from_keeps_every_bit_through_a_strided_view(d: Device) {
        let dst = Tensor::full(&[2, 2], 7.0, DType::F64).to_device(d).unwrap();
        let src = Tensor::from_vec(vec![-0.0f64, 1.5, f64::NEG_INFINITY, 3.0], &[2, 2])
            .unwrap()
            .to_device(d)
            .unwrap();
        dst.t().unwrap().copy_from(&src).unwrap();
        // dst^T = src: dst = [[-0, -inf], [1.5, 3]]
        let got = dst.to_vec::<f64>().unwrap();
        assert_eq!(got[0].to_bits(), (-0.0f64).to_bits(), "the sign of zero survives");
        assert_eq!(&got[1..], &[f64::NEG_INFINITY, 1.5, 3.0]);
        let ids = Tensor::zeros_on(&[2], DType::I64, d).unwrap();
        ids.copy_from(&Tensor::from_vec(vec![4i64, 5], &[2]).unwrap().to_device(d).unwrap())
            .unwrap();
        assert_eq!(ids.to_vec::<i64>().unwrap(), vec![4, 5]);
    }
    test_device!(copy_from_keeps_every_bit_through_a_strided_view);
}
