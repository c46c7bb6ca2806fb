//! The library's error type ([`Error`], `brigade::Error`): what launching ranks, training,
//! checkpoints and the command line can fail with, typed per cause. The binary prints it as
//! one line and exits non-zero ([`Error::exit_code`]).

use brigade_autograd::AutogradError;
use brigade_comm::CommError;
use brigade_ddp::DdpError;
use brigade_models::ModelError;
use brigade_policies::PolicyError;
use brigade_tensor::TensorError;

/// Everything the `brigade` library and binary can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Flags that cannot work together or values out of range.
    #[error("{0}")]
    Usage(String),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file (with the flag that named it, when there is one).
        path: String,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// A model, layer, dataset or safetensors file failed (`brigade::models`).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The DDP reducer or a reducer policy failed (`brigade::ddp`).
    #[error(transparent)]
    Ddp(#[from] DdpError),
    /// A policy spec, setting or registry lookup failed (`brigade::policies`).
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A collective failed or timed out, or a peer is gone (`brigade::comm`).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Backward or an optimizer failed (`brigade::autograd`).
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A tensor op failed: shapes, dtypes, devices (`brigade::tensor`).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A checkpoint that does not fit this run.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The checkpoint file.
        path: String,
        /// What does not fit.
        msg: String,
    },
    /// Rendering a chart.
    #[error("chart {path}: {msg}")]
    Chart {
        /// The chart file.
        path: String,
        /// What the renderer said.
        msg: String,
    },
    /// Outputs of a finished run that could not be written (each: flag, path, cause); the
    /// others were written.
    #[error("{} of the outputs could not be written (the others were): {}", .0.len(), .0.join("; "))]
    Outputs(Vec<String>),
    /// One rank's failure (the root cause among the ranks' errors).
    #[error("rank {rank} of {world}: {source}")]
    OnRank {
        /// The rank that failed.
        rank: usize,
        /// The number of ranks.
        world: usize,
        /// That rank's own error.
        source: Box<Error>,
    },
    /// A loss or parameter stopped being finite: the run diverged (every rank stops at the same
    /// step, before that step's update).
    #[error(
        "step {step}: {what} is {value}: the run diverged. The last good checkpoint was kept and \
         no diverged parameters were saved; lower --lr, or pass --allow-nonfinite to train on"
    )]
    NonFinite {
        /// The step whose loss (or update) was not finite.
        step: usize,
        /// What was not finite (the loss, or which parameter).
        what: String,
        /// The value found (NaN or an infinity).
        value: f64,
    },
    /// SIGINT or SIGTERM stopped the run after a step (exit status 130).
    #[error("interrupted after step {step} of {steps}: the outputs hold every finished step")]
    Interrupted {
        /// The last step run.
        step: usize,
        /// The step the run was to train until.
        steps: usize,
    },
}

impl Error {
    /// Whether every rank reaches this error together (so it names no rank and needs no abort).
    pub fn is_agreed(&self) -> bool {
        matches!(self, Error::NonFinite { .. } | Error::Interrupted { .. })
    }

    /// This error as rank `rank`'s of `world` (unchanged when it is agreed or the world is one rank).
    pub fn on_rank(self, rank: usize, world: usize) -> Error {
        if world == 1 || self.is_agreed() {
            return self;
        }
        Error::OnRank {
            rank,
            world,
            source: Box::new(self),
        }
    }

    /// The process exit status for this error: 130 for an interrupted run (as shells report
    /// SIGINT), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Interrupted { .. } => 130,
            _ => 1,
        }
    }
}

/// Result alias for the library.
pub type Result<T> = std::result::Result<T, Error>;

/// Writes `bytes` to `path` atomically (see [`brigade_models::write_atomic`]: a unique
/// temporary beside the target, synced, then renamed; a symbolic link keeps pointing at
/// the file it names, which is what gets written).
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    brigade_models::write_atomic(path, bytes).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })
}
