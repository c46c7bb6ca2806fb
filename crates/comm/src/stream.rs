//! The comm stream: a per-rank worker thread that runs collectives in issue order over a
//! synchronous [`Transport`], completing their [`Work`] handles.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use crate::error::panic_message;
use crate::{Buffer, CommError, Communicator, ReduceOp, Work};

/// A synchronous, blocking per-rank backend: each call performs one collective with the peers
/// and returns when this rank's part is done. A backend implements only this; [`CommStream`]
/// turns it into an asynchronous, ordered [`Communicator`]. Calls arrive in issue order from a
/// single thread, the stream's worker.
///
/// Implementations must not block forever: every internal wait is bounded by the timeout and
/// fails when a peer is known to be gone.
pub trait Transport: Send + 'static {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// In-place all-reduce (see [`Communicator::all_reduce`]).
    fn all_reduce(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError>;
    /// In-place broadcast from `root`.
    fn broadcast(&mut self, buf: &mut Buffer, root: usize, tag: &str) -> Result<(), CommError>;
    /// All-gather: on success `buf` holds `world_size * len` elements, rank-major.
    fn all_gather(&mut self, buf: &mut Buffer, tag: &str) -> Result<(), CommError>;
    /// Reduce-scatter: on success `buf` holds this rank's chunk of the reduction.
    fn reduce_scatter(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError>;
    /// Barrier over all ranks.
    fn barrier(&mut self, tag: &str) -> Result<(), CommError>;
    /// Called once when the stream shuts down (its communicator was dropped), after every
    /// queued collective ran; `reason` says why, for the peers' error messages.
    fn close(&mut self, reason: &str) {
        let _ = reason;
    }
}

type Job<T> = Box<dyn FnOnce(&mut T) + Send>;

/// A [`Communicator`] made of a [`Transport`] driven by a worker thread (the comm stream).
/// Issuing a collective moves its buffer into a FIFO and returns at once; the worker executes
/// collectives strictly in issue order, stamps when each started and finished, and completes
/// its [`Work`], handing the same buffer back.
///
/// Dropping the stream lets the worker finish what was queued, then closes the transport (for
/// the thread backend, peers then fail promptly with [`CommError::RankFailed`]).
pub struct CommStream<T: Transport> {
    jobs: Option<mpsc::Sender<Job<T>>>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

impl<T: Transport> CommStream<T> {
    /// Starts the worker thread that owns `transport`; `timeout` bounds [`Work::wait`].
    pub fn new(transport: T, timeout: Duration) -> Self {
        let rank = transport.rank();
        let world_size = transport.world_size();
        let (tx, rx) = mpsc::channel::<Job<T>>();
        thread::Builder::new()
            .name(format!("comm-stream-{rank}"))
            .spawn(move || {
                let mut transport = transport;
                while let Ok(job) = rx.recv() {
                    job(&mut transport);
                }
            })
            .expect("spawn comm stream thread");
        CommStream {
            jobs: Some(tx),
            rank,
            world_size,
            timeout,
        }
    }

    /// Queues `op` on the stream and returns its work handle.
    fn submit<R: Send + 'static>(
        &self,
        tag: &str,
        op: impl FnOnce(&mut T, &str) -> Result<R, CommError> + Send + 'static,
    ) -> Work<R> {
        let (work, promise) = Work::pending(self.rank, tag, self.timeout);
        let tag = tag.to_string();
        let job: Job<T> = Box::new(move |transport: &mut T| {
            promise.start();
            let result = catch_unwind(AssertUnwindSafe(|| op(transport, &tag))).unwrap_or_else(|payload| {
                Err(CommError::Internal(format!(
                    "backend panicked in collective `{tag}`: {}",
                    panic_message(payload.as_ref())
                )))
            });
            promise.complete(result);
        });
        // A send error drops the job, and with it the promise, which completes the work with
        // `CommError::Closed`.
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
        work
    }
}

impl<T: Transport> Drop for CommStream<T> {
    fn drop(&mut self) {
        let reason = if thread::panicking() {
            format!("rank {}'s thread panicked while holding its communicator", self.rank)
        } else {
            format!("rank {} dropped its communicator", self.rank)
        };
        if let Some(jobs) = self.jobs.take() {
            let _ = jobs.send(Box::new(move |transport: &mut T| transport.close(&reason)));
        }
    }
}

impl<T: Transport> Communicator for CommStream<T> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        self.submit(tag, move |t, tag| {
            let mut buf = buf;
            t.all_reduce(&mut buf, op, tag).map(|()| buf)
        })
    }

    fn broadcast(&self, buf: Buffer, root: usize, tag: &str) -> Work<Buffer> {
        self.submit(tag, move |t, tag| {
            let mut buf = buf;
            t.broadcast(&mut buf, root, tag).map(|()| buf)
        })
    }

    fn all_gather(&self, buf: Buffer, tag: &str) -> Work<Buffer> {
        self.submit(tag, move |t, tag| {
            let mut buf = buf;
            t.all_gather(&mut buf, tag).map(|()| buf)
        })
    }

    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        self.submit(tag, move |t, tag| {
            let mut buf = buf;
            t.reduce_scatter(&mut buf, op, tag).map(|()| buf)
        })
    }

    fn barrier(&self, tag: &str) -> Work<()> {
        self.submit(tag, move |t, tag| t.barrier(tag))
    }
}
