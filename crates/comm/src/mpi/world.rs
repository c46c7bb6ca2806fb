//! MPI's lifetime in a process: initialization, the ranks, communicators, abort, finalization.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ::mpi::environment::Universe;
use ::mpi::topology::Communicator as _;
use ::mpi::Threading;

use super::node::{discover, NODE_SIZE_VAR};
use super::raw::RawComm;
use super::watchdog::Watchdog;
use super::MpiTransport;
use crate::{CommError, CommStream};

/// The environment variable that turns the shared-memory path off (`0`) or on (`1`).
const SHM_VAR: &str = "BRIGADE_MPI_SHM";

/// How a communicator of an [`MpiWorld`] moves data. Every rank must pass the same options
/// (checked: a difference fails every rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpiOptions {
    /// Bound on [`crate::Work::wait`] and on every wait inside: a wait in the shared segment
    /// fails with [`CommError::Timeout`]; a blocking MPI call past it ends the job
    /// (`MPI_Abort`) after naming the collective and the rank.
    pub timeout: Duration,
    /// All-reduce inside a node through a shared-memory segment (and hierarchically across
    /// nodes) instead of through MPI alone. Default on; `BRIGADE_MPI_SHM=0` turns it off.
    pub shared_memory: bool,
    /// Ranks per node, consecutive ranks grouped (`BRIGADE_NODE_SIZE`); `None` groups the
    /// ranks by host, as MPI sees them (`MPI_Comm_split_type` with `MPI_COMM_TYPE_SHARED`).
    /// A declared node must divide the job evenly and its ranks must share memory: with
    /// `BRIGADE_NODE_SIZE=2`, four ranks on one host are two nodes of two, and the step
    /// between them goes over MPI as it would between hosts.
    pub node_size: Option<usize>,
}

impl MpiOptions {
    /// `timeout`, shared memory on, nodes as MPI sees them.
    pub fn new(timeout: Duration) -> MpiOptions {
        MpiOptions {
            timeout,
            shared_memory: true,
            node_size: None,
        }
    }

    /// `timeout`, with `BRIGADE_MPI_SHM` (`0`/`off` or `1`/`on`) and `BRIGADE_NODE_SIZE` (a
    /// positive number) read from the environment when set.
    pub fn from_env(timeout: Duration) -> Result<MpiOptions, CommError> {
        let mut opts = MpiOptions::new(timeout);
        if let Ok(value) = std::env::var(SHM_VAR) {
            opts.shared_memory = match value.trim().to_ascii_lowercase().as_str() {
                "0" | "off" | "false" | "no" => false,
                "1" | "on" | "true" | "yes" => true,
                _ => {
                    return Err(CommError::InvalidArgument(format!(
                        "{SHM_VAR}={value}: expected 0 (off) or 1 (on)"
                    )))
                }
            };
        }
        if let Ok(value) = std::env::var(NODE_SIZE_VAR) {
            opts.node_size = match value.trim().parse::<usize>() {
                Ok(k) if k > 0 => Some(k),
                _ => {
                    return Err(CommError::InvalidArgument(format!(
                        "{NODE_SIZE_VAR}={value}: expected the number of ranks per node (at least 1)"
                    )))
                }
            };
        }
        Ok(opts)
    }
}

/// A rank of the MPI backend: a [`CommStream`] over an [`MpiTransport`].
pub type MpiComm = CommStream<MpiTransport>;

/// MPI in this process, from `MPI_Init_thread` to `MPI_Finalize`. Create it once, at the start
/// of `main` (MPI cannot be initialized twice), make communicators from it, and drop it last:
/// dropping waits (bounded) until every comm stream made from it has ended, then finalizes.
///
/// Rank and world size come from the launcher (`mpirun -np N`); a process started without
/// `mpirun` is a world of one.
pub struct MpiWorld {
    universe: Option<Universe>,
    rank: usize,
    size: usize,
    threading: Threading,
    live: Arc<Live>,
}

/// Counts the transports still alive, so that finalization waits for their threads.
pub(crate) struct Live {
    count: Mutex<LiveState>,
    ended: Condvar,
}

struct LiveState {
    transports: usize,
    longest_timeout: Duration,
}

/// Held by a transport; dropping it tells the [`MpiWorld`] that the transport is gone.
pub(crate) struct LiveGuard(Arc<Live>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        let mut st = self.0.count.lock().unwrap_or_else(|e| e.into_inner());
        st.transports -= 1;
        drop(st);
        self.0.ended.notify_all();
    }
}

impl MpiWorld {
    /// Initializes MPI with `MPI_THREAD_MULTIPLE` (each comm stream's thread calls MPI; the
    /// main thread may call [`MpiWorld::abort`] meanwhile). Fails if MPI was already
    /// initialized in this process or grants less than `MPI_THREAD_SERIALIZED`.
    pub fn init() -> Result<MpiWorld, CommError> {
        let (universe, threading) = ::mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| {
            CommError::InvalidArgument(
                "MPI is already initialized in this process: create one MpiWorld and keep it".into(),
            )
        })?;
        if !matches!(threading, Threading::Multiple | Threading::Serialized) {
            return Err(CommError::Unsupported(format!(
                "this MPI library grants only {threading:?} threading; the MPI backend needs \
                 MPI_THREAD_SERIALIZED or better (its comm thread calls MPI)"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(MpiWorld {
            universe: Some(universe),
            rank,
            size,
            threading,
            live: Arc::new(Live {
                count: Mutex::new(LiveState {
                    transports: 0,
                    longest_timeout: Duration::ZERO,
                }),
                ended: Condvar::new(),
            }),
        })
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes in `MPI_COMM_WORLD`.
    pub fn world_size(&self) -> usize {
        self.size
    }

    /// The thread support MPI granted (`Multiple` or `Serialized`).
    pub fn threading(&self) -> Threading {
        self.threading
    }

    /// A communicator over all processes whose collectives run on its own comm stream thread,
    /// with `timeout` for [`crate::Work::wait`] and for every wait inside, and the options of
    /// the environment ([`MpiOptions::from_env`]). Collective: every process must call it, in
    /// the same order as its other communicator constructions.
    pub fn communicator(&self, timeout: Duration) -> Result<MpiComm, CommError> {
        self.communicator_with(&MpiOptions::from_env(timeout)?)
    }

    /// As [`MpiWorld::communicator`], with explicit options.
    pub fn communicator_with(&self, opts: &MpiOptions) -> Result<MpiComm, CommError> {
        Ok(CommStream::new(self.transport_with(opts)?, opts.timeout))
    }

    /// The synchronous transport behind [`MpiWorld::communicator`]. Collective, like
    /// `communicator`.
    pub fn transport(&self, timeout: Duration) -> Result<MpiTransport, CommError> {
        self.transport_with(&MpiOptions::from_env(timeout)?)
    }

    /// The synchronous transport behind [`MpiWorld::communicator_with`]: a duplicate of
    /// `MPI_COMM_WORLD` (so that its messages never mix with another communicator's), the
    /// node's segment and the communicator across nodes, and the watchdog of its blocking
    /// calls (which also guards this setup). Collective.
    pub fn transport_with(&self, opts: &MpiOptions) -> Result<MpiTransport, CommError> {
        let (rank, size, timeout) = (self.rank, self.size, opts.timeout);
        let watchdog = Watchdog::start(
            format!("mpi-watchdog-{rank}"),
            timeout,
            Box::new(move |what: &str| {
                eprintln!("brigade-comm: {what} did not complete within {timeout:?}; ending the job (MPI_Abort)");
                // SAFETY: MPI is initialized (MULTIPLE: any thread may call MPI_Abort).
                unsafe { ::mpi::ffi::MPI_Abort(::mpi::ffi::RSMPI_COMM_WORLD, 1) };
                std::process::exit(1)
            }),
        );
        let armed = watchdog.arm(Instant::now() + timeout, move || {
            format!("rank {rank}: the setup of a communicator (MPI_Comm_dup, the nodes, the shared segment)")
        });
        let comm = RawComm::dup_world(rank)?;
        let (topology, node) = discover(&comm, rank, size, opts.node_size, opts.shared_memory, timeout)?;
        drop(armed);
        let mut st = self.live.count.lock().unwrap_or_else(|e| e.into_inner());
        st.transports += 1;
        st.longest_timeout = st.longest_timeout.max(timeout);
        drop(st);
        MpiTransport::new(
            comm,
            node,
            topology,
            rank,
            size,
            timeout,
            watchdog,
            LiveGuard(self.live.clone()),
        )
    }

    /// Ends every process of the job with exit status `code` (`MPI_Abort`): what a rank does
    /// when it cannot go on, so that no peer waits for it until its timeout.
    pub fn abort(&self, code: i32) -> ! {
        // SAFETY: MPI is initialized (with MULTIPLE, any thread may call MPI_Abort).
        unsafe { ::mpi::ffi::MPI_Abort(::mpi::ffi::RSMPI_COMM_WORLD, code) };
        std::process::exit(code)
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        let mut st = self.live.count.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = Instant::now() + st.longest_timeout + Duration::from_secs(1);
        while st.transports > 0 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st = self
                .live
                .ended
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let stuck = st.transports;
        drop(st);
        if let Some(universe) = self.universe.take() {
            if stuck == 0 {
                drop(universe); // MPI_Finalize
            } else {
                // Finalizing under a thread that is still inside MPI is undefined behaviour.
                eprintln!(
                    "brigade-comm: rank {}: {stuck} MPI comm stream(s) still running; not calling \
                     MPI_Finalize",
                    self.rank
                );
                std::mem::forget(universe);
            }
        }
    }
}
