//! MPI's lifetime in a process: initialization, the ranks, communicators, abort, finalization.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ::mpi::environment::Universe;
use ::mpi::topology::Communicator as _;
use ::mpi::Threading;

use super::raw::RawComm;
use super::MpiTransport;
use crate::{CommError, CommStream};

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
    /// with `timeout` for [`crate::Work::wait`] and for every MPI wait inside. Collective: every
    /// process must call it, in the same order as its other communicator constructions.
    pub fn communicator(&self, timeout: Duration) -> Result<MpiComm, CommError> {
        Ok(CommStream::new(self.transport(timeout)?, timeout))
    }

    /// The synchronous transport behind [`MpiWorld::communicator`] (a duplicate of
    /// `MPI_COMM_WORLD`, so that its messages never mix with another communicator's).
    /// Collective, like `communicator`.
    pub fn transport(&self, timeout: Duration) -> Result<MpiTransport, CommError> {
        let comm = RawComm::dup_world(self.rank)?;
        let mut st = self.live.count.lock().unwrap_or_else(|e| e.into_inner());
        st.transports += 1;
        st.longest_timeout = st.longest_timeout.max(timeout);
        drop(st);
        MpiTransport::new(comm, self.rank, self.size, timeout, LiveGuard(self.live.clone()))
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
