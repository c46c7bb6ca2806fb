//! The models crate's error type.

use std::path::PathBuf;

use brigade_autograd::AutogradError;
use brigade_tensor::TensorError;

/// Everything that can go wrong building a model, running it, reading data or
/// checkpoints. Messages name the file, tensor or parameter involved, expected versus
/// found, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor op failed (shape, dtype, range...).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// Recording or differentiating the graph failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A model configuration that cannot be built.
    #[error("invalid {model} config: {message}")]
    Config {
        /// `"mlp"` or `"gpt"`.
        model: &'static str,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A batch without a tensor the model reads (tokens given to the MLP, or the reverse).
    #[error(
        "{model} reads tensor '{missing}', which the batch lacks (it has {found:?}); pair the model with its dataset"
    )]
    WrongBatch {
        /// The model (`"mlp"`, `"gpt"`, or a user's).
        model: &'static str,
        /// The tensor it reads.
        missing: String,
        /// The names the batch has.
        found: Vec<String>,
    },
    /// A batch whose tensors do not fit the model.
    #[error("{model} batch: {message}")]
    BadBatch {
        /// `"mlp"` or `"gpt"`.
        model: &'static str,
        /// Which tensor, expected versus found.
        message: String,
    },
    /// A token sequence longer than the learned positional embedding.
    #[error("gpt: sequence of {found} tokens exceeds the model's context of {context}; use shorter rows or a config with a larger `context`")]
    ContextTooLong {
        /// Tokens per row given to the model.
        found: usize,
        /// The model's `context`.
        context: usize,
    },
    /// A file that could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// A file that is not valid safetensors (truncated, corrupt, unsupported dtype).
    #[error("{path}: not a usable safetensors file: {message}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A checkpoint whose tensors do not match the model's parameters.
    #[error("checkpoint {path} does not match the model: {message}")]
    CheckpointMismatch {
        /// The checkpoint (`<memory>` for tensors passed directly).
        path: PathBuf,
        /// The first mismatch: a missing or unexpected name, or a shape, expected versus found.
        message: String,
    },
    /// A NaN or an infinity in a file of parameters, optimizer state or training inputs: it
    /// would train on (or save) NaN without a word.
    #[error("{path}: tensor '{tensor}' holds {value} at index {index:?}; every value must be finite (fix or re-create the file)")]
    NonFinite {
        /// The file (`<memory>` for tensors passed directly).
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The first non-finite element's multi-index.
        index: Vec<usize>,
        /// That element (NaN, inf or -inf).
        value: f64,
    },
    /// A `.npy` or `.npz` file that cannot be read (truncated, not NumPy, an unsupported dtype)
    /// or a tensor that has no NumPy dtype.
    #[error("{path}: not a usable NumPy file: {message}")]
    Npy {
        /// The file.
        path: PathBuf,
        /// What is wrong, and what to do.
        message: String,
    },
    /// A sampler that cannot be built (no rows, a rank outside the world, ...).
    #[error("sampler: {0}")]
    Sampler(String),
    /// A text-generation request that cannot be served (an empty prompt, a token outside the
    /// vocabulary, a negative temperature, ...).
    #[error("sample: {0}")]
    Generate(String),
    /// A model method the model does not implement (e.g. [`crate::Model::forward`] on a
    /// model that only defines its loss).
    #[error("{0}")]
    Unsupported(String),
    /// A dataset file or request that does not fit the model.
    #[error("dataset {source_name}: {message}")]
    Data {
        /// The file or built-in generator.
        source_name: String,
        /// Which tensor or argument, expected versus found.
        message: String,
    },
}

impl ModelError {
    /// The same error with `path` in place of `<memory>`: for tensors that were read from
    /// `path` and then checked in memory (a checkpoint's model part).
    pub fn at_path(self, path: &std::path::Path) -> Self {
        let memory = |p: &PathBuf| p.as_os_str() == "<memory>";
        match self {
            ModelError::CheckpointMismatch { path: p, message } if memory(&p) => ModelError::CheckpointMismatch {
                path: path.to_path_buf(),
                message,
            },
            ModelError::NonFinite {
                path: p,
                tensor,
                index,
                value,
            } if memory(&p) => ModelError::NonFinite {
                path: path.to_path_buf(),
                tensor,
                index,
                value,
            },
            e => e,
        }
    }

    /// A [`ModelError::Data`] about `source` (a file or built-in generator).
    pub(crate) fn data(source: &str, message: String) -> ModelError {
        ModelError::Data {
            source_name: source.to_string(),
            message,
        }
    }

    pub(crate) fn io(path: &std::path::Path, e: impl std::fmt::Display) -> Self {
        ModelError::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
