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
}

/// Result alias for the CLI.
pub type Result<T> = std::result::Result<T, CliError>;

/// Writes `bytes` to `path` atomically: a temporary file beside it, then a rename.
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let io = |source| CliError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}
