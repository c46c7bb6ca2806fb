//! The tensor crate's error type.

use crate::{DType, Device};

/// Everything that can go wrong in a tensor operation. Messages name the op and the
/// shapes or dtypes involved, expected versus found.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum TensorError {
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch: {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        /// The op that failed.
        op: &'static str,
        /// The first operand's shape.
        lhs: Vec<usize>,
        /// The second operand's shape.
        rhs: Vec<usize>,
    },
    /// Shapes that cannot be broadcast together.
    #[error("{op}: shapes {lhs:?} and {rhs:?} cannot be broadcast")]
    Broadcast {
        /// The op that failed.
        op: &'static str,
        /// The first operand's shape.
        lhs: Vec<usize>,
        /// The second operand's shape.
        rhs: Vec<usize>,
    },
    /// A data length that does not match the number of elements of a shape.
    #[error("{op}: {len} elements do not fill shape {shape:?} ({numel} elements)")]
    ElementCount {
        /// The op that failed.
        op: &'static str,
        /// The elements given.
        len: usize,
        /// The shape they were to fill.
        shape: Vec<usize>,
        /// The elements that shape holds.
        numel: usize,
    },
    /// A dimension index out of range.
    #[error("{op}: dimension {dim} out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        /// The op that failed.
        op: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// The tensor's rank.
        rank: usize,
    },
    /// A slice or index that lies outside the tensor.
    #[error("{op}: {msg}")]
    OutOfRange {
        /// The op that failed.
        op: &'static str,
        /// Which index, and the range it had to lie in.
        msg: String,
    },
    /// An op that does not support this dtype.
    #[error("{op}: dtype {dtype:?} is not supported here{hint}")]
    UnsupportedDType {
        /// The op that failed.
        op: &'static str,
        /// The dtype it was given.
        dtype: DType,
        /// What to use instead (empty, or a sentence starting with its separator).
        hint: &'static str,
    },
    /// Two operands with different dtypes.
    #[error("{op}: dtype mismatch: {lhs:?} vs {rhs:?}")]
    DTypeMismatch {
        /// The op that failed.
        op: &'static str,
        /// The first operand's dtype.
        lhs: DType,
        /// The second operand's dtype.
        rhs: DType,
    },
    /// The requested device is not available in this build or on this machine.
    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable {
        /// The device asked for.
        device: Device,
        /// Why it cannot serve (no driver, no such GPU, not compiled in).
        reason: String,
    },
    /// Two operands on different devices.
    #[error("{op}: device mismatch: {lhs:?} vs {rhs:?}")]
    DeviceMismatch {
        /// The op that failed.
        op: &'static str,
        /// The first operand's device.
        lhs: Device,
        /// The second operand's device.
        rhs: Device,
    },
    /// The storage was handed to another owner (e.g. a gradient bucket in flight on the
    /// comm stream) and has not been given back yet.
    #[error("{op}: the tensor's storage is lent out (e.g. a gradient bucket whose all-reduce is still in flight)")]
    StorageLent {
        /// The op that found the storage gone.
        op: &'static str,
    },
    /// An op whose kernel this device's backend does not have yet.
    #[error("{op}: no kernel on {device} yet: copy the operands to the CPU (to_device(Device::Cpu)) for this op")]
    NotOnDevice {
        /// The op that has no kernel there.
        op: &'static str,
        /// The device it was asked to run on.
        device: Device,
    },
    /// The CPU GEMM library asked for (`BRIGADE_GEMM`) cannot be used.
    #[error("CPU GEMM: {0}")]
    CpuGemm(String),
    /// Anything else that an argument got wrong.
    #[error("{op}: {msg}")]
    Invalid {
        /// The op that failed.
        op: &'static str,
        /// What was wrong.
        msg: String,
    },
}

/// Result alias for tensor operations.
pub type Result<T> = std::result::Result<T, TensorError>;
