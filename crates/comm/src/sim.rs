//! Simulated network: makes a comm stream as slow as links of latency `alpha` and bandwidth `B`
//! (the ring model of [`crate::cost`]), while the data still moves for real
//! ([`crate::CommStream::simulated`], [`crate::CommStream::on_link`]). The extra wait sleeps, so
//! compute keeps the CPU, but for its last 100 us, where it yields the core until the modelled
//! finish: a sleep alone ends late by the timer's slack and the wake-up. A blocking collective
//! that holds the idle link on its caller ([`LinkStage::hold`]) yields for its last 2 ms, so one
//! of a few link latencies (the ranks' agreement on each step's loss) never sleeps.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use crate::work::Due;
use crate::{CommError, NetModel, OpTiming, RingOp, Work};

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
    /// Its place in the order the stage completes its collectives in (see [`Turns`]).
    turn: u64,
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
            LinkClock::Own { .. } => Ticket {
                k: 0,
                shared: None,
                turn: 0,
            },
            LinkClock::Shared { link, next, .. } => {
                let k = *next;
                *next += 1;
                Ticket {
                    k,
                    shared: Some(link.clone()),
                    turn: 0,
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
/// rank's own link), and reports `sim_start`/`sim_finish` as its timing. The slot is decided on
/// the thread that ran the transfer, as it finishes; the completion at the slot's finish (with
/// whatever is chained on the work) runs on the thread that waits for the work, or for a work
/// chained on it, which sleeps until then on its own, as a thread rank's waiter is woken by the
/// comm thread that finished; with no such waiter, the link's timer thread runs it at the
/// finish while the stream goes on. Either way the stage's collectives complete in issue order,
/// as one comm thread completes them ([`Turns`]). A blocking collective issued while nothing is
/// in flight runs on the caller instead ([`LinkStage::hold`]), as on a stream without a link.
pub(crate) struct LinkStage {
    model: NetModel,
    world: usize,
    timer: mpsc::Sender<Arc<Due>>,
    clock: Arc<Mutex<LinkClock>>,
    turns: Arc<Turns>,
    /// Collectives issued on the link and not yet completed.
    in_flight: Arc<AtomicUsize>,
}

/// The order a stage completes its collectives in: the order they were issued, as a stream's
/// comm thread completes one after another. Each collective holds a turn from its issue until
/// its completion (with what is chained on it) has run. Whoever runs a collective's completion,
/// a waiter or the timer, first completes every earlier collective still pending: on its own
/// thread where that one's completion is decided and not yet taken (its slot finishes no later,
/// so the sleep to it is no longer), else it waits for the thread that took it, or for its
/// transfer to finish, at most the stream's timeout. A failed collective completes at once, on
/// the thread that ran its transfer, and ends its turn.
struct Turns {
    state: Mutex<TurnState>,
    /// Signalled when a turn ends or its completion is decided.
    changed: Condvar,
}

struct TurnState {
    /// The turn the next collective issued gets.
    next: u64,
    /// The collectives issued and not yet completed, oldest first.
    pending: VecDeque<Pending>,
}

/// A collective issued on the stage and not yet completed.
struct Pending {
    turn: u64,
    /// Its completion, once its slot is decided.
    due: Option<Arc<Due>>,
    /// The thread running its completion, once one does.
    runner: Option<ThreadId>,
}

impl Turns {
    fn new() -> Self {
        Turns {
            state: Mutex::new(TurnState {
                next: 0,
                pending: VecDeque::new(),
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TurnState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next turn, for a collective issued now.
    fn take(&self) -> u64 {
        let mut st = self.lock();
        let turn = st.next;
        st.next += 1;
        st.pending.push_back(Pending {
            turn,
            due: None,
            runner: None,
        });
        turn
    }

    /// The completion of `turn`'s collective is decided: `due`.
    fn decided(&self, turn: u64, due: Arc<Due>) {
        let mut st = self.lock();
        if let Some(p) = st.pending.iter_mut().find(|p| p.turn == turn) {
            p.due = Some(due);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// The calling thread runs `turn`'s completion now: first every earlier turn's, each
    /// taken if it is not yet, or waited for until `deadline` if another thread runs it or its
    /// transfer has not finished. Turns the calling thread is running further up its stack
    /// (a continuation that waits for a later collective) are not waited for.
    fn run_after_earlier(&self, turn: u64, deadline: Instant) {
        let me = thread::current().id();
        let mut st = self.lock();
        if let Some(p) = st.pending.iter_mut().find(|p| p.turn == turn) {
            p.runner = Some(me);
        }
        loop {
            let earlier = st
                .pending
                .iter()
                .take_while(|p| p.turn < turn)
                .find(|p| p.runner != Some(me));
            let Some(earlier) = earlier else { return };
            if let Some(due) = earlier.due.clone().filter(|d| !d.is_taken()) {
                drop(st);
                if let Some(job) = due.take() {
                    job();
                }
                st = self.lock();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// `turn`'s collective completed (or failed, or was never sent).
    fn end(&self, turn: u64) {
        let mut st = self.lock();
        st.pending.retain(|p| p.turn != turn);
        drop(st);
        self.changed.notify_all();
    }
}

/// A collective's turn, ended when dropped: once its completion has run, or when it failed.
struct Turn {
    turns: Arc<Turns>,
    turn: u64,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.turns.end(self.turn);
    }
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
        let (tx, rx) = mpsc::channel::<Arc<Due>>();
        thread::Builder::new()
            .name(format!("sim-net-{rank}"))
            .spawn(move || {
                while let Ok(due) = rx.recv() {
                    complete_unclaimed(&due);
                }
            })
            .expect("spawn simulated network thread");
        Self::with_timer(model, world, clock, tx)
    }

    /// A stage whose due completions go to `timer` when no waiter takes them.
    fn with_timer(model: NetModel, world: usize, clock: LinkClock, timer: mpsc::Sender<Arc<Due>>) -> Self {
        LinkStage {
            model,
            world,
            timer,
            clock: Arc::new(Mutex::new(clock)),
            turns: Arc::new(Turns::new()),
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
        let mut clock = lock(&self.clock);
        let mut ticket = clock.ticket();
        // under the clock's lock: the turns follow the link's order
        ticket.turn = self.turns.take();
        ticket
    }

    /// The turn of `ticket`, ended when dropped.
    fn turn(&self, ticket: &Ticket) -> Turn {
        Turn {
            turns: self.turns.clone(),
            turn: ticket.turn,
        }
    }

    /// The link's part of a blocking collective `kind` on `bytes` bytes, issued with `ticket`,
    /// whose transfer the caller just ran (`transferred`), while the link was [`LinkStage::idle`]: it takes its slot
    /// as [`LinkStage::delay`] would and returns at the slot's finish, on the caller's thread,
    /// with the slot (the same instants on every rank of a [`SharedLink`]).
    pub(crate) fn hold<T>(
        &self,
        ticket: Ticket,
        kind: RingOp,
        bytes: usize,
        transferred: Result<T, CommError>,
    ) -> Result<(T, OpTiming), CommError> {
        let _turn = self.turn(&ticket);
        let value = transferred?;
        let model_time = self.model.time(kind, bytes, self.world);
        let (started, finished) = lock(&self.clock).slot(&ticket, Instant::now(), model_time);
        sleep_until(finished, HOLD_MARGIN);
        Ok((value, OpTiming { started, finished }))
    }

    /// The link model.
    pub(crate) fn model(&self) -> NetModel {
        self.model
    }

    /// `inner` (collective `kind` on `bytes` bytes, issued with `ticket`) completed at its
    /// modelled finish. A waiter of the returned work (or of one chained on it) may run the
    /// transfer, as it may on a stream without a link, and the completion at the finish.
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
        let outer = outer.lending_helper(inner.take_helper());
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let counted = InFlight(self.in_flight.clone());
        let turn = self.turn(&ticket);
        let turns = self.turns.clone();
        let clock = self.clock.clone();
        let timer = self.timer.clone();
        // on the thread that ran the transfer, as it finishes
        inner.on_complete(move |result, timing| match result {
            Ok(value) => {
                // A rank that came early waits for the late one, then for the link.
                let (sim_start, sim_finish) = lock(&clock).slot(&ticket, timing.finished, model_time);
                promise.start_at(sim_start);
                let number = turn.turn;
                let due = promise.complete_due(sim_finish, move |promise| {
                    Box::new(move || {
                        turn.turns.run_after_earlier(turn.turn, Instant::now() + timeout);
                        sleep_until(sim_finish, YIELD_TAIL);
                        // off the link before the waiter goes on: its next blocking collective
                        // may take the link on its own thread
                        drop(counted);
                        promise.complete_at(Ok(value), sim_finish);
                        drop(turn);
                    })
                });
                turns.decided(number, due.clone());
                if let Err(unsent) = timer.send(due) {
                    // no timer thread (it panicked): complete it here
                    if let Some(job) = unsent.0.take() {
                        job();
                    }
                }
            }
            Err(err) => {
                drop(counted);
                drop(turn);
                promise.complete(Err(err))
            }
        });
        outer
    }
}

/// The timer's part of `due`: unless a waiter takes it first, runs its job at its instant.
/// The timer waits on the job (a waiter taking it wakes it at once, inside the slot) until
/// `YIELD_TAIL` before the instant, so it does not wake at the finish beside the waiter.
fn complete_unclaimed(due: &Due) {
    let until = due.at().checked_sub(YIELD_TAIL).unwrap_or(due.at());
    if due.wait_taken(until) {
        return;
    }
    if let Some(job) = due.take() {
        job();
    }
}

/// How much of a wait for a collective's completion [`sleep_until`] yields the core rather
/// than sleeps (and how long before the instant the timer stops waiting for a waiter to take
/// it): a sleep wakes late by the kernel's timer slack and the thread's wake-up (50 us and
/// more), which every collective on the link would add to the time its model states.
const YIELD_TAIL: Duration = Duration::from_micros(100);

/// How much of a blocking collective's wait ([`LinkStage::hold`]) [`sleep_until`] yields the
/// core rather than sleeps. Every rank of the group has joined it and nothing else is in flight
/// on the link, so no compute of the rank waits for the core; a sleep would add its wake-up to
/// every such collective, the ranks' agreement on the loss of every step among them (200 us for
/// 2 ranks on 100 us links). Where every rank waits, the cores idle, and an idle core of a virtual
/// machine halts: its wake-up is the host's to schedule, and can come far past the timer's 50 us slack
/// (docs/BENCHMARKS.md).
const HOLD_MARGIN: Duration = Duration::from_millis(2);

fn lock(clock: &Mutex<LinkClock>) -> std::sync::MutexGuard<'_, LinkClock> {
    clock.lock().unwrap_or_else(|e| e.into_inner())
}

/// What [`sleep_until`] sleeps, from `now`, of a wait until `t` that stays awake for its last
/// `awake`: up to `awake` before `t`, nothing when `t` is nearer.
fn sleep_part(now: Instant, t: Instant, awake: Duration) -> Option<Duration> {
    let left = t.checked_duration_since(now)?;
    left.checked_sub(awake).filter(|d| !d.is_zero())
}

/// Returns at `t`: sleeps until `awake` before it, then yields the core until `t` (another
/// runnable thread, a rank's compute, runs meanwhile).
fn sleep_until(t: Instant, awake: Duration) {
    while let Some(d) = sleep_part(Instant::now(), t, awake) {
        thread::sleep(d);
    }
    while Instant::now() < t {
        thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    //! The link's completion path, with its timer thread replaced by a channel nobody serves
    //! (so only the waiter can complete a collective) or kept (so only the timer can): which
    //! thread completes a collective, and when, never depends on scheduling here.

    use std::sync::mpsc::Receiver;
    use std::thread::ThreadId;

    use super::*;
    use crate::{Promise, WorkEvent};

    const TIMEOUT: Duration = Duration::from_secs(20);

    fn model() -> NetModel {
        NetModel {
            latency: Duration::from_millis(2),
            bandwidth_bytes_per_s: 1e9,
        }
    }

    /// A stage of world 2 on a rank's own link whose timer never fires: the receiver is kept.
    fn unserved_stage() -> (LinkStage, Receiver<Arc<Due>>) {
        let (tx, rx) = mpsc::channel();
        let clock = LinkClock::Own { free: Instant::now() };
        (LinkStage::with_timer(model(), 2, clock, tx), rx)
    }

    /// A collective of 1 KiB issued on `stage`, whose transfer the returned promise finishes.
    fn issue(stage: &LinkStage) -> (Work<u32>, Promise<u32>) {
        let (inner, transfer) = Work::pending(0, "bucket", TIMEOUT);
        let ticket = Arc::new(stage.ticket());
        (stage.delay(ticket, inner, RingOp::AllReduce, 1024, TIMEOUT), transfer)
    }

    /// When `work` finishes, as its observers are told.
    fn finish_of<T>(work: &Work<T>) -> Arc<Mutex<Option<Instant>>> {
        let at = Arc::new(Mutex::new(None));
        let seen = at.clone();
        work.observe(move |event| {
            if let WorkEvent::Finished { at, .. } = event {
                *seen.lock().unwrap() = Some(at);
            }
        });
        at
    }

    #[test]
    fn a_blocking_collective_of_a_few_link_latencies_never_sleeps() {
        // The loss agreement of 2 ranks on 100 us links holds the link 200 us: a sleep of any
        // part of it would end late by a thread's wake-up.
        let now = Instant::now();
        let agreement = model_wait(RingOp::AllReduce, 12, Duration::from_micros(100));
        assert_eq!(sleep_part(now, now + agreement, HOLD_MARGIN), None);
        assert_eq!(sleep_part(now, now + HOLD_MARGIN, HOLD_MARGIN), None);
        assert_eq!(
            sleep_part(now + agreement, now, HOLD_MARGIN),
            None,
            "a finish already past"
        );
        // a longer one sleeps up to the margin before its finish
        let sync = Duration::from_millis(43);
        assert_eq!(sleep_part(now, now + sync, HOLD_MARGIN), Some(sync - HOLD_MARGIN));
        // a collective's completion sleeps up to the yielding tail
        assert_eq!(
            sleep_part(now, now + agreement, YIELD_TAIL),
            Some(agreement - YIELD_TAIL)
        );
    }

    /// The link time of `op` on `bytes` on 2 ranks of links of latency `alpha` and 0.25 Gb/s.
    fn model_wait(op: RingOp, bytes: usize, alpha: Duration) -> Duration {
        let link = NetModel {
            latency: alpha,
            bandwidth_bytes_per_s: 0.25e9 / 8.0,
        };
        link.time(op, bytes, 2)
    }

    #[test]
    fn the_waiter_of_a_chained_work_completes_the_collective_at_its_slots_finish_on_its_own_thread() {
        let (stage, timer) = unserved_stage();
        let (work, transfer) = issue(&stage);
        let finished = finish_of(&work);
        let chained = work.then(|v| Ok((v, thread::current().id())));
        transfer.start();
        transfer.complete(Ok(7));
        // the slot was decided as the transfer finished, and its completion handed to the timer
        let due = timer.try_recv().expect("the link handed the completion to its timer");
        let ((value, ran_on), timing) = chained.wait_timed().expect("the waiter completes it");
        let returned = Instant::now();
        assert_eq!(value, 7);
        assert_eq!(ran_on, thread::current().id(), "the continuation ran on another thread");
        assert!(due.take().is_none(), "the waiter left the completion to the timer");
        let finished = finished.lock().unwrap().expect("the collective finished");
        assert_eq!(finished, due.at(), "the work's finish is not the slot's");
        assert_eq!(finished - timing.started, model().time(RingOp::AllReduce, 1024, 2));
        assert!(returned >= finished, "the waiter returned before the slot's finish");
        assert!(stage.idle(), "the collective is still counted on the link");
    }

    #[test]
    fn the_waiter_of_an_and_then_runs_the_chained_collectives_transfer_and_completion_after_the_first() {
        let (stage, timer) = unserved_stage();
        let stage = Arc::new(stage);
        let (first, transfer) = issue(&stage);
        let first_finish = finish_of(&first);
        let ran = Arc::new(Mutex::new(Vec::<(&str, ThreadId)>::new()));
        let (log, issuer) = (ran.clone(), stage.clone());
        let chained = first
            .and_then(move |v| {
                log.lock().unwrap().push(("issued", thread::current().id()));
                let (second, transfer) = issue(&issuer);
                // the transfer as the comm stream's helper runs it: on whichever thread asks
                let transfer = Mutex::new(Some(transfer));
                let log2 = log.clone();
                let second = second.lending_helper(Some(Box::new(move || {
                    if let Some(t) = transfer.lock().unwrap().take() {
                        log2.lock().unwrap().push(("transferred", thread::current().id()));
                        t.complete(Ok(v + 1));
                    }
                })));
                Ok(second)
            })
            .then(|v| Ok((v, thread::current().id())));
        transfer.complete(Ok(1));
        let ((value, ran_on), timing) = chained.wait_timed().expect("the waiter completes both");
        let me = thread::current().id();
        assert_eq!(value, 2);
        assert_eq!(ran_on, me);
        assert_eq!(
            *ran.lock().unwrap(),
            vec![("issued", me), ("transferred", me)],
            "the chained collective was not issued and run by the waiter, in that order"
        );
        let first_finish = first_finish.lock().unwrap().expect("the first finished");
        let dues: Vec<Arc<Due>> = timer.try_iter().collect();
        assert_eq!(dues.len(), 2, "one completion per collective");
        assert!(
            dues.iter().all(|d| d.take().is_none()),
            "a completion was left to the timer"
        );
        assert_eq!(dues[0].at(), first_finish);
        assert!(
            dues[1].at() >= first_finish + model().time(RingOp::AllReduce, 1024, 2),
            "the chained collective's slot overlapped the first's"
        );
        assert_eq!(timing.started, first_finish - model().time(RingOp::AllReduce, 1024, 2));
    }

    /// Two collectives issued on `stage` and transferred, each chained on a continuation that
    /// records its name and thread in `log` as it completes; with the dues the timer was handed.
    fn two_in_flight(
        stage: &LinkStage,
        timer: &Receiver<Arc<Due>>,
        log: &Arc<Mutex<Vec<(&'static str, ThreadId)>>>,
    ) -> (Work<()>, Work<()>, Vec<Arc<Due>>) {
        let mut chained = Vec::new();
        for name in ["first", "second"] {
            let (work, transfer) = issue(stage);
            let log = log.clone();
            chained.push(work.then(move |_| {
                log.lock().unwrap().push((name, thread::current().id()));
                Ok(())
            }));
            transfer.start();
            transfer.complete(Ok(0));
        }
        let dues: Vec<Arc<Due>> = timer.try_iter().collect();
        assert_eq!(dues.len(), 2, "one completion per collective");
        assert!(dues[0].at() <= dues[1].at(), "the second's slot finished first");
        let second = chained.pop().unwrap();
        (chained.pop().unwrap(), second, dues)
    }

    #[test]
    fn the_waiter_of_a_later_collective_completes_the_earlier_pending_one_first_on_its_thread() {
        let (stage, timer) = unserved_stage();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (first, second, dues) = two_in_flight(&stage, &timer, &log);
        second.wait().expect("the waiter completes the second");
        let me = thread::current().id();
        assert_eq!(
            *log.lock().unwrap(),
            vec![("first", me), ("second", me)],
            "the stream's collectives did not complete in issue order, both on the waiter"
        );
        assert!(first.is_completed(), "the first is still pending behind the second");
        assert!(
            dues.iter().all(|d| d.take().is_none()),
            "a completion was left to the timer"
        );
        assert!(stage.idle(), "a collective is still counted on the link");
    }

    #[test]
    fn the_waiter_of_a_later_collective_waits_for_the_thread_that_took_the_earlier_ones_completion() {
        let (stage, timer) = unserved_stage();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (_first, second, dues) = two_in_flight(&stage, &timer, &log);
        // the first's completion, taken as the timer takes it, not yet run
        let first_job = dues[0].take().expect("nobody took the first's completion");
        let waiter = thread::spawn(move || {
            second.wait().expect("the waiter completes the second");
            thread::current().id()
        });
        // the waiter, whenever it runs, may not complete the second before this job ran
        first_job();
        let waiter_id = waiter.join().expect("the waiter panicked");
        let me = thread::current().id();
        assert_eq!(*log.lock().unwrap(), vec![("first", me), ("second", waiter_id)]);
        assert!(stage.idle(), "a collective is still counted on the link");
    }

    #[test]
    fn a_continuation_that_waits_for_a_later_collective_completes_it_after_its_own() {
        let (stage, timer) = unserved_stage();
        let (first, first_transfer) = issue(&stage);
        let (second, second_transfer) = issue(&stage);
        let order = Arc::new(Mutex::new(Vec::new()));
        let (o1, o2) = (order.clone(), order.clone());
        let second = second.then(move |v| {
            o2.lock().unwrap().push("second");
            Ok(v)
        });
        // the first's continuation blocks on the second, as a comm thread's would never
        let chained = first.then(move |v| {
            o1.lock().unwrap().push("first");
            let w = second.wait()?;
            Ok(v + w)
        });
        first_transfer.complete(Ok(1));
        second_transfer.complete(Ok(2));
        // the timer is never served: only waiters complete
        let _timer = timer;
        assert_eq!(chained.wait().expect("no deadlock between the turns"), 3);
        assert_eq!(*order.lock().unwrap(), vec!["first", "second"]);
    }

    #[test]
    fn with_no_waiter_the_links_timer_completes_the_collective_and_runs_its_continuation() {
        let stage = LinkStage::own(model(), 0, 2);
        let (work, transfer) = issue(&stage);
        let (tx, rx) = mpsc::channel();
        let _chained = work.then(move |v| {
            let _ = tx.send((v, thread::current().name().map(str::to_string)));
            Ok(())
        });
        transfer.complete(Ok(3));
        let (value, name) = rx.recv_timeout(TIMEOUT).expect("the timer completed the collective");
        assert_eq!(value, 3);
        assert_eq!(name.as_deref(), Some("sim-net-0"));
    }
}
