//! The CLI's error type: one line for the user, then a non-zero exit.

use brigade_autograd::AutogradError;
use brigade_comm::CommError;
use brigade_ddp::DdpError;
use brigade_models::ModelError;
use brigade_tensor::TensorError;

/// Everything `brigade` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Flags that cannot work together or values out of range.
    #[error("{0}")]
    Usage(String),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Ddp(#[from] DdpError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A checkpoint that does not fit this run.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: String, msg: String },
    /// Rendering a chart.
    #[error("chart {path}: {msg}")]
    Chart { path: String, msg: String },
    /// Outputs of a finished run that could not be written (each: flag, path, cause); the
    /// others were written.
    #[error("{} of the outputs could not be written (the others were): {}", .0.len(), .0.join("; "))]
    Outputs(Vec<String>),
}

/// Result alias for the CLI.
pub type Result<T> = std::result::Result<T, CliError>;

/// Writes `bytes` to `path` atomically (see [`brigade_models::write_atomic`]: a unique
/// temporary beside the target, synced, then renamed; a symbolic link keeps pointing at
/// the file it names, which is what gets written).
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    brigade_models::write_atomic(path, bytes).map_err(|source| CliError::Io {
        path: path.display().to_string(),
        source,
    })
}
