//! The thread backend: `n` ranks as threads of one process, exchanging data through shared
//! memory. All-reduce is a reduce-scatter followed by an all-gather done in one pass: rank `r`
//! reduces chunk `r` across every rank's buffer and writes the result into chunk `r` of every
//! buffer, all ranks in parallel. A small all-reduce (at most 8 KiB) instead reduces every rank's
//! staged copy into each buffer after a single rendezvous (below).
//!
//! # Slot protocol (the invariant behind the `unsafe`)
//! Every collective is one *slot*, executed by every rank's stream in issue order:
//! 1. **Exchange**: each rank publishes a descriptor with a raw pointer to its buffer and waits
//!    for all others (`Rendezvous::exchange`). From here until step 3 the owning stream does not
//!    touch its `Buffer` through Rust references: it is blocked in this function and uses only
//!    the published pointers, like its peers.
//! 2. **Move**: if all descriptors agree, rank `r` reads and writes only *its* element range
//!    (chunk `r`) of the buffers (all-reduce, reduce-scatter, all-gather), or only its own
//!    buffer (broadcast reads the root's buffer, which nobody writes). Ranges of different
//!    ranks are disjoint, so there are no data races.
//! 3. **Barrier**: nobody leaves the slot until every rank finished moving, so no buffer is
//!    freed, resized or reused while a peer still holds its pointer. A rank that fails in the
//!    middle (timeout, dead peer) never reaches step 2 for that slot, and an error at step 1
//!    means some rank will never touch the pointers again.
//!
//! # Small all-reduces: one rendezvous
//! An all-reduce of at most [`EAGER_BYTES`] runs in one rendezvous instead of two (the
//! handshakes, not the bytes, are what a small collective costs): each rank first copies its
//! input into its *staging area* (half `slot % 2` of it), publishes a pointer to that copy
//! instead of its buffer, and after the exchange reduces every rank's copy, in rank order (the
//! same sum on every rank), into its own buffer. Nobody writes memory a peer reads, so no
//! closing barrier is needed. A rank rewrites half `slot % 2` only in slot `slot + 2`, after
//! the exchange of `slot + 1`, which every peer reaches only once done reading `slot`'s copies;
//! the staging areas belong to the rendezvous, so they outlive a rank that leaves first.
//!
//! # Rendezvous
//! The ranks meet in a [`Rendezvous`]: a reusable barrier that also publishes each rank's
//! descriptor of the collective, knows which ranks are dead, and never waits past the timeout.

use std::hint::spin_loop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use crate::collective::{self, OpDesc, OpKind};
use crate::error::panic_message;
use crate::kernels::{reduce_range, Element};
use crate::stream::Transport;
use crate::{Buffer, CommError, CommStream, DType, ReduceOp};

/// A rank of a thread group: a [`CommStream`] over a [`ThreadTransport`].
pub type ThreadComm = CommStream<ThreadTransport>;

/// Timeout of [`ThreadGroup::new`] and [`run_on_threads`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Creates the communicators of a group of ranks that live in one process.
pub struct ThreadGroup;

impl ThreadGroup {
    /// `n` communicators, rank `i` at index `i`, with [`DEFAULT_TIMEOUT`]. Hand each to its own
    /// thread; a rank whose communicator is dropped (including by a panic) is marked dead and
    /// its peers' collectives fail with [`CommError::RankFailed`].
    ///
    /// # Panics
    /// If `n == 0`.
    #[allow(clippy::new_ret_no_self)] // a group is its communicators
    pub fn new(n: usize) -> Vec<ThreadComm> {
        Self::with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// As [`ThreadGroup::new`], with `timeout` for every wait (handles and internal waits).
    ///
    /// # Panics
    /// If `n == 0`.
    pub fn with_timeout(n: usize, timeout: Duration) -> Vec<ThreadComm> {
        assert!(n > 0, "a thread group needs at least one rank");
        let shared = Arc::new(Rendezvous::new(n, timeout));
        (0..n)
            .map(|rank| CommStream::new(ThreadTransport::new(rank, shared.clone()), timeout))
            .collect()
    }
}

/// Runs `f` on `n` ranks, each on its own thread with its own communicator, and returns each
/// rank's result (rank order). A rank that panics yields [`CommError::Panicked`]; the others see
/// it as dead and fail instead of hanging. Uses [`DEFAULT_TIMEOUT`].
pub fn run_on_threads<R: Send>(n: usize, f: impl Fn(ThreadComm) -> R + Sync) -> Vec<Result<R, CommError>> {
    run_on_threads_with_timeout(n, DEFAULT_TIMEOUT, f)
}

/// As [`run_on_threads`], with `timeout` for every wait.
pub fn run_on_threads_with_timeout<R: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(ThreadComm) -> R + Sync,
) -> Vec<Result<R, CommError>> {
    let comms = ThreadGroup::with_timeout(n, timeout);
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        catch_unwind(AssertUnwindSafe(|| f(comm))).map_err(|payload| CommError::Panicked {
                            rank,
                            message: panic_message(payload.as_ref()),
                        })
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|payload| {
                    Err(CommError::Panicked {
                        rank,
                        message: panic_message(payload.as_ref()),
                    })
                })
            })
            .collect()
    })
}

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
    descs: Vec<Option<Published>>,
    /// The descriptors of the last completed exchange, kept apart from `descs`: a rank
    /// released from an exchange may publish its next descriptor before a slower peer has
    /// read this one, but cannot complete the next exchange without that peer.
    agreed: Option<Arc<[Published]>>,
}

/// State shared by the ranks of one [`ThreadGroup`]: the rendezvous.
pub(crate) struct Rendezvous {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    released: Condvar,
    /// Mirror of `State::generation` for the spin phase.
    generation: AtomicU64,
    /// The ranks' staging areas of the one-rendezvous all-reduce (module docs), owned here so
    /// that they outlive every rank that may still read them.
    stages: Mutex<Vec<Stage>>,
}

/// A staging area allocated by one rank, freed with the rendezvous.
struct Stage(*mut [u8]);

// SAFETY: only the pointer moves between threads; who reads and writes the bytes and when is
// the protocol of the module docs.
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
    pub(crate) fn exchange(&self, rank: usize, desc: Published) -> Result<Arc<[Published]>, CommError> {
        let tag = desc.tag.clone();
        let st = self.arrive(rank, &tag, Some(desc))?;
        Ok(st.agreed.clone().expect("an exchange publishes the descriptors"))
    }

    /// Waits until every rank has arrived.
    pub(crate) fn barrier(&self, rank: usize, tag: &str) -> Result<(), CommError> {
        self.arrive(rank, tag, None).map(drop)
    }

    fn arrive(&self, rank: usize, tag: &str, desc: Option<Published>) -> Result<MutexGuard<'_, State>, CommError> {
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

/// Address of a rank's buffer, shared with the peers for the duration of one collective.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedPtr(pub(crate) *mut u8);

// SAFETY: the pointer is only dereferenced between the two rendezvous of one collective, while
// the owning rank's stream is blocked in that collective and does not touch its buffer except
// through the same protocol (module docs).
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

/// What a rank publishes in a slot: its descriptor of the collective, the tag's text, and its
/// buffer (or its staged copy).
#[derive(Debug, Clone)]
pub(crate) struct Published {
    desc: OpDesc,
    tag: String,
    ptr: SharedPtr,
}

impl Published {
    fn same_collective(&self, other: &Published) -> bool {
        self.desc.same_collective(&other.desc) && self.tag == other.tag
    }

    /// Input length in elements.
    fn len(&self) -> usize {
        self.desc.len as usize
    }
}

/// Checks that every rank issued the same collective and that it can run. Every rank calls this
/// on the same descriptors, so every rank reaches the same verdict.
fn validate(descs: &[Published]) -> Result<(), CommError> {
    let reference = &descs[0];
    if let Some((found_rank, found)) = descs.iter().enumerate().find(|(_, d)| !d.same_collective(reference)) {
        return Err(CommError::Mismatch {
            tag: reference.tag.clone(),
            slot: reference.desc.slot,
            expected_rank: 0,
            expected: reference.desc.describe(&reference.tag),
            found_rank,
            found: found.desc.describe(&found.tag),
        });
    }
    collective::validate(&reference.desc, descs.len(), &reference.tag)
}

/// Chunk boundaries are multiples of this many elements (at least one cache line).
const CHUNK_ALIGN: usize = 32;

/// The largest all-reduce (in bytes) that runs in one rendezvous through the staging areas
/// (module docs); larger ones are bandwidth-bound and reduce in place, each rank its chunk.
pub(crate) const EAGER_BYTES: usize = 8 << 10;

/// One rank's end of a [`ThreadGroup`]: the [`Transport`] of the thread backend.
pub struct ThreadTransport {
    rank: usize,
    shared: Arc<Rendezvous>,
    slot: u64,
    /// This rank's staging area (owned by `shared`), made at its first small all-reduce: two
    /// halves of [`EAGER_BYTES`], one per slot parity.
    stage: Option<SharedPtr>,
}

impl ThreadTransport {
    pub(crate) fn new(rank: usize, shared: Arc<Rendezvous>) -> Self {
        ThreadTransport {
            rank,
            shared,
            slot: 0,
            stage: None,
        }
    }

    /// Step 1 of a slot: publishes this rank's descriptor (its buffer, or its staged copy, at
    /// `ptr`), waits for every rank's and checks that they agree. A mismatch moves nothing, so
    /// it needs no barrier: every rank returns the same verdict here, whichever path (one
    /// rendezvous or two) its own length chose.
    fn agree(
        &mut self,
        kind: OpKind,
        dtype: Option<DType>,
        len: usize,
        tag: &str,
        ptr: *mut u8,
    ) -> Result<Arc<[Published]>, CommError> {
        let desc = Published {
            desc: OpDesc::new(self.slot, kind, dtype, len, tag),
            tag: tag.to_string(),
            ptr: SharedPtr(ptr),
        };
        self.slot += 1;
        let descs = self.shared.exchange(self.rank, desc)?;
        validate(&descs)?;
        Ok(descs)
    }

    /// An all-reduce of at most [`EAGER_BYTES`] in one rendezvous (module docs).
    fn all_reduce_eager(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError> {
        let dtype = buf.dtype();
        let len = buf.len();
        let bytes = len * dtype.size_in_bytes();
        let stage = match self.stage {
            Some(stage) => stage,
            None => *self.stage.insert(SharedPtr(self.shared.new_stage(2 * EAGER_BYTES))),
        };
        let half = (self.slot % 2) as usize * EAGER_BYTES;
        // SAFETY: `bytes <= EAGER_BYTES`, so the copy fits in half `slot % 2` of this rank's
        // staging area, which no peer reads now (module docs: it was last read in slot
        // `slot - 2`, and every peer is past the exchange of `slot - 1`).
        let copy = unsafe { stage.0.add(half) };
        unsafe { std::ptr::copy_nonoverlapping(buf.as_mut_ptr().cast_const(), copy, bytes) };
        let descs = self.agree(OpKind::AllReduce(op), Some(dtype), len, tag, copy)?;
        let srcs: Vec<*mut u8> = descs.iter().map(|d| d.ptr.0).collect();
        // SAFETY: every rank agreed on this all-reduce of `len` elements, so each pointer is a
        // peer's staged copy of `len` elements, not rewritten before this rank's next exchange;
        // the destination is this rank's own buffer.
        unsafe { reduce_typed(dtype, &srcs, &[buf.as_mut_ptr()], 0, len, op) };
        Ok(())
    }

    /// Runs one slot of the protocol on `buf` (none for a barrier) whose input had
    /// `input_len` elements.
    fn run_slot(
        &mut self,
        kind: OpKind,
        buf: Option<&mut Buffer>,
        input_len: usize,
        tag: &str,
    ) -> Result<(), CommError> {
        let (dtype, ptr) = match buf {
            Some(buf) => (Some(buf.dtype()), buf.as_mut_ptr()),
            None => (None, std::ptr::null_mut()),
        };
        let descs = self.agree(kind, dtype, input_len, tag, ptr)?;
        // SAFETY: step 2 of the slot protocol (module docs): all ranks agreed, every pointer
        // is live until the barrier below, and this rank touches only its range.
        unsafe { move_data(self.rank, &descs) };
        self.shared.barrier(self.rank, tag)
    }
}

/// Element range of rank `rank`'s chunk when `len` elements are split over `world` ranks.
fn chunk(len: usize, world: usize, rank: usize) -> (usize, usize) {
    let per = len.div_ceil(world).next_multiple_of(CHUNK_ALIGN);
    ((rank * per).min(len), ((rank + 1) * per).min(len))
}

/// # Safety
/// Step 2 of the slot protocol: `descs` agree and their pointers stay valid until every rank
/// reached the closing barrier.
unsafe fn move_data(rank: usize, descs: &[Published]) {
    let world = descs.len();
    let d = &descs[rank];
    let Some(dtype) = d.desc.dtype else { return };
    let ptrs: Vec<*mut u8> = descs.iter().map(|d| d.ptr.0).collect();
    let esize = dtype.size_in_bytes();
    match d.desc.kind {
        OpKind::AllReduce(op) => {
            let (lo, hi) = chunk(d.len(), world, rank);
            unsafe { reduce_typed(dtype, &ptrs, &ptrs, lo, hi, op) };
        }
        OpKind::ReduceScatter(op) => {
            let per = d.len() / world;
            let (lo, hi) = (rank * per, (rank + 1) * per);
            unsafe { reduce_typed(dtype, &ptrs, &ptrs[rank..rank + 1], lo, hi, op) };
        }
        OpKind::AllGather => {
            // Each buffer holds world*len elements, the owner's input already at its place.
            let seg = d.len() * esize;
            for (peer, &dst) in ptrs.iter().enumerate() {
                if peer != rank && seg > 0 {
                    // SAFETY: segment `rank` of every buffer belongs to this rank in this slot.
                    unsafe { std::ptr::copy_nonoverlapping(ptrs[rank].add(rank * seg), dst.add(rank * seg), seg) };
                }
            }
        }
        OpKind::Broadcast { root } => {
            if rank != root && d.len() > 0 {
                // SAFETY: the root's buffer is only read in this slot; ours only written by us.
                unsafe { std::ptr::copy_nonoverlapping(ptrs[root], ptrs[rank], d.len() * esize) };
            }
        }
        OpKind::Barrier => {}
    }
}

/// # Safety
/// As [`reduce_range`], with `u8` pointers to buffers of element type `dtype`.
unsafe fn reduce_typed(dtype: DType, srcs: &[*mut u8], dsts: &[*mut u8], lo: usize, hi: usize, op: ReduceOp) {
    unsafe fn typed<E: Element>(srcs: &[*mut u8], dsts: &[*mut u8], lo: usize, hi: usize, op: ReduceOp) {
        let srcs: Vec<*const E> = srcs.iter().map(|p| p.cast_const().cast()).collect();
        let dsts: Vec<*mut E> = dsts.iter().map(|p| p.cast()).collect();
        let world = srcs.len() as f32;
        unsafe { reduce_range(&srcs, &dsts, lo, hi, op, world) }
    }
    match dtype {
        DType::F32 => unsafe { typed::<f32>(srcs, dsts, lo, hi, op) },
        DType::F16 => unsafe { typed::<f16>(srcs, dsts, lo, hi, op) },
        DType::BF16 => unsafe { typed::<bf16>(srcs, dsts, lo, hi, op) },
        DType::U8 | DType::I8 | DType::F64 | DType::I64 => {
            unreachable!("validate rejects reductions on {dtype}")
        }
    }
}

impl Transport for ThreadTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world()
    }

    fn all_reduce(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError> {
        let len = buf.len();
        if self.shared.world() > 1 && len * buf.dtype().size_in_bytes() <= EAGER_BYTES {
            return self.all_reduce_eager(buf, op, tag);
        }
        self.run_slot(OpKind::AllReduce(op), Some(buf), len, tag)
    }

    fn broadcast(&mut self, buf: &mut Buffer, root: usize, tag: &str) -> Result<(), CommError> {
        let len = buf.len();
        self.run_slot(OpKind::Broadcast { root }, Some(buf), len, tag)
    }

    fn all_gather(&mut self, buf: &mut Buffer, tag: &str) -> Result<(), CommError> {
        let len = buf.len();
        let world = self.shared.world();
        buf.resize(len * world);
        if self.rank > 0 {
            buf.copy_within(0, len, self.rank * len);
        }
        self.run_slot(OpKind::AllGather, Some(buf), len, tag)
    }

    fn reduce_scatter(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError> {
        let len = buf.len();
        self.run_slot(OpKind::ReduceScatter(op), Some(&mut *buf), len, tag)?;
        let per = len / self.shared.world();
        buf.copy_within(self.rank * per, per, 0);
        buf.resize(per);
        Ok(())
    }

    fn barrier(&mut self, tag: &str) -> Result<(), CommError> {
        self.run_slot(OpKind::Barrier, None, 0, tag)
    }

    fn close(&mut self, reason: &str) {
        self.shared.mark_dead(self.rank, reason.to_string());
    }
}

impl Drop for ThreadTransport {
    fn drop(&mut self) {
        self.shared
            .mark_dead(self.rank, format!("rank {}'s comm stream ended", self.rank));
    }
}
