//! Simulated network: makes any communicator as slow as links of latency `alpha` and bandwidth
//! `B`, while the data still moves for real. The extra wait sleeps, so compute keeps the CPU.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::{Buffer, Communicator, ReduceOp, Work};

/// Link model: every message pays `latency` (alpha) plus `bytes / bandwidth_bytes_per_s` (B).
///
/// Model time of each collective over `p` ranks (`n` = bytes of the buffer passed in, ring
/// algorithms; all zero when `p == 1`):
///
/// | collective       | model time                                   |
/// |------------------|----------------------------------------------|
/// | `all_reduce`     | `2(p-1)*alpha + 2(p-1)/p * n/B`              |
/// | `reduce_scatter` | `(p-1)*alpha + (p-1)/p * n/B`                |
/// | `all_gather`     | `(p-1)*alpha + (p-1) * n/B` (`p*n` bytes out)|
/// | `broadcast`      | `(p-1)*alpha + n/B` (pipelined chain)        |
/// | `barrier`        | `2(p-1)*alpha` (all-reduce of nothing)       |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetModel {
    /// Per-message latency (alpha).
    pub latency: Duration,
    /// Link bandwidth B in bytes per second.
    pub bandwidth_bytes_per_s: f64,
}

impl NetModel {
    fn time(&self, messages: f64, bytes: f64) -> Duration {
        self.latency.mul_f64(messages) + Duration::from_secs_f64(bytes / self.bandwidth_bytes_per_s)
    }

    /// `2(p-1)*alpha + 2(p-1)/p * n/B`.
    pub fn all_reduce_time(&self, bytes: usize, p: usize) -> Duration {
        let q = p.saturating_sub(1) as f64;
        self.time(2.0 * q, 2.0 * q / p as f64 * bytes as f64)
    }

    /// `(p-1)*alpha + (p-1)/p * n/B` for an input of `bytes`.
    pub fn reduce_scatter_time(&self, bytes: usize, p: usize) -> Duration {
        let q = p.saturating_sub(1) as f64;
        self.time(q, q / p as f64 * bytes as f64)
    }

    /// `(p-1)*alpha + (p-1) * n/B` for an input of `bytes` per rank.
    pub fn all_gather_time(&self, bytes: usize, p: usize) -> Duration {
        let q = p.saturating_sub(1) as f64;
        self.time(q, q * bytes as f64)
    }

    /// `(p-1)*alpha + n/B` (zero when `p == 1`).
    pub fn broadcast_time(&self, bytes: usize, p: usize) -> Duration {
        if p <= 1 {
            return Duration::ZERO;
        }
        self.time((p - 1) as f64, bytes as f64)
    }

    /// `2(p-1)*alpha`.
    pub fn barrier_time(&self, p: usize) -> Duration {
        self.all_reduce_time(0, p)
    }
}

type SimJob = Box<dyn FnOnce(&mut Instant) + Send>;

/// Wraps a communicator so that each collective completes its [`NetModel`] time after it
/// starts on the (simulated) link, which is when every rank has joined it and the previous
/// collective has left the link: `sim_start = max(inner finished, previous sim_finish)`,
/// `sim_finish = sim_start + model time`. Every rank of a collective therefore finishes at
/// about the same time, however early it arrived, as on a real network. The returned
/// [`Work`] reports `sim_start`/`sim_finish` as its timing. A helper thread per wrapper sleeps
/// until `sim_finish` (no spinning), so the caller's compute keeps the core.
pub struct SimulatedNetwork<C> {
    inner: C,
    model: NetModel,
    jobs: mpsc::Sender<SimJob>,
}

impl<C: Communicator> SimulatedNetwork<C> {
    /// Wraps `inner` with the link model `model`.
    pub fn new(inner: C, model: NetModel) -> Self {
        let (tx, rx) = mpsc::channel::<SimJob>();
        thread::Builder::new()
            .name(format!("sim-net-{}", inner.rank()))
            .spawn(move || {
                let mut link_free = Instant::now();
                while let Ok(job) = rx.recv() {
                    job(&mut link_free);
                }
            })
            .expect("spawn simulated network thread");
        SimulatedNetwork { inner, model, jobs: tx }
    }

    /// The link model.
    pub fn model(&self) -> NetModel {
        self.model
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// Delays `inner`'s completion to the model's finish time.
    fn delay<T: Send + 'static>(&self, inner: Work<T>, model_time: Duration) -> Work<T> {
        let (outer, promise) = Work::pending(inner.rank(), inner.tag(), self.inner.timeout());
        let job: SimJob = Box::new(move |link_free: &mut Instant| {
            // The inner backend bounds its own waits, so this returns.
            match inner.wait_timed_timeout(Duration::MAX) {
                Ok((value, timing)) => {
                    // Data can flow only once every rank has joined, and the inner op's
                    // finish is the first instant this rank knows they all have: a rank
                    // that arrived early waits for the late one, then for the link.
                    // (This counts the real transfer on top of the model's; in shared
                    // memory it is far shorter than the simulated links.)
                    let sim_start = timing.finished.max(*link_free);
                    let sim_finish = sim_start + model_time;
                    *link_free = sim_finish;
                    promise.start_at(sim_start);
                    sleep_until(sim_finish);
                    promise.complete_at(Ok(value), sim_finish);
                }
                Err(err) => promise.complete(Err(err)),
            }
        });
        // A send error drops the promise, completing `outer` with `CommError::Closed`.
        let _ = self.jobs.send(job);
        outer
    }
}

fn sleep_until(t: Instant) {
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        thread::sleep(t - now);
    }
}

impl<C: Communicator> Communicator for SimulatedNetwork<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        let t = self.model.all_reduce_time(buf.byte_len(), self.world_size());
        self.delay(self.inner.all_reduce(buf, op, tag), t)
    }

    fn broadcast(&self, buf: Buffer, root: usize, tag: &str) -> Work<Buffer> {
        let t = self.model.broadcast_time(buf.byte_len(), self.world_size());
        self.delay(self.inner.broadcast(buf, root, tag), t)
    }

    fn all_gather(&self, buf: Buffer, tag: &str) -> Work<Buffer> {
        let t = self.model.all_gather_time(buf.byte_len(), self.world_size());
        self.delay(self.inner.all_gather(buf, tag), t)
    }

    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        let t = self.model.reduce_scatter_time(buf.byte_len(), self.world_size());
        self.delay(self.inner.reduce_scatter(buf, op, tag), t)
    }

    fn barrier(&self, tag: &str) -> Work<()> {
        let t = self.model.barrier_time(self.world_size());
        self.delay(self.inner.barrier(tag), t)
    }
}
