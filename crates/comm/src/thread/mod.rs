//! The thread backend: `n` ranks as threads of one process, exchanging data through shared
//! memory. All-reduce is a reduce-scatter followed by an all-gather done in one pass: rank `r`
//! reduces chunk `r` across every rank's buffer and writes the result into chunk `r` of every
//! buffer, all ranks in parallel. A small all-reduce (at most 8 KiB) instead reduces every rank's
//! staged copy into each buffer after a single rendezvous (see `transport.rs`).

mod desc;
mod rendezvous;
mod transport;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

pub use transport::ThreadTransport;

use crate::error::panic_message;
use crate::{CommError, CommStream};
use rendezvous::Rendezvous;

/// A rank of a thread group: a [`CommStream`] over a [`ThreadTransport`].
pub type ThreadComm = CommStream<ThreadTransport>;

/// Timeout of [`ThreadGroup::new`] and [`run_on_threads`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Creates the communicators of a group of ranks that live in one process.
pub struct ThreadGroup;

impl ThreadGroup {
    /// `n` communicators, rank `i` at index `i`, with [`DEFAULT_TIMEOUT`]. Hand each to its own
    /// thread; a rank whose communicator is dropped (including by a panic) is marked dead and
    /// its peers' collectives fail with [`CommError::RankFailed`].
    ///
    /// # Panics
    /// If `n == 0`.
    #[allow(clippy::new_ret_no_self)] // a group is its communicators
    pub fn new(n: usize) -> Vec<ThreadComm> {
        Self::with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// As [`ThreadGroup::new`], with `timeout` for every wait (handles and internal waits).
    ///
    /// # Panics
    /// If `n == 0`.
    pub fn with_timeout(n: usize, timeout: Duration) -> Vec<ThreadComm> {
        assert!(n > 0, "a thread group needs at least one rank");
        let shared = Arc::new(Rendezvous::new(n, timeout));
        (0..n)
            .map(|rank| CommStream::new(ThreadTransport::new(rank, shared.clone()), timeout))
            .collect()
    }
}

/// Runs `f` on `n` ranks, each on its own thread with its own communicator, and returns each
/// rank's result (rank order). A rank that panics yields [`CommError::Panicked`]; the others see
/// it as dead and fail instead of hanging. Uses [`DEFAULT_TIMEOUT`].
pub fn run_on_threads<R: Send>(n: usize, f: impl Fn(ThreadComm) -> R + Sync) -> Vec<Result<R, CommError>> {
    run_on_threads_with_timeout(n, DEFAULT_TIMEOUT, f)
}

/// As [`run_on_threads`], with `timeout` for every wait.
pub fn run_on_threads_with_timeout<R: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(ThreadComm) -> R + Sync,
) -> Vec<Result<R, CommError>> {
    let comms = ThreadGroup::with_timeout(n, timeout);
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        catch_unwind(AssertUnwindSafe(|| f(comm))).map_err(|payload| CommError::Panicked {
                            rank,
                            message: panic_message(payload.as_ref()),
                        })
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|payload| {
                    Err(CommError::Panicked {
                        rank,
                        message: panic_message(payload.as_ref()),
                    })
                })
            })
            .collect()
    })
}
