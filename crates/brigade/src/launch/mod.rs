//! Starting ranks: N threads of this process, or this process's rank of an MPI job.
//!
//! [`launch`] is what `torch.multiprocessing.spawn` + `init_process_group` give PyTorch users:
//! it prepares what the ranks share ([`launch`]'s `setup`), hands each rank a [`RankContext`]
//! (its rank, the world size and its communicator stack, built by [`comm_stack`]) and returns
//! every result of this process's ranks, or the root-cause error naming its rank. The rank
//! function is the same for both backends; nothing here knows the command line.

mod mpi;
pub mod nccl;
mod threads;

use std::error::Error as StdError;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{CommError, Communicator, NetModel, Recorder, SharedLink, SimulatedNetwork, Traced};
use brigade_ddp::DdpError;

use crate::error::{Error, Result};

/// How the ranks are started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Ranks as threads of this process, exchanging through shared memory.
    Thread,
    /// One rank per process under `mpirun` (build with `--features mpi`); rank and world
    /// size come from MPI.
    Mpi,
    /// Gradient buckets averaged by NCCL on each rank's GPU (`--device cuda`); ranks as
    /// threads, or one per process under `mpirun`. See [`nccl`].
    Nccl,
}

impl Backend {
    /// Every backend, with its name on the command line and what it is.
    pub const ALL: [(Backend, &'static str, &'static str); 3] = [
        (
            Backend::Thread,
            "thread",
            "Ranks as threads of this process (--world-size N)",
        ),
        (
            Backend::Mpi,
            "mpi",
            "One rank per process under mpirun (build with --features mpi)",
        ),
        (
            Backend::Nccl,
            "nccl",
            "NCCL on GPUs (--device cuda): rank threads (--world-size N), or under mpirun one rank per process",
        ),
    ];

    /// The backend's name (`thread`, `mpi`).
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(b, ..)| *b == self)
            .map(|(_, n, _)| *n)
            .unwrap_or("?")
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .iter()
            .find(|(_, n, _)| *n == s)
            .map(|(b, ..)| *b)
            .ok_or_else(|| format!("unknown backend '{s}' (thread, mpi, nccl)"))
    }
}

/// Everything [`launch`] needs.
#[derive(Clone)]
pub struct LaunchConfig {
    /// Threads or MPI.
    pub backend: Backend,
    /// Ranks to start as threads (MPI: the job's size is used instead).
    pub world_size: usize,
    /// How long any rank waits for the others before failing.
    pub timeout: Duration,
    /// Make every collective as slow as this network.
    pub net: Option<NetModel>,
    /// Record every collective (and let the ranks record compute spans) here.
    pub recorder: Option<Recorder>,
}

impl LaunchConfig {
    /// How long a rank waits for the others by default (as `brigade train --timeout-s`).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

    /// `world_size` ranks as threads of this process, no simulated network, no recording.
    pub fn threads(world_size: usize) -> Self {
        LaunchConfig {
            backend: Backend::Thread,
            world_size,
            timeout: Self::DEFAULT_TIMEOUT,
            net: None,
            recorder: None,
        }
    }

    /// This process as one rank of the `mpirun` job (rank and world size from MPI; needs the
    /// `mpi` feature).
    pub fn mpi() -> Self {
        LaunchConfig {
            backend: Backend::Mpi,
            ..Self::threads(1)
        }
    }
}

/// What a rank gets from [`launch`].
pub struct RankContext {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks sharing this machine's cores (threads: all of them; MPI: this host's).
    pub local_ranks: usize,
    /// The communicator stack for training: the backend, then the simulated network and the
    /// tracing wrapper when configured.
    pub comm: Arc<dyn Communicator>,
    /// The bare backend communicator (not simulated, not traced), for control messages such as
    /// gathering the timeline.
    pub control: Arc<dyn Communicator>,
    /// Where to record compute spans (shared with the comm stack's tracing).
    pub recorder: Option<Recorder>,
    /// The launcher (threads or MPI): under MPI the recorder holds only this process's events.
    pub backend: Backend,
    /// Whether gradient buckets go to NCCL (`--backend nccl`) rather than to `comm`.
    pub nccl: bool,
    /// The simulated link (`--net-gbps`), also modelled on the GPU's comm stream under NCCL.
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

/// Starts the ranks `cfg` describes. `setup(world_size)` prepares what the ranks share (once
/// per process; under MPI every process's setup must succeed, or all fail with the first
/// failing rank's error); then `rank_fn` runs on every rank of this process.
///
/// Threads: a failing rank makes the others fail ("rank r is gone") instead of hanging; the
/// root cause is returned, naming its rank. MPI: an error in one rank ends the whole job.
pub fn launch<S: Sync, T: Send>(
    cfg: &LaunchConfig,
    setup: impl FnOnce(usize) -> Result<S>,
    rank_fn: impl Fn(&RankContext, &S) -> Result<T> + Sync,
) -> Result<Launched<T>> {
    match cfg.backend {
        Backend::Thread => threads::launch(cfg, setup, rank_fn),
        Backend::Mpi => mpi::launch(cfg, setup, rank_fn),
        Backend::Nccl if crate::launch::nccl::under_mpi() => mpi::launch(cfg, setup, rank_fn),
        Backend::Nccl => threads::launch(cfg, setup, rank_fn),
    }
}

/// The simulated network under a rank's collectives.
pub enum SimLink<'a> {
    /// One link every rank of the group shares (ranks as threads): a collective starts and
    /// finishes at the same instant on every rank, as on one real ring.
    Shared(&'a SharedLink),
    /// A link of this rank's own (ranks in other processes cannot share a clock).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    Own(NetModel),
}

/// The one place the communicator stack is built: `base` (a thread or MPI communicator), then
/// the simulated network, then tracing outermost (so the trace shows what the caller saw).
pub fn comm_stack(
    base: Arc<dyn Communicator>,
    net: Option<SimLink<'_>>,
    recorder: Option<&Recorder>,
) -> Arc<dyn Communicator> {
    let c: Arc<dyn Communicator> = match net {
        Some(SimLink::Shared(link)) => Arc::new(SimulatedNetwork::on_link(base, link)),
        Some(SimLink::Own(model)) => Arc::new(SimulatedNetwork::new(base, model)),
        None => base,
    };
    match recorder {
        Some(r) => Arc::new(Traced::new(c, r.clone())),
        None => c,
    }
}

/// A link of `gbps` gigabits per second and `latency_us` microseconds per message.
pub fn net_model(gbps: f64, latency_us: f64) -> NetModel {
    NetModel {
        latency: Duration::from_secs_f64(latency_us * 1e-6),
        bandwidth_bytes_per_s: gbps * 1e9 / 8.0,
    }
}

/// Default compute threads per rank: the cores shared out among `local_ranks` ranks.
pub fn default_threads(local_ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (cores / local_ranks.max(1)).max(1)
}

/// Whether `e` only reports that a peer is gone (`CommError::RankFailed`, `CommError::Closed`):
/// the consequence of another rank's failure, not a cause. Walks the source chain, stepping
/// through the transparent wrappers (whose `source()` skips the error they wrap).
pub fn is_secondary(e: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(c) = e.downcast_ref::<CommError>() {
            return matches!(c, CommError::RankFailed { .. } | CommError::Closed { .. });
        }
        next = match (e.downcast_ref::<Error>(), e.downcast_ref::<DdpError>()) {
            (Some(Error::Comm(c)), _) | (_, Some(DdpError::Comm(c))) => Some(c as &(dyn StdError + 'static)),
            (Some(Error::Ddp(d)), _) => Some(d as &(dyn StdError + 'static)),
            (Some(Error::Autograd(a)), _) | (_, Some(DdpError::Autograd(a))) => Some(a as &(dyn StdError + 'static)),
            (Some(Error::OnRank { source, .. }), _) => Some(source.as_ref() as &(dyn StdError + 'static)),
            _ => e.source(),
        };
    }
    false
}

/// The root cause among the ranks' errors: a rank's own failure beats the "a peer is gone"
/// errors it caused on the others; the first such rank when several failed on their own.
pub fn pick_error(mut errors: Vec<(usize, Error)>) -> (usize, Error) {
    let i = errors.iter().position(|(_, e)| !is_secondary(e)).unwrap_or(0);
    errors.swap_remove(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Wrapped(Error);

    impl fmt::Display for Wrapped {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("while reducing a bucket")
        }
    }

    impl StdError for Wrapped {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    fn gone(rank: usize) -> CommError {
        CommError::RankFailed {
            rank,
            tag: "bucket0".into(),
            reason: "it returned early".into(),
        }
    }

    #[test]
    fn peer_gone_errors_are_found_through_wrappers_and_source_chains() {
        assert!(is_secondary(&Error::Comm(gone(1))));
        assert!(is_secondary(&Error::Ddp(DdpError::Comm(CommError::Closed {
            rank: 0,
            tag: "x".into()
        }))));
        assert!(is_secondary(&Wrapped(Error::Ddp(DdpError::Comm(gone(1))))));
        let on_rank = Error::OnRank {
            rank: 1,
            world: 2,
            source: Box::new(Error::Comm(gone(0))),
        };
        assert!(is_secondary(&on_rank));
        // A timeout or a mismatch is a cause, whatever its text says.
        let timeout = CommError::Timeout {
            rank: 0,
            tag: "rank 1 is gone".into(),
            after: Duration::from_secs(1),
        };
        assert!(!is_secondary(&Error::Comm(timeout)));
        assert!(!is_secondary(&Error::Usage(
            "rank 1 is gone, comm stream closed".into()
        )));
        assert!(!is_secondary(&Wrapped(Error::Usage("no".into()))));
    }

    #[test]
    fn the_root_cause_beats_the_errors_it_caused() {
        let errors = vec![
            (0, Error::Comm(gone(1))),
            (1, Error::Usage("rank 1 ran out of data: is gone".into())),
            (2, Error::Ddp(DdpError::Comm(gone(1)))),
        ];
        let (rank, e) = pick_error(errors);
        assert_eq!(rank, 1, "{e}");
        let (rank, _) = pick_error(vec![(3, Error::Comm(gone(0))), (4, Error::Comm(gone(3)))]);
        assert_eq!(rank, 3, "only secondary errors: the first");
    }
}
