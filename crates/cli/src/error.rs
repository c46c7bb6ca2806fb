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
    /// One rank's failure (the root cause among the ranks' errors).
    #[error("rank {rank} of {world}: {source}")]
    OnRank {
        rank: usize,
        world: usize,
        source: Box<CliError>,
    },
    /// A loss or parameter stopped being finite: the run diverged (every rank stops at the same
    /// step, before that step's update).
    #[error(
        "step {step}: {what} is {value}: the run diverged. The last good checkpoint was kept; \
         lower --lr, or pass --allow-nonfinite to train on"
    )]
    NonFinite { step: usize, what: String, value: f64 },
    /// SIGINT or SIGTERM stopped the run after a step (exit status 130).
    #[error("interrupted after step {step} of {steps}: the outputs hold every finished step")]
    Interrupted { step: usize, steps: usize },
}

impl CliError {
    /// Whether every rank reaches this error together (so it names no rank and needs no abort).
    pub fn is_agreed(&self) -> bool {
        matches!(self, CliError::NonFinite { .. } | CliError::Interrupted { .. })
    }

    /// This error as rank `rank`'s of `world` (unchanged when it is agreed or the world is one rank).
    pub fn on_rank(self, rank: usize, world: usize) -> CliError {
        if world == 1 || self.is_agreed() {
            return self;
        }
        CliError::OnRank {
            rank,
            world,
            source: Box::new(self),
        }
    }

    /// The process exit status for this error: 130 for an interrupted run (as shells report
    /// SIGINT), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Interrupted { .. } => 130,
            _ => 1,
        }
    }
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
