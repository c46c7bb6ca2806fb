//! PyTorch's NCCL watchdog: a thread that polls every collective's completion event, the
//! communicator's asynchronous error and the enqueue in progress against the timeout, and
//! aborts the communicator on an error or a timeout, so that no stream and no rank waits
//! forever on a dead peer.
//!
//! The abort never waits for an enqueue: NCCL's enqueue can itself block (a peer that never
//! joins a collective's launch), and `ncclCommAbort` from another thread is how NCCL ends such
//! a call. So enqueues are serialized by a lock of their own, and the watchdog's look
//! (`check`: the asynchronous error, the events, the abort) by another; the watchdog thread
//! binds the communicator's CUDA context before it first looks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;

use crate::CommError;

/// How often the watchdog looks.
const POLL: Duration = Duration::from_millis(1);

/// What the watchdog polls for a collective's completion (a CUDA event on the comm stream).
pub(crate) trait Completion: Send + Sync {
    /// `Ok(true)` once complete, `Ok(false)` while running, `Err` on a device error.
    fn poll(&self) -> Result<bool, String>;
}

impl Completion for CudaEvent {
    fn poll(&self) -> Result<bool, String> {
        self.try_is_complete().map_err(|e| format!("CUDA error {e:?}"))
    }
}

/// The communicator as the watchdog sees it (NCCL's `ncclComm_t`). Every method takes
/// `&self`: the abort comes from the watchdog thread while another thread may be inside an
/// enqueue.
pub(crate) trait Abortable: Send + Sync {
    /// `Err(code)` once an asynchronous error hit the communicator.
    fn async_error(&self) -> Result<(), String>;
    /// Aborts the communicator (its queued and running kernels end, a blocked enqueue
    /// returns); idempotent.
    fn abort(&self);
    /// Whether it was aborted.
    fn is_aborted(&self) -> bool;
}

/// Runs once on the watchdog thread before it first looks (binds the CUDA context).
pub(crate) type OnStart = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// A collective the watchdog keeps an eye on.
struct Pending {
    tag: String,
    done: Arc<dyn Completion>,
    deadline: Instant,
}

/// State shared by the communicator and its watchdog thread.
pub(crate) struct Watched<C> {
    rank: usize,
    timeout: Duration,
    comm: C,
    /// Serializes enqueues (never taken by the watchdog).
    enqueue: Mutex<()>,
    /// The enqueue in progress: its collective and deadline.
    in_enqueue: Mutex<Option<(String, Instant)>>,
    /// One look at a time: the asynchronous error query and the abort never overlap.
    looking: Mutex<()>,
    pending: Mutex<Vec<Pending>>,
    failure: Mutex<Option<CommError>>,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<C: Abortable + 'static> Watched<C> {
    /// Starts the watchdog thread over `comm`; it runs `on_start` first (binding the CUDA
    /// context: NCCL and CUDA calls from a thread need it), and a failure there is the
    /// communicator's failure.
    pub(crate) fn start(comm: C, rank: usize, timeout: Duration, on_start: OnStart) -> Arc<Watched<C>> {
        let watched = Self::new(comm, rank, timeout);
        let weak = Arc::downgrade(&watched);
        let _ = thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || {
                if let Err(detail) = on_start() {
                    if let Some(w) = weak.upgrade() {
                        let e = w.error("(watchdog)", format!("binding the CUDA context: {detail}"));
                        w.fail(e);
                    }
                    return;
                }
                while let Some(w) = weak.upgrade() {
                    if w.stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let _ = w.check();
                    drop(w);
                    thread::sleep(POLL);
                }
            });
        watched
    }

    /// The shared state without the thread (tests poll [`Watched::check`] themselves).
    pub(crate) fn new(comm: C, rank: usize, timeout: Duration) -> Arc<Watched<C>> {
        Arc::new(Watched {
            rank,
            timeout,
            comm,
            enqueue: Mutex::new(()),
            in_enqueue: Mutex::new(None),
            looking: Mutex::new(()),
            pending: Mutex::new(Vec::new()),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
        })
    }

    /// Runs `f` (enqueueing collective `tag`) on the communicator, one enqueue at a time. The
    /// watchdog sees the enqueue and its deadline: an enqueue that blocks past the timeout is
    /// ended by aborting the communicator, and `f`'s error then names the timeout.
    pub(crate) fn enqueue<R>(&self, tag: &str, f: impl FnOnce(&C) -> Result<R, String>) -> Result<R, CommError> {
        self.failed()?;
        let _one = lock(&self.enqueue);
        if self.comm.is_aborted() {
            self.failed()?;
            return Err(self.error(tag, "the communicator was aborted".into()));
        }
        *lock(&self.in_enqueue) = Some((tag.to_string(), Instant::now() + self.timeout));
        let r = f(&self.comm);
        *lock(&self.in_enqueue) = None;
        match r {
            Ok(v) => Ok(v),
            Err(detail) => {
                // an abort (timeout, peer error) explains a failed call better than its code
                self.failed()?;
                let e = self.error(tag, detail);
                self.fail(e.clone());
                Err(e)
            }
        }
    }

    /// The first failure, if the communicator failed.
    pub(crate) fn failed(&self) -> Result<(), CommError> {
        match &*lock(&self.failure) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Watches collective `tag`, complete once `done` is.
    pub(crate) fn watch(&self, tag: &str, done: Arc<dyn Completion>) {
        lock(&self.pending).push(Pending {
            tag: tag.to_string(),
            done,
            deadline: Instant::now() + self.timeout,
        });
    }

    /// One look: drops completed collectives; on a CUDA error, an NCCL asynchronous error, a
    /// collective past its deadline or an enqueue blocked past its deadline, aborts the
    /// communicator and records the failure.
    pub(crate) fn check(&self) -> Result<(), CommError> {
        self.failed()?;
        let _one = lock(&self.looking);
        let now = Instant::now();
        let mut fault = None;
        if let Some((tag, deadline)) = &*lock(&self.in_enqueue) {
            if now > *deadline {
                fault = Some(CommError::Timeout {
                    rank: self.rank,
                    tag: format!("{tag} (blocked while being enqueued)"),
                    after: self.timeout,
                });
            }
        }
        {
            let mut pending = lock(&self.pending);
            pending.retain(|p| match p.done.poll() {
                Ok(true) => false,
                Ok(false) if now > p.deadline => {
                    fault.get_or_insert_with(|| CommError::Timeout {
                        rank: self.rank,
                        tag: p.tag.clone(),
                        after: self.timeout,
                    });
                    true
                }
                Ok(false) => true,
                Err(e) => {
                    fault.get_or_insert_with(|| self.error(&p.tag, e));
                    true
                }
            });
            if fault.is_none() {
                if let Err(code) = self.comm.async_error() {
                    let tag = pending
                        .first()
                        .map_or("(no collective in flight)".to_string(), |p| p.tag.clone());
                    fault = Some(self.error(&tag, format!("asynchronous error {code}")));
                }
            }
        }
        match fault {
            None => Ok(()),
            Some(e) => {
                self.fail_looking(e.clone());
                Err(e)
            }
        }
    }

    /// Waits (polling, at most the timeout) until `done` completed, checking for faults: a host
    /// wait on a device collective, which the device group never needs (it orders by events).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn wait_event(&self, tag: &str, done: &dyn Completion) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match done.poll() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let e = self.error(tag, e);
                    self.fail(e.clone());
                    return Err(e);
                }
            }
            self.check()?;
            if Instant::now() > deadline {
                let e = CommError::Timeout {
                    rank: self.rank,
                    tag: tag.to_string(),
                    after: self.timeout,
                };
                self.fail(e.clone());
                return Err(e);
            }
            thread::sleep(Duration::from_micros(50));
        }
    }

    /// Records the first failure and aborts the communicator.
    pub(crate) fn fail(&self, e: CommError) {
        let _one = lock(&self.looking);
        self.fail_looking(e);
    }

    /// [`Watched::fail`] with the look lock held. The abort does not take the enqueue lock:
    /// an enqueue blocked inside NCCL is exactly what it must end.
    fn fail_looking(&self, e: CommError) {
        lock(&self.failure).get_or_insert(e);
        lock(&self.pending).clear();
        self.comm.abort();
    }

    /// An NCCL error of this rank in collective `tag`.
    pub(crate) fn error(&self, tag: &str, detail: String) -> CommError {
        CommError::Nccl {
            rank: self.rank,
            tag: tag.to_string(),
            detail,
        }
    }

    /// Stops the watchdog thread (the communicator is being dropped).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc, Condvar, Mutex};
    use std::thread::{self, ThreadId};
    use std::time::Duration;

    use super::{Abortable, Completion, Watched};
    use crate::CommError;

    /// A collective that completes when told to.
    #[derive(Default)]
    struct Flag(AtomicBool);

    impl Completion for Flag {
        fn poll(&self) -> Result<bool, String> {
            Ok(self.0.load(Ordering::SeqCst))
        }
    }

    /// A communicator whose asynchronous error is set by the test; counts aborts and remembers
    /// the threads that aborted it. Its `blocking_call` blocks until it is aborted, as an NCCL
    /// enqueue waiting for a dead peer does.
    #[derive(Clone, Default)]
    struct FakeComm {
        async_error: Arc<Mutex<Option<String>>>,
        aborts: Arc<(Mutex<usize>, Condvar)>,
        abort_threads: Arc<Mutex<Vec<ThreadId>>>,
    }

    impl FakeComm {
        fn aborts(&self) -> usize {
            *self.aborts.0.lock().unwrap()
        }

        fn blocking_call(&self) -> Result<(), String> {
            let (n, cv) = &*self.aborts;
            let guard = cv
                .wait_timeout_while(n.lock().unwrap(), Duration::from_secs(30), |n| *n == 0)
                .unwrap()
                .0;
            if *guard > 0 {
                Err("ncclInvalidUsage (aborted while blocked)".into())
            } else {
                Err("never aborted".into())
            }
        }
    }

    impl Abortable for FakeComm {
        fn async_error(&self) -> Result<(), String> {
            match self.async_error.lock().unwrap().clone() {
                Some(code) => Err(code),
                None => Ok(()),
            }
        }
        fn abort(&self) {
            self.abort_threads.lock().unwrap().push(thread::current().id());
            let (n, cv) = &*self.aborts;
            *n.lock().unwrap() += 1;
            cv.notify_all();
        }
        fn is_aborted(&self) -> bool {
            self.aborts() > 0
        }
    }

    #[test]
    fn a_completed_collective_is_forgotten_and_nothing_is_aborted() {
        let comm = FakeComm::default();
        let w = Watched::new(comm.clone(), 1, Duration::from_secs(60));
        let done = Arc::new(Flag::default());
        w.watch("grad0", done.clone());
        assert_eq!(w.check(), Ok(()));
        done.0.store(true, Ordering::SeqCst);
        assert_eq!(w.check(), Ok(()));
        assert!(w.pending.lock().unwrap().is_empty());
        assert_eq!(comm.aborts(), 0);
        assert_eq!(w.enqueue("grad1", |_| Ok(7)), Ok(7));
    }

    #[test]
    fn a_collective_past_the_timeout_aborts_the_communicator_and_names_rank_and_collective() {
        let comm = FakeComm::default();
        let w = Watched::new(comm.clone(), 3, Duration::from_millis(20));
        w.watch("grad2", Arc::new(Flag::default()));
        std::thread::sleep(Duration::from_millis(40));
        let e = w.check().unwrap_err();
        assert_eq!(
            e,
            CommError::Timeout {
                rank: 3,
                tag: "grad2".into(),
                after: Duration::from_millis(20)
            }
        );
        assert_eq!(comm.aborts(), 1);
        // Every later use fails with the first error; nothing is enqueued on a dead communicator.
        assert_eq!(w.enqueue("grad3", |_| Ok(())).err(), Some(e.clone()));
        assert_eq!(w.check(), Err(e));
        assert_eq!(comm.aborts(), 1, "aborted once");
    }

    #[test]
    fn an_asynchronous_nccl_error_aborts_and_names_the_collective_in_flight() {
        let comm = FakeComm::default();
        let w = Watched::new(comm.clone(), 1, Duration::from_secs(60));
        let running = Flag::default();
        w.watch("grad5", Arc::new(Flag::default()));
        *comm.async_error.lock().unwrap() = Some("ncclRemoteError".into());
        // A host-staged collective waiting on its event gets the error, not a hang.
        let e = w.wait_event("ddp.regroup", &running).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("rank 1") && text.contains("`grad5`") && text.contains("ncclRemoteError"),
            "{text}"
        );
        assert_eq!(comm.aborts(), 1);
    }

    #[test]
    fn the_watchdog_thread_finds_the_fault_without_anyone_asking() {
        let comm = FakeComm::default();
        let w = Watched::start(comm.clone(), 0, Duration::from_millis(10), Box::new(|| Ok(())));
        w.watch("grad0", Arc::new(Flag::default()));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while comm.aborts() == 0 {
            assert!(std::time::Instant::now() < deadline, "the watchdog never aborted");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(matches!(w.failed(), Err(CommError::Timeout { rank: 0, .. })));
        w.stop();
    }

    /// An enqueue that blocks inside NCCL (a peer that never launches its half) is ended by the
    /// watchdog's abort, from the watchdog's own thread, with the context bound there first.
    /// The abort must not need a lock the blocked enqueue holds, or the two deadlock.
    #[test]
    fn the_watchdog_aborts_an_enqueue_that_blocks_from_its_own_thread_with_the_context_bound() {
        let comm = FakeComm::default();
        let bound_on = Arc::new(Mutex::new(None));
        let bind = {
            let bound_on = bound_on.clone();
            Box::new(move || {
                *bound_on.lock().unwrap() = Some(thread::current().id());
                Ok(())
            })
        };
        let w = Watched::start(comm.clone(), 2, Duration::from_millis(50), bind);
        let (tx, rx) = mpsc::channel();
        let (w2, c2) = (w.clone(), comm.clone());
        let caller = thread::spawn(move || {
            let _ = tx.send(w2.enqueue("grad7", |_| c2.blocking_call()));
        });
        let r = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the blocked enqueue was never aborted (the watchdog could not reach the communicator)");
        caller.join().unwrap();
        let e = r.unwrap_err();
        assert_eq!(
            e,
            CommError::Timeout {
                rank: 2,
                tag: "grad7 (blocked while being enqueued)".into(),
                after: Duration::from_millis(50)
            }
        );
        assert_eq!(comm.aborts(), 1);
        let watchdog = bound_on.lock().unwrap().expect("the watchdog bound the context");
        assert_eq!(
            *comm.abort_threads.lock().unwrap(),
            vec![watchdog],
            "aborted by the watchdog thread"
        );
        assert_ne!(watchdog, thread::current().id());
        w.stop();
    }

    #[test]
    fn a_watchdog_that_cannot_bind_the_context_fails_the_communicator() {
        let comm = FakeComm::default();
        let w = Watched::start(
            comm.clone(),
            4,
            Duration::from_secs(60),
            Box::new(|| Err("CUDA_ERROR_INVALID_CONTEXT".into())),
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while w.failed().is_ok() {
            assert!(std::time::Instant::now() < deadline, "no failure recorded");
            std::thread::sleep(Duration::from_millis(2));
        }
        let text = w.enqueue("grad0", |_| Ok(())).unwrap_err().to_string();
        assert!(
            text.contains("rank 4") && text.contains("CUDA_ERROR_INVALID_CONTEXT"),
            "{text}"
        );
    }
}
