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
    /// Runs the collective on a waiting thread, taken by the first wait long enough to run it.
    helper: Option<Helper>,
    /// Whether a waiter of a work chained on this one may take `helper` too (a collective on a
    /// simulated link, whose chained collectives a waiter runs as the comm thread would).
    lends_helper: bool,
    /// The completion, decided ahead of its instant, that a waiter may run (see [`Due`]).
    due: Option<Arc<Due>>,
    /// The work this one is chained on (by [`Work::then`] or [`Work::and_then`]), whose helper
    /// and due completion a waiter of this one may run.
    upstream: Option<Arc<dyn Claim>>,
    /// Wake the waiters of the works chained on this one when a due completion appears here.
    wakers: Vec<Waker>,
    /// Counts the wake-ups, so that a waiter misses none between its look and its sleep.
    generation: u64,
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

    /// Wakes this work's waiters and those of every work chained on it: something they may run
    /// appeared (a due completion, a newly chained collective).
    fn wake(&self) {
        let wakers = {
            let mut st = self.lock();
            st.generation += 1;
            st.wakers.clone()
        };
        self.done.notify_all();
        for waker in wakers {
            waker();
        }
    }
}

/// Runs the collective behind a [`Work`] on the waiting thread when it can start at once (see
/// [`crate::CommStream`]).
pub(crate) type Helper = Box<dyn Fn() + Send + Sync>;

/// Something a waiting thread runs in place of another thread: a collective's transfer, or a
/// due completion.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

type Waker = Arc<dyn Fn() + Send + Sync>;

/// A work's completion decided ahead of the instant it happens: a collective on a simulated
/// link whose slot's finish is known once its transfer finished. Its job waits until
/// [`Due::at`] and completes the work (and runs what is chained on it). The first to take it
/// runs it: a thread waiting for the work, or for a work chained on it, on its own thread (as a
/// thread rank's comm thread completes a collective and runs its continuation on the thread
/// that ran it), or else the link's timer thread at the instant.
pub(crate) struct Due {
    at: Instant,
    job: Mutex<Option<Job>>,
    taken: Condvar,
}

impl Due {
    /// When the job completes the work.
    pub(crate) fn at(&self) -> Instant {
        self.at
    }

    /// The job, to the first caller only.
    pub(crate) fn take(&self) -> Option<Job> {
        let job = self.job.lock().unwrap_or_else(|e| e.into_inner()).take();
        if job.is_some() {
            self.taken.notify_all();
        }
        job
    }

    /// Whether someone took the job.
    pub(crate) fn is_taken(&self) -> bool {
        self.job.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// Blocks until someone took the job or `until` passed; returns whether it was taken.
    pub(crate) fn wait_taken(&self, until: Instant) -> bool {
        let mut job = self.job.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let now = Instant::now();
            if job.is_none() || now >= until {
                return job.is_none();
            }
            job = self
                .taken
                .wait_timeout(job, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A work a waiter can help along: the first job it may run, its own or its upstream's.
pub(crate) trait Claim: Send + Sync {
    /// The job a waiter may run now for this work or the works it is chained on: a due
    /// completion no later than `deadline`, or (`may_run`) a collective's transfer; `chained`
    /// when asked through a work chained on this one.
    fn claim(&self, deadline: Option<Instant>, may_run: bool, chained: bool) -> Option<Job>;
}

impl<T: Send + 'static> Claim for Shared<T> {
    fn claim(&self, deadline: Option<Instant>, may_run: bool, chained: bool) -> Option<Job> {
        let mut st = self.lock();
        if st.completed {
            return None;
        }
        if let Some(job) = own_claim(&mut st, deadline, may_run, chained) {
            return Some(job);
        }
        let upstream = st.upstream.clone();
        drop(st);
        upstream?.claim(deadline, may_run, true)
    }
}

/// The job of `st` itself a waiter may run (see [`Claim::claim`]).
fn own_claim<T>(st: &mut State<T>, deadline: Option<Instant>, may_run: bool, chained: bool) -> Option<Job> {
    if let Some(due) = st.due.clone() {
        if deadline.is_none_or(|d| due.at() <= d) {
            st.due = None;
            if let Some(job) = due.take() {
                return Some(job);
            }
        }
    }
    if may_run && (!chained || st.lends_helper) {
        if let Some(helper) = st.helper.take() {
            return Some(Box::new(move || helper()));
        }
    }
    None
}

/// Handle to a collective that was issued and runs on the comm stream. `wait` hands back the
/// result (for buffer collectives, the caller's own `Vec`); it never blocks for longer than the
/// timeout. Dropping a `Work` does not cancel the collective.
pub struct Work<T> {
    shared: Arc<Shared<T>>,
    rank: usize,
    tag: String,
    timeout: Duration,
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
                helper: None,
                lends_helper: false,
                due: None,
                upstream: None,
                wakers: Vec::new(),
                generation: 0,
            }),
            done: Condvar::new(),
        });
        let work = Work {
            shared: shared.clone(),
            rank,
            tag: tag.to_string(),
            timeout,
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
    pub(crate) fn with_helper(self, helper: Helper) -> Self {
        self.shared.lock().helper = Some(helper);
        self
    }

    /// Like [`Work::with_helper`], and a waiter of a work chained on this one may run it too.
    pub(crate) fn lending_helper(self, helper: Option<Helper>) -> Self {
        let mut st = self.shared.lock();
        st.helper = helper;
        st.lends_helper = true;
        drop(st);
        self
    }

    /// The helper, taken away (a wrapper's work runs the collective instead).
    pub(crate) fn take_helper(&self) -> Option<Helper> {
        self.shared.lock().helper.take()
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
        let may_run = timeout >= self.timeout;
        loop {
            let mut st = self.shared.lock();
            if st.completed {
                let timing = OpTiming {
                    started: st.started.expect("completed work has a start"),
                    finished: st.finished.expect("completed work has a finish"),
                };
                let result = st.result.take().expect("a Work's result is taken once");
                return result.map(|value| (value, timing));
            }
            // run what this thread may run instead of waiting for another thread to
            let seen = st.generation;
            let own = own_claim(&mut st, deadline, may_run, false);
            let upstream = st.upstream.clone();
            drop(st);
            let job = own.or_else(|| upstream.and_then(|u| u.claim(deadline, may_run, true)));
            if let Some(job) = job {
                job();
                continue;
            }
            let st = self.shared.lock();
            if st.completed || st.generation != seen {
                continue;
            }
            match deadline {
                None => drop(self.shared.done.wait(st).unwrap_or_else(|e| e.into_inner())),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(CommError::Timeout {
                            rank: self.rank,
                            tag: self.tag.clone(),
                            after: timeout,
                        });
                    }
                    drop(
                        self.shared
                            .done
                            .wait_timeout(st, deadline - now)
                            .unwrap_or_else(|e| e.into_inner()),
                    );
                }
            }
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
    /// (the comm stream's; on a simulated link, the thread waiting for the chain, or the link's
    /// timer thread), so keep it short: decompress, divide, copy. The chained work keeps
    /// this one's start and tag; its finish is when `next` returned.
    pub fn then<U: Send + 'static>(self, next: impl FnOnce(T) -> Result<U, CommError> + Send + 'static) -> Work<U> {
        let (outer, promise) = Work::pending(self.rank, &self.tag, self.timeout);
        chain(&self.shared, &outer.shared);
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
        chain(&self.shared, &outer.shared);
        self.on_complete(move |result, timing| {
            promise.start_at(timing.started);
            match result.and_then(next) {
                Ok(chained) => {
                    chain(&chained.shared, &promise.shared);
                    promise.shared.wake();
                    chained.on_complete(move |result, _| promise.complete(result))
                }
                Err(e) => promise.complete(Err(e)),
            }
        });
        outer
    }

    /// Runs `f` with the result once the work completes: at once, on this thread, if it has.
    pub(crate) fn on_complete(self, f: impl FnOnce(Result<T, CommError>, OpTiming) + Send + 'static) {
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

/// Makes `outer` chained on `inner`: a waiter of `outer` may run what `inner` (or what it is
/// chained on) lets it, and is woken when something appears there.
fn chain<T: Send + 'static, U: Send + 'static>(inner: &Arc<Shared<T>>, outer: &Arc<Shared<U>>) {
    outer.lock().upstream = Some(inner.clone() as Arc<dyn Claim>);
    let downstream = Arc::downgrade(outer);
    inner.lock().wakers.push(Arc::new(move || {
        if let Some(outer) = downstream.upgrade() {
            outer.wake();
        }
    }));
}

impl<T: Send + 'static> Promise<T> {
    /// Completes the work at `at` by the job `make` builds from this promise (which sleeps
    /// until `at`, then completes it): the job goes to whoever takes the returned [`Due`] first,
    /// a waiter of this work or of a work chained on it, or the caller's timer.
    pub(crate) fn complete_due(self, at: Instant, make: impl FnOnce(Promise<T>) -> Job) -> Arc<Due> {
        let shared = self.shared.clone();
        let due = Arc::new(Due {
            at,
            job: Mutex::new(Some(make(self))),
            taken: Condvar::new(),
        });
        shared.lock().due = Some(due.clone());
        shared.wake();
        due
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
        st.due = None;
        st.helper = None;
        st.upstream = None;
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
