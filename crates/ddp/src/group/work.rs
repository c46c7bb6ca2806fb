//! The future a process group's collectives return ([`TensorWork`]), with `then`-style
//! continuations: PyTorch's `torch.futures.Future` over comm's [`Work`].

use std::time::Duration;

use brigade_comm::{OpTiming, Work};

use crate::Result;

/// The asynchronous result of collectives and what is chained on them (PyTorch's
/// `torch.futures.Future`): it completes with a value or a [`DdpError`]. Continuations run on
/// the thread that completes the work (the comm stream's, or the caller's when it already
/// completed): keep them short, and never hold a lock in the caller that a continuation takes.
pub struct TensorWork<T> {
    work: Work<Result<T>>,
    timeout: Duration,
}

/// The producer side of a [`TensorWork`] made with [`TensorWork::pending`]: dropping it without
/// completing fails the work (never a hang).
pub struct TensorPromise<T>(brigade_comm::Promise<Result<T>>);

impl<T> TensorPromise<T> {
    /// Completes the work with `value`.
    pub fn complete(self, value: Result<T>) {
        self.0.complete(Ok(value))
    }
}

impl<T: Send + 'static> TensorWork<T> {
    /// A work that completes when its promise does (e.g. "the previous bucket is done", to
    /// chain one bucket's collectives after another's).
    pub fn pending(rank: usize, tag: &str, timeout: Duration) -> (TensorWork<T>, TensorPromise<T>) {
        let (work, promise) = Work::pending(rank, tag, timeout);
        (TensorWork { work, timeout }, TensorPromise(promise))
    }

    /// A work that has already completed with `value`.
    pub fn ready(rank: usize, tag: &str, timeout: Duration, value: Result<T>) -> TensorWork<T> {
        let (work, promise) = Work::pending(rank, tag, timeout);
        promise.complete(Ok(value));
        TensorWork { work, timeout }
    }

    /// A collective's work whose buffer `f` turns into the value (on the comm stream's thread).
    pub(crate) fn from_comm<B: Send + 'static>(
        work: Work<B>,
        timeout: Duration,
        f: impl FnOnce(B) -> Result<T> + Send + 'static,
    ) -> TensorWork<T> {
        TensorWork {
            work: work.then(move |b| Ok(f(b))),
            timeout,
        }
    }

    /// Chains `step` after this work (decompress, divide, copy): the returned work completes
    /// with `step(value)`, or with this work's error.
    pub fn then<U: Send + 'static>(self, step: impl FnOnce(T) -> Result<U> + Send + 'static) -> TensorWork<U> {
        TensorWork {
            work: self.work.then(move |r| Ok(r.and_then(step))),
            timeout: self.timeout,
        }
    }

    /// Chains further collectives after this work: once it succeeded, `step(value)` issues them
    /// and the returned work completes with theirs. Collectives issued by `step` join the comm
    /// stream after everything issued before it ran: to keep every rank's order the same, a
    /// policy chains its buckets one after the other (as PowerSGD does).
    pub fn and_then<U: Send + 'static>(
        self,
        step: impl FnOnce(T) -> Result<TensorWork<U>> + Send + 'static,
    ) -> TensorWork<U> {
        let (rank, tag, timeout) = (self.work.rank(), self.work.tag().to_string(), self.timeout);
        TensorWork {
            work: self.work.and_then(move |r| {
                Ok(match r.and_then(step) {
                    Ok(next) => next.work,
                    Err(e) => TensorWork::ready(rank, &tag, timeout, Err(e)).work,
                })
            }),
            timeout,
        }
    }

    /// Waits (at most the communicator's timeout) for the value.
    pub fn wait(self) -> Result<T> {
        self.wait_timed().map(|(v, _)| v)
    }

    /// Like [`TensorWork::wait`], also returning when the first collective started and when the
    /// last continuation finished.
    pub fn wait_timed(self) -> Result<(T, OpTiming)> {
        let (r, timing) = self.work.wait_timed()?;
        Ok((r?, timing))
    }

    /// Whether the work has completed (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.work.is_completed()
    }
}
