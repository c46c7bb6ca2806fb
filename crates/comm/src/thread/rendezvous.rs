//! Rendezvous of the thread backend: a reusable barrier that also publishes each rank's
//! descriptor of the collective, knows which ranks are dead, and never waits past the timeout.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::desc::OpDesc;
use crate::CommError;

/// How long a waiter spins before it parks: long enough to catch a peer that is a few
/// microseconds behind, short enough not to steal a core from compute.
const SPIN: Duration = Duration::from_micros(30);

struct State {
    arrived: Vec<bool>,
    count: usize,
    generation: u64,
    /// Why each dead rank is dead, with the order of death (the first death is the cause
    /// reported; later ones are usually its consequences).
    dead: Vec<Option<(usize, String)>>,
    deaths: usize,
    descs: Vec<Option<OpDesc>>,
    /// The descriptors of the last completed exchange. Published apart from `descs`: a rank
    /// released from an exchange may publish its next descriptor before a slower peer has
    /// read this one, but cannot complete the next exchange without that peer.
    agreed: Option<Arc<[OpDesc]>>,
}

/// State shared by the ranks of one [`super::ThreadGroup`].
pub(crate) struct Rendezvous {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    released: Condvar,
    /// Mirror of `State::generation` for the spin phase.
    generation: AtomicU64,
    /// The ranks' staging areas of the one-rendezvous all-reduce (`transport.rs`), owned here so
    /// that they outlive every rank that may still read them.
    stages: Mutex<Vec<Stage>>,
}

/// A staging area allocated by one rank, freed with the rendezvous.
struct Stage(*mut [u8]);

// SAFETY: only the pointer moves between threads; who reads and writes the bytes and when is
// the protocol of `transport.rs`.
unsafe impl Send for Stage {}

impl Rendezvous {
    pub(crate) fn new(world: usize, timeout: Duration) -> Self {
        Rendezvous {
            world,
            timeout,
            state: Mutex::new(State {
                arrived: vec![false; world],
                count: 0,
                generation: 0,
                dead: vec![None; world],
                deaths: 0,
                descs: vec![None; world],
                agreed: None,
            }),
            released: Condvar::new(),
            generation: AtomicU64::new(0),
            stages: Mutex::new(Vec::new()),
        }
    }

    /// A new staging area of `bytes` bytes for the calling rank, alive as long as the
    /// rendezvous.
    pub(crate) fn new_stage(&self, bytes: usize) -> *mut u8 {
        let raw = Box::into_raw(vec![0u8; bytes].into_boxed_slice());
        self.stages.lock().unwrap_or_else(|e| e.into_inner()).push(Stage(raw));
        raw.cast::<u8>()
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks `rank` dead (first reason wins) and wakes every waiter so it fails promptly.
    pub(crate) fn mark_dead(&self, rank: usize, reason: String) {
        let mut st = self.lock();
        if st.dead[rank].is_none() {
            st.dead[rank] = Some((st.deaths, reason));
            st.deaths += 1;
        }
        drop(st);
        self.released.notify_all();
    }

    /// Publishes `desc` for `rank`, waits until every rank has published, and returns all
    /// descriptors, rank-ordered.
    pub(crate) fn exchange(&self, rank: usize, desc: OpDesc) -> Result<Arc<[OpDesc]>, CommError> {
        let tag = desc.tag.clone();
        let st = self.arrive(rank, &tag, Some(desc))?;
        Ok(st.agreed.clone().expect("an exchange publishes the descriptors"))
    }

    /// Waits until every rank has arrived.
    pub(crate) fn barrier(&self, rank: usize, tag: &str) -> Result<(), CommError> {
        self.arrive(rank, tag, None).map(drop)
    }

    fn arrive(&self, rank: usize, tag: &str, desc: Option<OpDesc>) -> Result<MutexGuard<'_, State>, CommError> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.lock();
        if let Some(err) = first_dead(&st, tag) {
            return Err(err);
        }
        if let Some(desc) = desc {
            st.descs[rank] = Some(desc);
        }
        let generation = st.generation;
        st.arrived[rank] = true;
        st.count += 1;
        if st.count == self.world {
            if st.descs.iter().all(Option::is_some) {
                st.agreed = Some(st.descs.iter_mut().map(|d| d.take().expect("checked")).collect());
            }
            st.count = 0;
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.generation += 1;
            self.generation.store(st.generation, Ordering::Release);
            self.released.notify_all();
            return Ok(st);
        }
        drop(st);

        let spin_until = Instant::now() + SPIN;
        while self.generation.load(Ordering::Acquire) == generation && Instant::now() < spin_until {
            for _ in 0..64 {
                spin_loop();
            }
        }

        let mut st = self.lock();
        loop {
            // Release is checked before death: a peer that passed this barrier and then
            // dropped its communicator must not fail us.
            if st.generation != generation {
                return Ok(st);
            }
            if let Some(err) = first_dead(&st, tag) {
                return Err(err);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.world).filter(|&r| !st.arrived[r]).collect();
                // Giving up leaves the barrier count wrong for good: declare this rank dead so
                // the peers fail promptly instead of timing out one by one.
                if st.dead[rank].is_none() {
                    let reason = format!(
                        "it timed out after {:?} in collective `{tag}` waiting for ranks {missing:?}",
                        self.timeout
                    );
                    st.dead[rank] = Some((st.deaths, reason));
                    st.deaths += 1;
                }
                drop(st);
                self.released.notify_all();
                return Err(CommError::Timeout {
                    rank,
                    tag: tag.to_string(),
                    after: self.timeout,
                });
            }
            st = self
                .released
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        let stages = std::mem::take(self.stages.get_mut().unwrap_or_else(|e| e.into_inner()));
        for Stage(raw) in stages {
            // SAFETY: made by `Box::into_raw` in `new_stage`; the last rank is gone, so nobody
            // holds the pointer any more.
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

fn first_dead(st: &State, tag: &str) -> Option<CommError> {
    st.dead
        .iter()
        .enumerate()
        .filter_map(|(rank, dead)| dead.as_ref().map(|(order, reason)| (order, rank, reason)))
        .min()
        .map(|(_, rank, reason)| CommError::RankFailed {
            rank,
            tag: tag.to_string(),
            reason: reason.clone(),
        })
}
