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
/// once every rank has issued it and the link is free, and finishes at the same instant on every
/// rank. The slot counts from the instant the last rank's comm thread took the collective up
/// (its hand-over to the link, as a network's transfer starts when the backend hands it to the
/// wire), and the data's real transfer in memory runs inside it: copying and summing on a busy
/// core delays its waiter only where it outlasts the slot, and never the link's later slots. Create one per group and hand it to each rank's [`crate::CommStream::on_link`].
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
    /// Collectives taken up by some rank and not yet read by every rank, oldest first.
    slots: VecDeque<Slot>,
}

/// Collective `k` on the shared link.
struct Slot {
    k: u64,
    /// The latest instant a rank's comm thread took it up, of the ranks that have.
    entered: Instant,
    /// Start and finish, decided by the first rank whose transfer finished.
    decided: Option<(Instant, Instant)>,
    /// Ranks that have read the decision (the decider included).
    read: usize,
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

    /// Collective `k` taken up by one rank's comm thread at `at`, as its transfer begins: a
    /// collective's transfer finishes on no rank before every rank has begun it, so by then
    /// every rank's instant is known.
    fn enter(&self, k: u64, at: Instant) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match st.slots.iter_mut().find(|s| s.k == k) {
            Some(slot) => slot.entered = slot.entered.max(at),
            None => st.slots.push_back(Slot {
                k,
                entered: at,
                decided: None,
                read: 0,
            }),
        }
    }

    /// The start and finish of collective `k`, whose inner transfer finished at `joined` on the
    /// calling rank. The first rank to ask decides the slot: `start = max(last rank's entry, link
    /// free)`, `finish = start + model_time`; the others read it. (The work completes once its
    /// data has moved too: a transfer that outlasts its slot delays the waiter, not the link.)
    fn slot(&self, k: u64, joined: Instant, model_time: Duration, world: usize) -> (Instant, Instant) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let i = match st.slots.iter().position(|s| s.k == k) {
            Some(i) => i,
            None => {
                // no rank's entry recorded (a transport that finished without every rank, as a
                // broadcast's root may): the transfer's finish is the instant this rank knows of
                st.slots.push_back(Slot {
                    k,
                    entered: joined,
                    decided: None,
                    read: 0,
                });
                st.slots.len() - 1
            }
        };
        let free = st.free;
        let slot = &mut st.slots[i];
        let (start, finish) = match slot.decided {
            Some(decided) => decided,
            None => {
                let start = slot.entered.max(free);
                let decided = (start, start + model_time);
                slot.decided = Some(decided);
                decided
            }
        };
        slot.read += 1;
        if slot.read >= world {
            st.slots.remove(i);
        }
        st.free = st.free.max(finish);
        (start, finish)
    }
}

/// The link a rank's simulated collectives run on: its own, or one shared with its group.
enum LinkClock {
    Own { free: Instant },
    Shared { link: SharedLink, next: u64, world: usize },
}

/// A collective's place on the link, taken when it is issued (in issue order, as every rank
/// issues them), whose [`Ticket::enter`] the comm thread calls as it takes the collective up.
pub(crate) struct Ticket {
    /// Its index among the rank's collectives on a shared link.
    k: u64,
    shared: Option<SharedLink>,
}

impl Ticket {
    /// The rank's comm thread takes the collective up now: its transfer begins.
    pub(crate) fn enter(&self) {
        if let Some(link) = &self.shared {
            link.enter(self.k, Instant::now());
        }
    }
}

impl LinkClock {
    /// The rank's next collective, issued now.
    fn ticket(&mut self) -> Ticket {
        match self {
            LinkClock::Own { .. } => Ticket { k: 0, shared: None },
            LinkClock::Shared { link, next, .. } => {
                let k = *next;
                *next += 1;
                Ticket {
                    k,
                    shared: Some(link.clone()),
                }
            }
        }
    }

    /// Start and finish of the collective of `ticket`, whose transfer finished at `joined`.
    /// On a rank's own link the transfer's finish is the first instant this rank knows every
    /// rank has joined (ranks in other processes share no clock): `start = max(joined, free)`.
    fn slot(&mut self, ticket: &Ticket, joined: Instant, model_time: Duration) -> (Instant, Instant) {
        match self {
            LinkClock::Own { free } => {
                let start = joined.max(*free);
                *free = start + model_time;
                (start, *free)
            }
            LinkClock::Shared { link, world, .. } => link.slot(ticket.k, joined, model_time, *world),
        }
    }
}

/// A simulated stream's delay stage: each collective's work, completed by the transport, is
/// completed again at its modelled finish on the link (the slot of [`SharedLink`] or of a
/// rank's own link), by a helper thread that sleeps until then while the stream goes on; the delayed work reports `sim_start`/`sim_finish` as
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

    /// A place on the link for the collective the caller issues now; the comm thread that runs
    /// its transfer calls [`Ticket::enter`] as it begins.
    pub(crate) fn ticket(&self) -> Ticket {
        lock(&self.clock).ticket()
    }

    /// The link's part of a blocking collective `kind` on `bytes` bytes, issued with `ticket`,
    /// whose transfer the caller just ran (`transferred`), while the link was [`LinkStage::idle`]: it takes its slot
    /// as the helper thread would and returns at the slot's finish, on the caller's thread: no
    /// helper thread wakes, and the caller wakes on its own at the modelled finish (a hand-over
    /// from the helper costs a wake-up, which on shared cores is often longer than the link).
    pub(crate) fn hold<T>(
        &self,
        ticket: Ticket,
        kind: RingOp,
        bytes: usize,
        transferred: Result<T, CommError>,
    ) -> Result<T, CommError> {
        let value = transferred?;
        let model_time = self.model.time(kind, bytes, self.world);
        let (_, finish) = lock(&self.clock).slot(&ticket, Instant::now(), model_time);
        sleep_until(finish);
        Ok(value)
    }

    /// The link model.
    pub(crate) fn model(&self) -> NetModel {
        self.model
    }

    /// `inner` (collective `kind` on `bytes` bytes, issued with `ticket`) completed at its
    /// modelled finish.
    pub(crate) fn delay<T: Send + 'static>(
        &self,
        ticket: Arc<Ticket>,
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
                    // A rank that came early waits for the late one, then for the link.
                    let (sim_start, sim_finish) = lock(&clock).slot(&ticket, timing.finished, model_time);
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
