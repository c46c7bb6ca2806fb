//! Simulated network: makes a comm stream as slow as links of latency `alpha` and bandwidth `B`
//! (the ring model of [`crate::cost`]), while the data still moves for real
//! ([`crate::CommStream::simulated`], [`crate::CommStream::on_link`]). The extra wait sleeps, so
//! compute keeps the CPU, but for its last 100 us, where it yields the core until the modelled
//! finish: a sleep alone ends late by the timer's slack and the wake-up.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::{CommError, NetModel, RingOp, Work};

type SimJob = Box<dyn FnOnce() + Send>;

/// One simulated link shared by every rank of a group: what a real ring is. Collective `k`
/// (the `k`-th collective each rank issues through its simulated stream) starts on the link
/// once every rank has joined it and the link is free, and finishes at the same instant on every
/// rank. Create one per group and hand it to each rank's [`crate::CommStream::on_link`].
///
/// Without it ([`crate::CommStream::simulated`]) each rank keeps its own link clock, and ranks
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

/// A simulated stream's delay stage: each collective's work, completed by the transport, is
/// completed again at its modelled finish on the link, `sim_start = max(transfer finished,
/// previous sim_finish)`, `sim_finish = sim_start + model time`, by a helper thread that sleeps
/// until then while the stream goes on; the delayed work reports `sim_start`/`sim_finish` as
/// its timing. A blocking collective issued while nothing is in flight runs on the caller
/// instead ([`LinkStage::hold`]), as on a stream without a link.
pub(crate) struct LinkStage {
    model: NetModel,
    world: usize,
    jobs: mpsc::Sender<SimJob>,
    clock: Arc<Mutex<LinkClock>>,
    /// Collectives handed to the helper thread and not yet completed.
    in_flight: Arc<AtomicUsize>,
}

/// Counts a collective in flight on the link until dropped (completed, or never sent).
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl LinkStage {
    /// A stage on a link of rank `rank`'s own.
    pub(crate) fn own(model: NetModel, rank: usize, world: usize) -> Self {
        Self::with_clock(model, rank, world, LinkClock::Own { free: Instant::now() })
    }

    /// A stage on `link`, shared by the `world` ranks of the group.
    pub(crate) fn shared(link: &SharedLink, rank: usize, world: usize) -> Self {
        let clock = LinkClock::Shared {
            link: link.clone(),
            next: 0,
            world,
        };
        Self::with_clock(link.model, rank, world, clock)
    }

    fn with_clock(model: NetModel, rank: usize, world: usize, clock: LinkClock) -> Self {
        let (tx, rx) = mpsc::channel::<SimJob>();
        thread::Builder::new()
            .name(format!("sim-net-{rank}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    job();
                }
            })
            .expect("spawn simulated network thread");
        LinkStage {
            model,
            world,
            jobs: tx,
            clock: Arc::new(Mutex::new(clock)),
            in_flight: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Whether no collective is in flight on the link (each has taken its slot and completed).
    pub(crate) fn idle(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
    }

    /// The link's part of a blocking collective `kind` on `bytes` bytes whose transfer the
    /// caller just ran (`transferred`), while the link was [`LinkStage::idle`]: it takes its slot
    /// as the helper thread would and returns at the slot's finish, on the caller's thread: no
    /// helper thread wakes, and the caller wakes on its own at the modelled finish (a hand-over
    /// from the helper costs a wake-up, which on shared cores is often longer than the link).
    pub(crate) fn hold<T>(
        &self,
        kind: RingOp,
        bytes: usize,
        transferred: Result<T, CommError>,
    ) -> Result<T, CommError> {
        let value = transferred?;
        let model_time = self.model.time(kind, bytes, self.world);
        let (_, finish) = lock(&self.clock).next_slot(Instant::now(), model_time);
        sleep_until(finish);
        Ok(value)
    }

    /// The link model.
    pub(crate) fn model(&self) -> NetModel {
        self.model
    }

    /// `inner` (collective `kind` on `bytes` bytes) completed at its modelled finish.
    pub(crate) fn delay<T: Send + 'static>(
        &self,
        inner: Work<T>,
        kind: RingOp,
        bytes: usize,
        timeout: Duration,
    ) -> Work<T> {
        let model_time = self.model.time(kind, bytes, self.world);
        let (outer, promise) = Work::pending(inner.rank(), inner.tag(), timeout);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let counted = InFlight(self.in_flight.clone());
        let clock = self.clock.clone();
        let job: SimJob = Box::new(move || {
            // The transport bounds its own waits, so this returns.
            match inner.wait_timed_timeout(Duration::MAX) {
                Ok((value, timing)) => {
                    // Data can flow only once every rank has joined, and the transfer's
                    // finish is the first instant this rank knows they all have: a rank
                    // that arrived early waits for the late one, then for the link.
                    // (This counts the real transfer on top of the model's; in shared
                    // memory it is far shorter than the simulated links.)
                    let (sim_start, sim_finish) = lock(&clock).next_slot(timing.finished, model_time);
                    promise.start_at(sim_start);
                    sleep_until(sim_finish);
                    // off the link before the waiter wakes: its next blocking collective may
                    // take the link on its own thread
                    drop(counted);
                    promise.complete_at(Ok(value), sim_finish);
                }
                Err(err) => {
                    drop(counted);
                    promise.complete(Err(err))
                }
            }
        });
        // A send error drops the promise, completing `outer` with `CommError::Closed`.
        let _ = self.jobs.send(job);
        outer
    }
}

/// How much of a wait [`sleep_until`] spins rather than sleeps: a sleep wakes late by the
/// kernel's timer slack and the thread's wake-up (50 us and more), which every collective on the
/// link would add to the time its model states.
const SPIN_TAIL: Duration = Duration::from_micros(100);

/// Returns at `t`: sleeps until `SPIN_TAIL` before it, then yields the core until `t` (another
/// runnable thread, a rank's compute, runs meanwhile).
fn lock(clock: &Mutex<LinkClock>) -> std::sync::MutexGuard<'_, LinkClock> {
    clock.lock().unwrap_or_else(|e| e.into_inner())
}

fn sleep_until(t: Instant) {
    loop {
        let now = Instant::now();
        if now + SPIN_TAIL >= t {
            break;
        }
        thread::sleep(t - SPIN_TAIL - now);
    }
    while Instant::now() < t {
        thread::yield_now();
    }
}
