//! The tensor crate's error type.

use crate::{DType, Device};

/// Everything that can go wrong in a tensor operation. Messages name the op and the
/// shapes or dtypes involved, expected versus found.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum TensorError {
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch: {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        op: &'static str,
        lhs: Vec<usize>,
        rhs: Vec<usize>,
    },
    /// Shapes that cannot be broadcast together.
    #[error("{op}: shapes {lhs:?} and {rhs:?} cannot be broadcast")]
    Broadcast {
        op: &'static str,
        lhs: Vec<usize>,
        rhs: Vec<usize>,
    },
    /// A data length that does not match the number of elements of a shape.
    #[error("{op}: {len} elements do not fill shape {shape:?} ({numel} elements)")]
    ElementCount {
        op: &'static str,
        len: usize,
        shape: Vec<usize>,
        numel: usize,
    },
    /// A dimension index out of range.
    #[error("{op}: dimension {dim} out of range for a tensor of rank {rank}")]
    DimOutOfRange { op: &'static str, dim: usize, rank: usize },
    /// A slice or index that lies outside the tensor.
    #[error("{op}: {msg}")]
    OutOfRange { op: &'static str, msg: String },
    /// An op that does not support this dtype.
    #[error("{op}: dtype {dtype:?} is not supported here{hint}")]
    UnsupportedDType {
        op: &'static str,
        dtype: DType,
        hint: &'static str,
    },
    /// Two operands with different dtypes.
    #[error("{op}: dtype mismatch: {lhs:?} vs {rhs:?}")]
    DTypeMismatch { op: &'static str, lhs: DType, rhs: DType },
    /// The requested device is not available in this build or on this machine.
    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable { device: Device, reason: String },
    /// Two operands on different devices.
    #[error("{op}: device mismatch: {lhs:?} vs {rhs:?}")]
    DeviceMismatch { op: &'static str, lhs: Device, rhs: Device },
    /// The storage was handed to another owner (e.g. a gradient bucket in flight on the
    /// comm stream) and has not been given back yet.
    #[error("{op}: the tensor's storage is lent out (e.g. a gradient bucket whose all-reduce is still in flight)")]
    StorageLent { op: &'static str },
    /// Anything else that an argument got wrong.
    #[error("{op}: {msg}")]
    Invalid { op: &'static str, msg: String },
}

/// Result alias for tensor operations.
pub type Result<T> = std::result::Result<T, TensorError>;
