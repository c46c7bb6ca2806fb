//! The guard of the blocking design: MPI's blocking collectives cannot be cancelled or given a
//! timeout, so a thread watches the one in flight and, past its deadline, ends the whole job
//! with `MPI_Abort` after saying which collective on which rank, as PyTorch's NCCL watchdog
//! does. A peer that is alive but never joins therefore costs every rank its timeout, not
//! forever.
//!
//! Arming costs two uncontended lock operations per collective and usually wakes nobody: the
//! thread sleeps until the deadline of what it saw armed (or a whole timeout when nothing
//! was), and is woken only by a call armed with an earlier deadline than that.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// What the watchdog does at a deadline: told the collective's description, it ends the job
/// (tests record instead).
pub(crate) type Fire = Box<dyn Fn(&str) + Send>;

struct Armed {
    seq: u64,
    deadline: Instant,
    describe: Box<dyn FnOnce() -> String + Send>,
}

struct State {
    armed: Option<Armed>,
    seq: u64,
    stop: bool,
    /// When the thread will look again (`None` while it is looking or firing).
    sleeping_until: Option<Instant>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// One transport's watchdog thread.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Disarms the watchdog when the guarded call returned.
pub(crate) struct ArmGuard {
    shared: Arc<Shared>,
    seq: u64,
}

impl Watchdog {
    /// Starts the thread; `idle` bounds its sleep when nothing is armed (the timeout of the
    /// collectives it will guard: their deadlines are never further away).
    pub(crate) fn start(name: String, idle: Duration, fire: Fire) -> Watchdog {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                armed: None,
                seq: 0,
                stop: false,
                sleeping_until: None,
            }),
            wake: Condvar::new(),
        });
        let watched = shared.clone();
        let thread = thread::Builder::new()
            .name(name)
            .spawn(move || watch(&watched, idle, fire))
            .expect("spawn the MPI watchdog thread");
        Watchdog {
            shared,
            thread: Some(thread),
        }
    }

    /// Guards a blocking call that must complete by `deadline`; `describe` names it (called
    /// only if the watchdog fires).
    pub(crate) fn arm(&self, deadline: Instant, describe: impl FnOnce() -> String + Send + 'static) -> ArmGuard {
        let mut st = lock(&self.shared);
        st.seq += 1;
        let seq = st.seq;
        st.armed = Some(Armed {
            seq,
            deadline,
            describe: Box::new(describe),
        });
        let early = st.sleeping_until.is_some_and(|until| deadline < until);
        drop(st);
        if early {
            self.shared.wake.notify_all();
        }
        ArmGuard {
            shared: self.shared.clone(),
            seq,
        }
    }
}

impl Drop for ArmGuard {
    fn drop(&mut self) {
        let mut st = lock(&self.shared);
        if st.armed.as_ref().is_some_and(|a| a.seq == self.seq) {
            st.armed = None;
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        lock(&self.shared).stop = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn watch(shared: &Shared, idle: Duration, fire: Fire) {
    let mut st = lock(shared);
    loop {
        if st.stop {
            return;
        }
        let now = Instant::now();
        let sleep = match &st.armed {
            Some(armed) if now >= armed.deadline => {
                let armed = st.armed.take().expect("just matched");
                drop(st);
                fire(&(armed.describe)());
                st = lock(shared);
                continue;
            }
            Some(armed) => armed.deadline - now,
            None => idle,
        };
        st.sleeping_until = Some(now + sleep);
        st = shared.wake.wait_timeout(st, sleep).unwrap_or_else(|e| e.into_inner()).0;
        st.sleeping_until = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn recording() -> (Fire, mpsc::Receiver<(String, Instant)>) {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let fire: Fire = Box::new(move |what: &str| {
            let _ = tx.lock().unwrap().send((what.to_string(), Instant::now()));
        });
        (fire, rx)
    }

    #[test]
    fn a_call_past_its_deadline_fires_once_at_the_deadline_naming_it() {
        let (fire, fired) = recording();
        // Idle sleeps far longer than the deadline: the thread must not oversleep it.
        let dog = Watchdog::start("test-watchdog".into(), Duration::from_secs(600), fire);
        std::thread::sleep(Duration::from_millis(20)); // the thread is asleep, idle
        let deadline = Instant::now() + Duration::from_millis(100);
        let guard = dog.arm(deadline, || "all_reduce(sum, 8 x f32, tag `b0`) on rank 3".into());
        let (what, at) = fired.recv_timeout(Duration::from_secs(30)).expect("the watchdog fired");
        assert_eq!(what, "all_reduce(sum, 8 x f32, tag `b0`) on rank 3");
        assert!(
            at >= deadline && at < deadline + Duration::from_secs(10),
            "{:?}",
            at - deadline
        );
        drop(guard);
        assert!(fired.recv_timeout(Duration::from_millis(200)).is_err(), "fired twice");
    }

    #[test]
    fn a_call_that_returns_in_time_is_forgotten() {
        let (fire, fired) = recording();
        let dog = Watchdog::start("test-watchdog".into(), Duration::from_millis(50), fire);
        // Each call returns (its guard dropped) at once, far inside its deadline however loaded
        // the machine; the deadlines then pass with nothing in flight.
        let deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..100 {
            let _guard = dog.arm(deadline, || "b".into());
        }
        std::thread::sleep((deadline + Duration::from_millis(300)).saturating_duration_since(Instant::now()));
        assert!(fired.try_recv().is_err());
        drop(dog); // stops and joins promptly
    }
}
