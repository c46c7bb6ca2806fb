//! PyTorch's NCCL watchdog: a thread that polls every collective's completion event and the
//! communicator's asynchronous error against the timeout, and aborts the communicator on an
//! error or a timeout, so that no stream and no rank waits forever on a dead peer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;

use super::raw::RawComm;
use crate::CommError;

/// How often the watchdog looks.
const POLL: Duration = Duration::from_millis(1);

/// A collective the watchdog keeps an eye on.
struct Pending {
    tag: String,
    done: Arc<CudaEvent>,
    deadline: Instant,
}

/// State shared by the communicator and its watchdog thread.
pub(crate) struct Watched {
    rank: usize,
    timeout: Duration,
    raw: Mutex<RawComm>,
    pending: Mutex<Vec<Pending>>,
    failure: Mutex<Option<CommError>>,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Watched {
    /// Starts the watchdog thread over `raw`.
    pub(crate) fn start(raw: RawComm, rank: usize, timeout: Duration) -> Arc<Watched> {
        let watched = Arc::new(Watched {
            rank,
            timeout,
            raw: Mutex::new(raw),
            pending: Mutex::new(Vec::new()),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
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

    /// The communicator, for enqueueing a collective (fails once it was aborted).
    pub(crate) fn raw(&self, tag: &str) -> Result<MutexGuard<'_, RawComm>, CommError> {
        self.failed()?;
        let raw = lock(&self.raw);
        if raw.is_aborted() {
            return Err(self.error(tag, "the communicator was aborted".into()));
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
    pub(crate) fn watch(&self, tag: &str, done: Arc<CudaEvent>) {
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
            pending.retain(|p| match p.done.try_is_complete() {
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
                    fault.get_or_insert_with(|| self.error(&p.tag, format!("CUDA error {e:?}")));
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
    pub(crate) fn wait_event(&self, tag: &str, done: &CudaEvent) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let e = self.error(tag, format!("CUDA error {e:?}"));
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
