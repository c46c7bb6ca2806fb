//! Simulated network: makes any communicator as slow as links of latency `alpha` and bandwidth
//! `B` (the ring model of [`crate::cost`]), while the data still moves for real. The extra wait
//! sleeps, so compute keeps the CPU.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Buffer, Communicator, NetModel, ReduceOp, Work};

type SimJob = Box<dyn FnOnce(&mut LinkClock) + Send>;

/// One simulated link shared by every rank of a group: what a real ring is. Collective `k`
/// (the `k`-th collective each rank issues through its [`SimulatedNetwork`]) starts on the link
/// once every rank has joined it and the link is free, and finishes at the same instant on every
/// rank. Create one per group and hand a clone to each rank's [`SimulatedNetwork::on_link`].
///
/// Without it (plain [`SimulatedNetwork::new`]) each rank keeps its own link clock, and ranks
/// drift apart by scheduling noise: a collective can start on one rank's link while another's is
/// still busy. Ranks in other processes (MPI) cannot share an `Instant`, so they keep their own
/// clocks; the inner collective still lines them up at every call.
#[derive(Clone)]
pub struct SharedLink {
    model: NetModel,
    state: Arc<Mutex<SharedState>>,
}

struct SharedState {
    /// When the link is free again (the last slot's finish).
    free: Instant,
    /// Slots decided by the first rank to reach them and not yet read by every other rank:
    /// (collective index, start, finish, ranks still to read it).
    slots: VecDeque<(u64, Instant, Instant, usize)>,
}

impl SharedLink {
    /// A link of `model`, for every rank of one group.
    pub fn new(model: NetModel) -> SharedLink {
        SharedLink {
            model,
            state: Arc::new(Mutex::new(SharedState {
                free: Instant::now(),
                slots: VecDeque::new(),
            })),
        }
    }

    /// The link model.
    pub fn model(&self) -> NetModel {
        self.model
    }

    /// The start and finish of collective `k`, whose inner transfer finished at `joined` on the
    /// calling rank (every rank has joined by then). The first rank to ask decides the slot:
    /// `start = max(joined, link free)`, `finish = start + model_time`; the others read it.
    fn slot(&self, k: u64, joined: Instant, model_time: Duration, world: usize) -> (Instant, Instant) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = st.slots.iter().position(|s| s.0 == k) {
            let (_, start, finish, left) = &mut st.slots[i];
            let out = (*start, *finish);
            *left -= 1;
            if *left == 0 {
                st.slots.remove(i);
            }
            return out;
        }
        let start = joined.max(st.free);
        let finish = start + model_time;
        st.free = finish;
        if world > 1 {
            st.slots.push_back((k, start, finish, world - 1));
        }
        (start, finish)
    }
}

/// The link a rank's simulated collectives run on: its own, or one shared with its group.
enum LinkClock {
    Own { free: Instant },
    Shared { link: SharedLink, next: u64, world: usize },
}

impl LinkClock {
    /// Start and finish of the rank's next collective.
    fn next_slot(&mut self, joined: Instant, model_time: Duration) -> (Instant, Instant) {
        match self {
            LinkClock::Own { free } => {
                let start = joined.max(*free);
                *free = start + model_time;
                (start, *free)
            }
            LinkClock::Shared { link, next, world } => {
                let k = *next;
                *next += 1;
                link.slot(k, joined, model_time, *world)
            }
        }
    }
}

/// Wraps a communicator so that each collective completes its [`NetModel`] time after it
/// starts on the (simulated) link, which is when every rank has joined it and the previous
/// collective has left the link: `sim_start = max(inner finished, previous sim_finish)`,
/// `sim_finish = sim_start + model time`. On a [`SharedLink`] every rank of a collective gets
/// the same start and finish; on a rank's own link (`new`) they agree up to scheduling noise.
/// The returned [`Work`] reports `sim_start`/`sim_finish` as its timing. A helper thread per
/// wrapper sleeps until `sim_finish` (no spinning), so the caller's compute keeps the core.
pub struct SimulatedNetwork<C> {
    inner: C,
    model: NetModel,
    jobs: mpsc::Sender<SimJob>,
}

impl<C: Communicator> SimulatedNetwork<C> {
    /// Wraps `inner` with the link model `model`, on a link of this rank's own.
    pub fn new(inner: C, model: NetModel) -> Self {
        Self::with_clock(inner, model, LinkClock::Own { free: Instant::now() })
    }

    /// Wraps `inner` on `link`, the link every rank of the group shares (see [`SharedLink`]).
    pub fn on_link(inner: C, link: &SharedLink) -> Self {
        let world = inner.world_size();
        Self::with_clock(
            inner,
            link.model,
            LinkClock::Shared {
                link: link.clone(),
                next: 0,
                world,
            },
        )
    }

    fn with_clock(inner: C, model: NetModel, mut clock: LinkClock) -> Self {
        let (tx, rx) = mpsc::channel::<SimJob>();
        thread::Builder::new()
            .name(format!("sim-net-{}", inner.rank()))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    job(&mut clock);
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
        let job: SimJob = Box::new(move |clock: &mut LinkClock| {
            // The inner backend bounds its own waits, so this returns.
            match inner.wait_timed_timeout(Duration::MAX) {
                Ok((value, timing)) => {
                    // Data can flow only once every rank has joined, and the inner op's
                    // finish is the first instant this rank knows they all have: a rank
                    // that arrived early waits for the late one, then for the link.
                    // (This counts the real transfer on top of the model's; in shared
                    // memory it is far shorter than the simulated links.)
                    let (sim_start, sim_finish) = clock.next_slot(timing.finished, model_time);
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
