//! The raw NCCL communicator handle, owned so that it can be polled and aborted from the
//! watchdog thread (cudarc's safe `Comm` hides the handle, is not `Send`, and panics when an
//! abort fails on drop).

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::nccl::{result, sys};

use super::watchdog::Abortable;

/// One `ncclComm_t`. Enqueues are serialized by the watchdog's enqueue lock; the asynchronous
/// error query and the abort by its look lock, never by the enqueue lock: NCCL allows
/// `ncclCommGetAsyncError` and `ncclCommAbort` from another thread while an enqueue runs, and
/// the abort is how a blocked enqueue ends.
pub(crate) struct RawComm {
    comm: sys::ncclComm_t,
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator is a heap object owned by NCCL; enqueues are serialized, and
// the calls NCCL allows concurrently with an enqueue (the asynchronous error query, the abort)
// are serialized with each other by the watchdog (see above).
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

/// NCCL's result code as text (`ncclRemoteError`), what a user can look up.
pub(crate) fn code(r: sys::ncclResult_t) -> String {
    format!("{r:?}")
}

impl RawComm {
    /// Joins the communicator `id` as `rank` of `world`; blocks until every rank joined. The
    /// current thread must have the rank's CUDA context bound.
    pub(crate) fn init_rank(world: usize, id: sys::ncclUniqueId, rank: usize) -> Result<RawComm, String> {
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; NCCL fills it on success.
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }.map_err(|e| code(e.0))?;
        Ok(RawComm {
            comm,
            aborted: AtomicBool::new(false),
        })
    }

    pub(crate) fn handle(&self) -> sys::ncclComm_t {
        self.comm
    }
}

impl Abortable for RawComm {
    /// `ncclCommGetAsyncError`: `Err(code)` once an asynchronous error (a dead peer, a network
    /// failure) hit the communicator.
    fn async_error(&self) -> Result<(), String> {
        if self.is_aborted() {
            return Err("communicator aborted".into());
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and a valid out-pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(code(r));
        }
        match state {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            other => Err(code(other)),
        }
    }

    /// `ncclCommAbort`: frees the communicator and ends its kernels still queued or running, so
    /// that no stream waits forever on a dead peer.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: a live communicator, aborted once (the swap).
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        if !self.is_aborted() {
            // SAFETY: a live communicator, destroyed once (after its queued work).
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}
