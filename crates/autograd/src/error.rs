//! The autograd crate's error type.

use brigade_tensor::TensorError;

use crate::backward::SubscriberError;

/// What can go wrong while recording, differentiating or optimizing.
#[derive(Debug, thiserror::Error)]
pub enum AutogradError {
    /// A tensor op failed (shape, dtype, range...).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// `backward()` was called on a tensor that is not a single element, without a seed gradient.
    #[error("backward: the output has shape {0:?}; call backward on a scalar or pass a gradient of that shape")]
    NotScalar(Vec<usize>),
    /// `backward()` on something that does not require grad.
    #[error("backward: the output does not require grad (was it computed under no_grad, or from no parameter?)")]
    NoGraph,
    /// A gradient-ready subscriber (e.g. the DDP reducer) failed; `source` is its own error,
    /// typed (downcast it, e.g. to `brigade_ddp::DdpError`).
    #[error("gradient-ready subscriber failed at {param}: {source}")]
    Subscriber {
        /// Where backward was: `parameter 'NAME'`, `<backward start>` or `<backward end>`; or
        /// `<forward>` for a parameter hook's error in a forward.
        param: String,
        /// The subscriber's error.
        #[source]
        source: SubscriberError,
    },
    /// `requires_grad` changed on a var that an op produced (only leaves can be frozen).
    #[error("requires_grad can only be changed on leaves (parameters, inputs), not on the result of op '{op}'")]
    NotALeaf {
        /// The op that produced the var.
        op: &'static str,
    },
    /// A gradient buffer that does not fit its parameter.
    #[error("gradient buffer for '{param}': expected shape {expected:?} ({dtype:?}), got {found:?}")]
    GradBuffer {
        /// The parameter.
        param: String,
        /// Its shape.
        expected: Vec<usize>,
        /// The buffer's shape.
        found: Vec<usize>,
        /// Its dtype.
        dtype: brigade_tensor::DType,
    },
    /// Optimizer state that does not match the parameters.
    #[error("optimizer state: {0}")]
    OptimizerState(String),
    /// A distributed optimizer's collective failed (e.g. ZeRO's all-gather of the updated
    /// parameters); `source` is its own error, typed (downcast it, e.g. to `brigade_ddp::DdpError`).
    #[error("optimizer step: {source}")]
    Optimizer {
        /// The optimizer's error.
        #[source]
        source: SubscriberError,
    },
    /// A learning-rate schedule that cannot be built (`T <= W` for a decaying schedule, a
    /// negative rate, ...): what is wrong and how to fix it.
    #[error("lr schedule: {0}")]
    Schedule(String),
    /// A checkpointed scope's forward failed when backward recomputed it; `source` is the
    /// error its forward returned, typed (downcast it, e.g. to the model's error).
    #[error("recomputing checkpointed scope '{scope}': {source}")]
    Recompute {
        /// The scope's full path (e.g. `blocks.0`).
        scope: String,
        /// The forward's error.
        #[source]
        source: SubscriberError,
    },
    /// A checkpointed scope read a var computed outside it other than its input (it could not
    /// be recomputed from its input alone).
    #[error("checkpointed scope '{scope}' reads the result of op '{op}' computed before it; pass everything it computes from as its input")]
    CheckpointInput {
        /// The scope's full path.
        scope: String,
        /// The op that made the var it reads.
        op: &'static str,
    },
    /// A ranged read of a stored parameter or optimizer state found a NaN or an infinity.
    #[error(
        "{}: element {element} of the tensor at byte {offset} is {value}: a stored parameter or optimizer state \
         must be finite",
        path.display()
    )]
    NonFiniteStored {
        /// The file.
        path: std::path::PathBuf,
        /// The byte of the file the tensor's first element starts at.
        offset: u64,
        /// The element's index in the tensor, flattened.
        element: usize,
        /// That element (NaN, inf or -inf).
        value: f64,
    },
    /// Anything else an argument got wrong.
    #[error("{0}")]
    Invalid(String),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, AutogradError>;
