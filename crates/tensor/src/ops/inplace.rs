//! In-place updates through a view: gradient accumulation, zeroing, copies.

use crate::storage::Storage;
use crate::{DType, Element, Float, Result, Tensor, TensorError};

fn accumulate<T: Float>(dst: &Tensor, src: &Tensor, scale: T) -> Result<()> {
    // `src` may share storage with `dst`: gather it first so no read lock is held
    // while the write lock is taken.
    let src = if src.shares_storage(dst) {
        src.copy()?
    } else {
        src.clone()
    };
    src.with_contiguous("add_assign", |s: &[T]| {
        if dst.is_contiguous() {
            dst.with_slice_mut("add_assign", |d: &mut [T]| {
                for (d, &s) in d.iter_mut().zip(s) {
                    *d += scale * s;
                }
            })
        } else {
            let mut g = dst.write_guard();
            let Storage::Cpu(st) = &mut *g;
            let data = T::slice_mut(st).ok_or(TensorError::DTypeMismatch {
                op: "add_assign",
                lhs: dst.dtype(),
                rhs: T::DTYPE,
            })?;
            if dst.layout().storage_extent() > data.len() {
                return Err(TensorError::StorageLent { op: "add_assign" });
            }
            let mut i = 0;
            dst.layout().for_each_offset(|o| {
                data[o] += scale * s[i];
                i += 1;
            });
            Ok(())
        }
    })?
}

impl Tensor {
    /// `self += other` through this view (same shape and dtype).
    pub fn add_assign(&self, other: &Tensor) -> Result<()> {
        self.add_scaled_assign(other, 1.0)
    }

    /// `self += scale * other` through this view (same shape and dtype).
    pub fn add_scaled_assign(&self, other: &Tensor, scale: f64) -> Result<()> {
        if self.shape() != other.shape() {
            return Err(TensorError::ShapeMismatch {
                op: "add_assign",
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
            });
        }
        if self.dtype() != other.dtype() {
            return Err(TensorError::DTypeMismatch {
                op: "add_assign",
                lhs: self.dtype(),
                rhs: other.dtype(),
            });
        }
        float_dispatch!("add_assign", self.dtype(), T => accumulate::<T>(self, other, T::from_f64(scale)))
    }

    /// Overwrites this view's elements with `other`'s (same shape and dtype).
    pub fn copy_from(&self, other: &Tensor) -> Result<()> {
        self.fill(0.0)?;
        self.add_assign(other)
    }

    /// Sets every element of this view to `v`.
    pub fn fill(&self, v: f64) -> Result<()> {
        fn go<T: Element>(t: &Tensor, v: f64) -> Result<()> {
            let v = T::from_f64(v);
            if t.is_contiguous() {
                return t.with_slice_mut("fill", |d: &mut [T]| d.fill(v));
            }
            let mut g = t.write_guard();
            let Storage::Cpu(st) = &mut *g;
            let data = T::slice_mut(st).ok_or(TensorError::DTypeMismatch {
                op: "fill",
                lhs: t.dtype(),
                rhs: T::DTYPE,
            })?;
            if t.layout().storage_extent() > data.len() {
                return Err(TensorError::StorageLent { op: "fill" });
            }
            t.layout().for_each_offset(|o| data[o] = v);
            Ok(())
        }
        match self.dtype() {
            DType::F32 => go::<f32>(self, v),
            DType::F64 => go::<f64>(self, v),
            DType::F16 => go::<half::f16>(self, v),
            DType::BF16 => go::<half::bf16>(self, v),
            DType::I64 => go::<i64>(self, v),
            DType::U8 => go::<u8>(self, v),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Tensor};

    #[test]
    fn accumulating_into_a_flat_view_writes_the_shared_buffer() {
        let flat = Tensor::zeros(&[10], DType::F32);
        let g = flat.flat_view(4, &[2, 3]).unwrap();
        let x = Tensor::ones(&[2, 3], DType::F32);
        g.add_assign(&x).unwrap();
        g.add_assign(&x).unwrap();
        assert_eq!(
            flat.to_vec::<f32>().unwrap(),
            vec![0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
        );
    }

    #[test]
    fn a_lent_storage_is_an_error_until_it_comes_back() {
        let flat = Tensor::zeros(&[4], DType::F32);
        let view = flat.flat_view(2, &[2]).unwrap();
        let s = flat.lend_storage().unwrap();
        assert!(view.to_vec::<f32>().is_err());
        assert!(view.add_assign(&Tensor::ones(&[2], DType::F32)).is_err());
        flat.restore_storage(s).unwrap();
        view.fill(3.0).unwrap();
        assert_eq!(flat.to_vec::<f32>().unwrap(), vec![0.0, 0.0, 3.0, 3.0]);
    }
}
