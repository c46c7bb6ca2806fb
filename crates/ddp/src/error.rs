//! The ddp crate's error type.

use brigade_autograd::AutogradError;
use brigade_comm::CommError;
use brigade_tensor::TensorError;

/// What can go wrong while wrapping a model or reducing its gradients.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A collective failed (a dead rank, a timeout, a mismatch).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Recording or differentiating failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The ranks hold different models.
    #[error("the ranks hold different models: rank {rank_a} has {entry_a}, rank {rank_b} has {entry_b} (parameter #{index}); every rank must build the same model")]
    ModelMismatch {
        index: usize,
        rank_a: usize,
        entry_a: String,
        rank_b: usize,
        entry_b: String,
    },
    /// A configuration that cannot work.
    #[error("invalid DDP configuration: {0}")]
    Config(String),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, DdpError>;
