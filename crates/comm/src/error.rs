//! The one error type every collective returns.

use std::time::Duration;

/// Why a collective failed. Every variant names the rank and the collective's tag, so a
/// message read in a log says which bucket on which rank went wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// The collective did not complete within the communicator's timeout (or the timeout passed
    /// to [`crate::Work::wait_timeout`]). `rank` is the rank that gave up waiting.
    #[error("rank {rank}: collective `{tag}` did not complete within {after:?}")]
    Timeout {
        /// The rank that was waiting.
        rank: usize,
        /// The collective's tag.
        tag: String,
        /// How long it waited.
        after: Duration,
    },
    /// A peer rank is gone (its thread panicked, it returned early, it dropped its communicator
    /// or it gave up after a timeout), so this collective can never complete.
    #[error("collective `{tag}` failed: rank {rank} is gone ({reason})")]
    RankFailed {
        /// The dead rank.
        rank: usize,
        /// The tag of the collective that could not complete.
        tag: String,
        /// What happened to the dead rank.
        reason: String,
    },
    /// Two ranks issued different collectives (kind, dtype, length, op, root or tag) in the same
    /// slot of their comm streams. Nothing was mixed: every rank of the slot gets this error.
    #[error(
        "collective mismatch in slot {slot}: rank {expected_rank} issued {expected} but rank \
         {found_rank} issued {found} (tag `{tag}` on rank {expected_rank})"
    )]
    Mismatch {
        /// The tag issued by `expected_rank`.
        tag: String,
        /// Position of the collective in the comm stream (0 = first collective issued).
        slot: u64,
        /// The rank whose collective is taken as the reference (rank 0).
        expected_rank: usize,
        /// Description of the reference collective.
        expected: String,
        /// The first rank whose collective differs.
        found_rank: usize,
        /// Description of its collective.
        found: String,
    },
    /// The arguments cannot work on any rank (root out of range, length not divisible, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The backend cannot do this (e.g. a reduction on `U8` buffers).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// This rank's comm stream is gone (its communicator was dropped, or the backend dropped
    /// the operation without completing it).
    #[error("rank {rank}: comm stream closed before collective `{tag}` completed")]
    Closed {
        /// The rank whose stream is gone.
        rank: usize,
        /// The tag of the collective.
        tag: String,
    },
    /// NCCL (or a CUDA call around it) failed on this rank in this collective, or the
    /// watchdog aborted the communicator; every later collective fails with the same error.
    #[error("rank {rank}: NCCL collective `{tag}` failed: {detail}; the communicator was aborted")]
    Nccl {
        /// The rank that saw it.
        rank: usize,
        /// The collective (or `ncclCommInitRank`).
        tag: String,
        /// NCCL's code or the CUDA error.
        detail: String,
    },
    /// A backend's library or device is missing on this machine.
    #[error("{0}")]
    Unavailable(String),
    /// The backend itself failed (a bug: it panicked while executing a collective).
    #[error("backend failure: {0}")]
    Internal(String),
    /// A rank's closure panicked inside [`crate::run_on_threads`].
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The rank that panicked.
        rank: usize,
        /// The panic payload, when it was a string.
        message: String,
    },
}

/// Turns a panic payload into text for error messages.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
