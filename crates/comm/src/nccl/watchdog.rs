//! PyTorch's NCCL watchdog: a thread that polls every collective's completion event and the
//! communicator's asynchronous error against the timeout, and aborts the communicator on an
//! error or a timeout, so that no stream and no rank waits forever on a dead peer.

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

/// The communicator as the watchdog sees it (NCCL's `ncclComm_t`).
pub(crate) trait Abortable: Send {
    /// `Err(code)` once an asynchronous error hit the communicator.
    fn async_error(&self) -> Result<(), String>;
    /// Aborts the communicator (its queued and running kernels end).
    fn abort(&mut self);
    /// Whether it was aborted.
    fn is_aborted(&self) -> bool;
}

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
    raw: Mutex<C>,
    pending: Mutex<Vec<Pending>>,
    failure: Mutex<Option<CommError>>,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<C: Abortable + 'static> Watched<C> {
    /// Starts the watchdog thread over `raw`.
    pub(crate) fn start(raw: C, rank: usize, timeout: Duration) -> Arc<Watched<C>> {
        let watched = Self::new(raw, rank, timeout);
        let weak = Arc::downgrade(&watched);
        let _ = thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || {
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
    pub(crate) fn new(raw: C, rank: usize, timeout: Duration) -> Arc<Watched<C>> {
        Arc::new(Watched {
            rank,
            timeout,
            raw: Mutex::new(raw),
            pending: Mutex::new(Vec::new()),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
        })
    }

    /// The communicator, for enqueueing a collective (fails once it was aborted).
    pub(crate) fn raw(&self, tag: &str) -> Result<MutexGuard<'_, C>, CommError> {
        self.failed()?;
        let raw = lock(&self.raw);
        if raw.is_aborted() {
            return Err(self.error(tag, "an earlier fault".into()));
        }
        Ok(raw)
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

    /// One look: drops completed collectives; on a CUDA error, an NCCL asynchronous error or a
    /// collective past its deadline, aborts the communicator and records the failure.
    pub(crate) fn check(&self) -> Result<(), CommError> {
        self.failed()?;
        let now = Instant::now();
        let mut fault = None;
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
                if let Err(code) = lock(&self.raw).async_error() {
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
                self.fail(e.clone());
                Err(e)
            }
        }
    }

    /// Waits (polling, at most the timeout) until `done` completed, checking for faults.
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
        lock(&self.failure).get_or_insert(e);
        lock(&self.pending).clear();
        lock(&self.raw).abort();
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
    use std::sync::{Arc, Mutex};
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

    /// A communicator whose asynchronous error is set by the test; counts aborts.
    #[derive(Clone, Default)]
    struct FakeComm {
        async_error: Arc<Mutex<Option<String>>>,
        aborts: Arc<Mutex<usize>>,
    }

    impl Abortable for FakeComm {
        fn async_error(&self) -> Result<(), String> {
            match self.async_error.lock().unwrap().clone() {
                Some(code) => Err(code),
                None => Ok(()),
            }
        }
        fn abort(&mut self) {
            *self.aborts.lock().unwrap() += 1;
        }
        fn is_aborted(&self) -> bool {
            *self.aborts.lock().unwrap() > 0
        }
    }

    #[test]
    fn a_completed_collective_is_forgotten_and_nothing_is_aborted() {
        let comm = FakeComm::default();
        let w = Watched::new(comm.clone(), 1, Duration::from_secs(60));
        let done = Arc::new(Flag::default());
        w.watch("bucket0", done.clone());
        assert_eq!(w.check(), Ok(()));
        done.0.store(true, Ordering::SeqCst);
        assert_eq!(w.check(), Ok(()));
        assert!(w.pending.lock().unwrap().is_empty());
        assert_eq!(*comm.aborts.lock().unwrap(), 0);
        assert!(w.raw("bucket1").is_ok());
    }

    #[test]
    fn a_collective_past_the_timeout_aborts_the_communicator_and_names_rank_and_collective() {
        let comm = FakeComm::default();
        let w = Watched::new(comm.clone(), 3, Duration::from_millis(20));
        w.watch("bucket2", Arc::new(Flag::default()));
        std::thread::sleep(Duration::from_millis(40));
        let e = w.check().unwrap_err();
        assert_eq!(
            e,
            CommError::Timeout {
                rank: 3,
                tag: "bucket2".into(),
                after: Duration::from_millis(20)
            }
        );
        assert_eq!(*comm.aborts.lock().unwrap(), 1);
        // Every later use fails with the first error; nothing is enqueued on a dead communicator.
        assert_eq!(w.raw("bucket3").err(), Some(e.clone()));
        assert_eq!(w.check(), Err(e));
        assert_eq!(*comm.aborts.lock().unwrap(), 1, "aborted once");
    }

    #[test]
    fn an_asynchronous_nccl_error_aborts_and_names_the_collective_in_flight() {
        let comm = FakeComm::default();
        let w = Watched::new(comm.clone(), 1, Duration::from_secs(60));
        let running = Flag::default();
        w.watch("bucket5", Arc::new(Flag::default()));
        *comm.async_error.lock().unwrap() = Some("ncclRemoteError".into());
        // A host-staged collective waiting on its event gets the error, not a hang.
        let e = w.wait_event("ddp.rebuild_buckets", &running).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("rank 1") && text.contains("`bucket5`") && text.contains("ncclRemoteError"),
            "{text}"
        );
        assert_eq!(*comm.aborts.lock().unwrap(), 1);
    }

    #[test]
    fn the_watchdog_thread_finds_the_fault_without_anyone_asking() {
        let comm = FakeComm::default();
        let w = Watched::start(comm.clone(), 0, Duration::from_millis(10));
        w.watch("bucket0", Arc::new(Flag::default()));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while *comm.aborts.lock().unwrap() == 0 {
            assert!(std::time::Instant::now() < deadline, "the watchdog never aborted");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(matches!(w.failed(), Err(CommError::Timeout { rank: 0, .. })));
        w.stop();
    }
}
