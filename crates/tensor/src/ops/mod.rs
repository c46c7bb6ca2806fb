//! The device-independent front end of every op: each file is one family of `Tensor`
//! methods that checks shapes and dtypes, prepares the views, and calls the backend
//! holding the operands through the contract in [`crate::backend`].

mod attention;
mod elementwise;
mod indexing;
mod inplace;
mod matmul;
mod nn;
mod reduce;

pub use attention::AttentionSaved;
pub use inplace::{AdamWStep, SgdStep};
pub use nn::LayerNormSaved;

use crate::{Tensor, TensorError};

/// Float kernels take floats: f32 and f64 computed as they are, f16 and bf16 storage computed
/// in f32 and rounded at the output (where a backend has them); integers are refused with a hint.
pub(crate) fn compute_dtype(op: &'static str, t: &Tensor) -> crate::Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(TensorError::UnsupportedDType {
            op,
            dtype: t.dtype(),
            hint: " (float kernels take f32, f64, f16 or bf16: convert with to_dtype first)",
        })
    }
}

/// Operands of one op have one shape.
pub(crate) fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> crate::Result<()> {
    if a.shape() == b.shape() {
        Ok(())
    } else {
        Err(TensorError::ShapeMismatch {
            op,
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
        })
    }
}

/// Operands of one op share a dtype.
pub(crate) fn same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> crate::Result<()> {
    if a.dtype() == b.dtype() {
        Ok(())
    } else {
        Err(TensorError::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        })
    }
}

/// Operands of one op live on one device.
pub(crate) fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> crate::Result<()> {
    if a.device() == b.device() {
        Ok(())
    } else {
        Err(TensorError::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        })
    }
}
