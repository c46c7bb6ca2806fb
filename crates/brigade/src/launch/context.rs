//! What a launch is given and what each rank gets: the communication backend
//! ([`CommBackend`]), the launch's configuration ([`LaunchConfig`]), one rank's view
//! ([`RankContext`]) and the results ([`Launched`]).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{Communicator, NetModel, Recorder};
use brigade_ddp::Group;

use crate::error::Error;

/// Which communication backend carries the ranks' collectives, and so how the ranks start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommBackend {
    /// Ranks as threads of this process, exchanging through shared memory.
    Thread,
    /// One rank per process under `mpirun` (a build with the `mpi` feature); rank and world
    /// size come from MPI.
    Mpi,
    /// Gradient buckets averaged by NCCL on each rank's GPU (a CUDA placement); ranks as
    /// threads, or one per process under `mpirun`. See [`crate::launch::nccl`].
    Nccl,
}

impl CommBackend {
    /// Every backend.
    pub const ALL: [CommBackend; 3] = [CommBackend::Thread, CommBackend::Mpi, CommBackend::Nccl];

    /// The backend's name (`thread`, `mpi`, `nccl`).
    pub fn name(self) -> &'static str {
        match self {
            CommBackend::Thread => "thread",
            CommBackend::Mpi => "mpi",
            CommBackend::Nccl => "nccl",
        }
    }
}

impl fmt::Display for CommBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CommBackend {
    type Err = String;

    /// A backend by its [`name`](CommBackend::name).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("unknown backend '{s}' (thread, mpi, nccl)"))
    }
}

/// What a launch does with an error that ends every process of an MPI job before the launch
/// can return it (see [`LaunchConfig::on_fatal`]).
pub type OnFatal = Arc<dyn Fn(&Error) + Send + Sync>;

/// Everything [`crate::launch::run_ranks`] needs.
#[derive(Clone)]
pub struct LaunchConfig {
    /// Threads, MPI or NCCL.
    pub backend: CommBackend,
    /// Ranks to start as threads (MPI: the job's size is used instead).
    pub world_size: usize,
    /// How long any rank waits for the others before failing.
    pub timeout: Duration,
    /// Make every collective as slow as this network.
    pub net: Option<NetModel>,
    /// Record every collective (and let the ranks record compute spans) here.
    pub recorder: Option<Recorder>,
    /// Under MPI a failure ends the job inside the launch (every process exits together, or
    /// `MPI_Abort` ends them at once so that no peer waits for a rank that is gone): this is
    /// told the error first, on every process that reports it (a program prints it). The
    /// thread backend returns its errors instead.
    pub on_fatal: Option<OnFatal>,
}

impl LaunchConfig {
    /// How long a rank waits for the others by default (two minutes).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

    /// `world_size` ranks as threads of this process, no simulated network, no recording.
    pub fn threads(world_size: usize) -> Self {
        LaunchConfig {
            backend: CommBackend::Thread,
            world_size,
            timeout: Self::DEFAULT_TIMEOUT,
            net: None,
            recorder: None,
            on_fatal: None,
        }
    }

    /// This process as one rank of the `mpirun` job (rank and world size from MPI; needs the
    /// `mpi` feature). Set [`on_fatal`](Self::on_fatal) to say why the job ended.
    pub fn mpi() -> Self {
        LaunchConfig {
            backend: CommBackend::Mpi,
            ..Self::threads(1)
        }
    }
}

/// What a rank gets from [`crate::launch::run_ranks`].
pub struct RankContext {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks sharing this machine's cores (threads: all of them; MPI: this host's).
    pub local_ranks: usize,
    /// The communicator for training: the backend's comm stream, on the simulated network and
    /// traced when configured.
    pub comm: Arc<dyn Communicator>,
    /// DDP's host group over the same stream as `comm` (its collectives are the stream's own).
    pub group: Group,
    /// The same stream, neither simulated nor traced, for control messages such as gathering
    /// the timeline.
    pub control: Arc<dyn Communicator>,
    /// Where to record compute spans (shared with the comm stack's tracing).
    pub recorder: Option<Recorder>,
    /// The launcher that started this rank ([`CommBackend::Thread`] or [`CommBackend::Mpi`]):
    /// under MPI the recorder holds only this process's events.
    pub launcher: CommBackend,
    /// Whether gradient buckets go to NCCL rather than to `comm`.
    pub nccl: bool,
    /// The simulated link (`LaunchConfig::net`), also modelled on the GPU's comm stream under
    /// NCCL.
    pub net: Option<NetModel>,
}

impl RankContext {
    /// Compute threads per rank by default: this machine's cores shared among its ranks.
    pub fn default_compute_threads(&self) -> usize {
        default_threads(self.local_ranks)
    }
}

/// This process's ranks' results.
pub struct Launched<T> {
    /// Number of ranks in the job.
    pub world_size: usize,
    /// `(rank, result)` of every rank of this process, in rank order: all of them with threads,
    /// this process's one under MPI.
    pub results: Vec<(usize, T)>,
}

impl<T> Launched<T> {
    /// Rank 0's result, if rank 0 ran in this process (the rank that reports and writes files).
    pub fn into_rank0(self) -> Option<T> {
        self.results.into_iter().find(|(r, _)| *r == 0).map(|(_, t)| t)
    }
}

/// Default compute threads per rank: the cores shared out among `local_ranks` ranks.
pub fn default_threads(local_ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (cores / local_ranks.max(1)).max(1)
}
