//! Work handles: the asynchronous result of a collective, and the producer side that completes it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::CommError;

/// When a collective ran on the comm stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpTiming {
    /// When the comm stream began executing it (after every earlier collective finished).
    pub started: Instant,
    /// When it completed (successfully or not).
    pub finished: Instant,
}

impl OpTiming {
    /// `finished - started`.
    pub fn duration(&self) -> Duration {
        self.finished.saturating_duration_since(self.started)
    }
}

/// What an observer registered with [`Work::observe`] is told.
#[derive(Debug, Clone, Copy)]
pub enum WorkEvent<'a> {
    /// The comm stream began executing the collective at this instant.
    Started(Instant),
    /// The collective completed at `at`; `error` is `Some` when it failed.
    Finished {
        /// Completion instant.
        at: Instant,
        /// The error, when it failed.
        error: Option<&'a CommError>,
    },
}

type Observer = Box<dyn FnMut(WorkEvent<'_>) + Send>;

/// What runs once a work completes, taking its result (see [`Work::then`]).
type Continuation<T> = Box<dyn FnOnce(Result<T, CommError>, OpTiming) + Send>;

struct State<T> {
    result: Option<Result<T, CommError>>,
    completed: bool,
    started: Option<Instant>,
    finished: Option<Instant>,
    observers: Vec<Observer>,
    continuation: Option<Continuation<T>>,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    done: Condvar,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Observers run under this lock; a panicking observer must not wedge every waiter.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs the collective behind a [`Work`] on the waiting thread when it can start at once (see
/// [`crate::CommStream`]).
pub(crate) type Helper = Box<dyn Fn() + Send + Sync>;

/// Handle to a collective that was issued and runs on the comm stream. `wait` hands back the
/// result (for buffer collectives, the caller's own `Vec`); it never blocks for longer than the
/// timeout. Dropping a `Work` does not cancel the collective.
pub struct Work<T> {
    shared: Arc<Shared<T>>,
    rank: usize,
    tag: String,
    timeout: Duration,
    helper: Option<Helper>,
}

/// Producer side of a [`Work`]: the comm stream (or a wrapper) stamps the start and completes
/// it. Dropping a `Promise` without completing it completes the work with
/// [`CommError::Closed`], so no waiter can hang on a forgotten operation.
pub struct Promise<T> {
    shared: Arc<Shared<T>>,
    rank: usize,
    tag: String,
    completed: bool,
}

impl<T> Work<T> {
    /// A pending work handle for a collective `tag` on `rank` whose `wait` uses `timeout`,
    /// with the promise that completes it. Backends and wrappers use this.
    pub fn pending(rank: usize, tag: &str, timeout: Duration) -> (Work<T>, Promise<T>) {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                result: None,
                completed: false,
                started: None,
                finished: None,
                observers: Vec::new(),
                continuation: None,
            }),
            done: Condvar::new(),
        });
        let work = Work {
            shared: shared.clone(),
            rank,
            tag: tag.to_string(),
            timeout,
            helper: None,
        };
        let promise = Promise {
            shared,
            rank,
            tag: tag.to_string(),
            completed: false,
        };
        (work, promise)
    }

    /// Lets a waiter run the collective itself with `helper` when it is next in line.
    pub(crate) fn with_helper(mut self, helper: Helper) -> Self {
        self.helper = Some(helper);
        self
    }

    /// The rank that issued the collective.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The collective's tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Whether the collective has completed (successfully or not); never blocks for long.
    pub fn is_completed(&self) -> bool {
        self.shared.lock().completed
    }

    /// When it started and finished on the comm stream, once it has completed.
    pub fn timing(&self) -> Option<OpTiming> {
        let st = self.shared.lock();
        match (st.completed, st.started, st.finished) {
            (true, Some(started), Some(finished)) => Some(OpTiming { started, finished }),
            _ => None,
        }
    }

    /// Waits, at most the communicator's timeout, and returns the result.
    pub fn wait(self) -> Result<T, CommError> {
        let timeout = self.timeout;
        self.wait_timeout(timeout)
    }

    /// Waits at most `timeout` and returns the result; [`CommError::Timeout`] after that (the
    /// collective itself goes on running on the stream).
    pub fn wait_timeout(self, timeout: Duration) -> Result<T, CommError> {
        self.wait_timed_timeout(timeout).map(|(value, _)| value)
    }

    /// Like [`Work::wait`], also returning when the collective started and finished.
    pub fn wait_timed(self) -> Result<(T, OpTiming), CommError> {
        let timeout = self.timeout;
        self.wait_timed_timeout(timeout)
    }

    /// Like [`Work::wait_timeout`], also returning when the collective started and finished.
    pub fn wait_timed_timeout(self, timeout: Duration) -> Result<(T, OpTiming), CommError> {
        let deadline = Instant::now().checked_add(timeout);
        // Running the collective here is bounded by the backend's own timeout, which is the
        // communicator's: only a wait at least that long may do it.
        if timeout >= self.timeout {
            if let Some(helper) = &self.helper {
                helper();
            }
        }
        let mut st = self.shared.lock();
        loop {
            if st.completed {
                let timing = OpTiming {
                    started: st.started.expect("completed work has a start"),
                    finished: st.finished.expect("completed work has a finish"),
                };
                let result = st.result.take().expect("a Work's result is taken once");
                return result.map(|value| (value, timing));
            }
            st = match deadline {
                None => self.shared.done.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(CommError::Timeout {
                            rank: self.rank,
                            tag: self.tag.clone(),
                            after: timeout,
                        });
                    }
                    self.shared
                        .done
                        .wait_timeout(st, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Registers `observer` to be told when the collective starts and finishes on the comm
    /// stream, without anyone calling `wait`. Events that already happened are replayed at once,
    /// in order. Observers run on the comm stream's thread under the handle's lock: keep them
    /// short and do not touch this `Work` from inside.
    pub fn observe(&self, mut observer: impl FnMut(WorkEvent<'_>) + Send + 'static) {
        let mut st = self.shared.lock();
        if let Some(started) = st.started {
            observer(WorkEvent::Started(started));
        }
        if st.completed {
            let at = st.finished.expect("completed work has a finish");
            let error = st.result.as_ref().and_then(|r| r.as_ref().err());
            observer(WorkEvent::Finished { at, error });
            return;
        }
        st.observers.push(Box::new(observer));
    }
}

impl<T: Send + 'static> Work<T> {
    /// Chains `next` after this work without blocking the caller (PyTorch's
    /// `torch.futures.Future.then`): the returned work completes with `next(value)` once this one
    /// succeeded, or with this one's error. `next` runs on the thread that completes this work
    /// (the comm stream's), so keep it short: decompress, divide, copy. The chained work keeps
    /// this one's start and tag; its finish is when `next` returned.
    pub fn then<U: Send + 'static>(self, next: impl FnOnce(T) -> Result<U, CommError> + Send + 'static) -> Work<U> {
        let (outer, promise) = Work::pending(self.rank, &self.tag, self.timeout);
        self.on_complete(move |result, timing| {
            promise.start_at(timing.started);
            promise.complete(result.and_then(next));
        });
        outer
    }

    /// Chains a second collective after this one (`torch.futures.Future.then` returning a
    /// future): once this work succeeded, `next(value)` issues the next collective, and the
    /// returned work completes with that one's result (or with the first error). `next` runs on
    /// the thread that completes this work. Collectives issued by `next` join the comm stream
    /// after everything issued before it: to keep the same order on every rank, issue nothing
    /// else meanwhile that could interleave.
    pub fn and_then<U: Send + 'static>(
        self,
        next: impl FnOnce(T) -> Result<Work<U>, CommError> + Send + 'static,
    ) -> Work<U> {
        let (outer, promise) = Work::pending(self.rank, &self.tag, self.timeout);
        self.on_complete(move |result, timing| {
            promise.start_at(timing.started);
            match result.and_then(next) {
                Ok(chained) => chained.on_complete(move |result, _| promise.complete(result)),
                Err(e) => promise.complete(Err(e)),
            }
        });
        outer
    }

    /// Runs `f` with the result once the work completes: at once, on this thread, if it has.
    fn on_complete(self, f: impl FnOnce(Result<T, CommError>, OpTiming) + Send + 'static) {
        let mut st = self.shared.lock();
        if st.completed {
            let timing = OpTiming {
                started: st.started.expect("completed work has a start"),
                finished: st.finished.expect("completed work has a finish"),
            };
            let result = st.result.take().expect("a Work's result is taken once");
            drop(st);
            f(result, timing);
        } else {
            st.continuation = Some(Box::new(f));
        }
    }
}

impl<T> Promise<T> {
    /// Stamps the start now (the comm stream began executing the collective).
    pub fn start(&self) {
        self.start_at(Instant::now());
    }

    /// Stamps the start at `at` (wrappers that model a later start, e.g. a simulated link).
    /// Only the first call counts.
    pub fn start_at(&self, at: Instant) {
        let mut st = self.shared.lock();
        if st.started.is_some() {
            return;
        }
        st.started = Some(at);
        for observer in st.observers.iter_mut() {
            observer(WorkEvent::Started(at));
        }
    }

    /// Completes the work now with `result`, waking every waiter.
    pub fn complete(mut self, result: Result<T, CommError>) {
        self.finish(result, Instant::now());
    }

    /// Completes the work with `result`, stamping `at` as its finish (wrappers that model the
    /// finish, e.g. a simulated link; `at` should not be in the future).
    pub fn complete_at(mut self, result: Result<T, CommError>, at: Instant) {
        self.finish(result, at);
    }

    fn finish(&mut self, result: Result<T, CommError>, now: Instant) {
        self.completed = true;
        let mut st = self.shared.lock();
        let started = match st.started {
            Some(started) => started,
            None => {
                st.started = Some(now);
                for observer in st.observers.iter_mut() {
                    observer(WorkEvent::Started(now));
                }
                now
            }
        };
        let mut observers = std::mem::take(&mut st.observers);
        st.finished = Some(now.max(started));
        st.result = Some(result);
        st.completed = true;
        let at = st.finished.unwrap();
        let error = st.result.as_ref().and_then(|r| r.as_ref().err());
        for observer in observers.iter_mut() {
            observer(WorkEvent::Finished { at, error });
        }
        let continuation = st.continuation.take();
        let chained = continuation.map(|c| {
            let timing = OpTiming { started, finished: at };
            (c, st.result.take().expect("the result was just stored"), timing)
        });
        drop(st);
        self.shared.done.notify_all();
        // The continuation owns the result now; it runs outside the lock, on this thread.
        if let Some((c, result, timing)) = chained {
            c(result, timing);
        }
    }
}

impl<T> Drop for Promise<T> {
    fn drop(&mut self) {
        if !self.completed {
            let err = CommError::Closed {
                rank: self.rank,
                tag: self.tag.clone(),
            };
            self.finish(Err(err), Instant::now());
        }
    }
}
