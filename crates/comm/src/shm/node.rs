//! One process's end of a node's shared segment: agreement on each collective, and the
//! all-reduce (whole, or split into its reduce-scatter and all-gather halves for the
//! hierarchical path) in blocks through the segment.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use super::segment::{
    chunk, futex_wait, futex_wake_all, Control, DescSlot, CONTROL_BYTES, MAX_NAP, MAX_REASON_BYTES, MAX_TAG_BYTES,
    SLOT_BYTES,
};
use crate::desc::{first_mismatch, validate, OpDesc};
use crate::kernels::{finish_into, reduce_range, Element};
use crate::{CommError, ReduceOp};

/// How long a waiter polls before it sleeps: a peer a few microseconds behind (the next block
/// of the same collective) is caught without a system call; a peer that is still computing
/// is waited for asleep.
const SPIN: Duration = Duration::from_micros(20);

/// How a rank left the node (the value of its `dead` flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Death {
    /// In the middle of a collective (a timeout, an MPI error).
    Broken = 1,
    /// Between collectives (its communicator was dropped).
    Closed = 2,
}

/// Which progress counter of a rank's control block.
#[derive(Clone, Copy)]
enum Counter {
    Arrived,
    Published,
    Reduced,
    Done,
}

impl Counter {
    fn of(self, c: &Control) -> &AtomicU64 {
        match self {
            Counter::Arrived => &c.arrived.0,
            Counter::Published => &c.published.0,
            Counter::Reduced => &c.reduced.0,
            Counter::Done => &c.done.0,
        }
    }
}

/// One local rank's view of the node's segment (see the module docs of [`super`]).
pub(crate) struct ShmNode {
    /// Base of each local rank's region, local rank order.
    regions: Vec<*mut u8>,
    /// This process's local rank.
    me: usize,
    /// World rank of each local rank (errors name world ranks).
    world_ranks: Vec<usize>,
    timeout: Duration,
    /// Collectives agreed on so far.
    slot: u64,
    /// Blocks moved so far (the same count on every local rank: they agree on every length).
    block: u64,
}

// SAFETY: the regions stay mapped for the node's lifetime (the owner of the mapping outlives
// it); this process writes only its own region, and only through the protocol of the module
// docs, from the one thread that owns the `ShmNode`.
unsafe impl Send for ShmNode {}

impl ShmNode {
    /// A view of the segment whose regions (one per local rank, [`super::REGION_BYTES`] each,
    /// 64-byte aligned) start at `regions`; this process is local rank `me`.
    ///
    /// # Safety
    /// Every region must stay mapped, shared between the local ranks, for the lifetime of the
    /// returned value, and every rank's control block must be all zero bytes before any rank
    /// uses its `ShmNode` (zero your own with [`ShmNode::reset_own_control`], then synchronize).
    pub(crate) unsafe fn new(regions: Vec<*mut u8>, me: usize, world_ranks: Vec<usize>, timeout: Duration) -> Self {
        debug_assert_eq!(regions.len(), world_ranks.len());
        debug_assert!(regions.iter().all(|p| (*p as usize).trailing_zeros() >= 6));
        ShmNode {
            regions,
            me,
            world_ranks,
            timeout,
            slot: 0,
            block: 0,
        }
    }

    /// Zeroes this rank's control block (before any peer reads it).
    ///
    /// # Safety
    /// As for [`ShmNode::new`]: no peer may be using the segment yet.
    pub(crate) unsafe fn reset_own_control(region: *mut u8) {
        // SAFETY: the caller's contract; the region holds CONTROL_BYTES.
        unsafe { std::ptr::write_bytes(region, 0, CONTROL_BYTES) };
    }

    /// Number of local ranks.
    pub(crate) fn size(&self) -> usize {
        self.regions.len()
    }

    fn control(&self, rank: usize) -> &Control {
        // SAFETY: every region starts with a `Control`, mapped for our lifetime (`new`).
        unsafe { &*(self.regions[rank] as *const Control) }
    }

    /// Data half `half` of local rank `rank`, as elements of `E`.
    fn half<E>(&self, rank: usize, half: usize) -> *mut E {
        // SAFETY: in bounds of the region (`new`).
        unsafe { self.regions[rank].add(CONTROL_BYTES + half * SLOT_BYTES).cast() }
    }

    /// Moves one of this rank's counters and wakes the sleepers, if any.
    fn publish(&self, counter: Counter, value: u64) {
        counter.of(self.control(self.me)).store(value, SeqCst);
        let head = self.control(0);
        if head.sleepers.0.load(SeqCst) > 0 {
            head.doorbell.0.fetch_add(1, SeqCst);
            futex_wake_all(&head.doorbell.0);
        }
    }

    /// Waits until every local rank's `counter` reached `at_least`.
    fn wait_all(&self, counter: Counter, at_least: u64, tag: &str, deadline: Instant) -> Result<(), CommError> {
        let ready = || (0..self.size()).all(|r| counter.of(self.control(r)).load(SeqCst) >= at_least);
        self.wait_until(ready, counter, at_least, tag, deadline)
    }

    /// Waits until local rank `rank`'s `counter` reached `at_least`.
    fn wait_one(
        &self,
        rank: usize,
        counter: Counter,
        at_least: u64,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let ready = || counter.of(self.control(rank)).load(SeqCst) >= at_least;
        self.wait_until(ready, counter, at_least, tag, deadline)
    }

    /// Spins briefly, then sleeps on the doorbell until `ready`; fails when a peer is dead
    /// (readiness is checked first: a peer that finished its part and then left fails no
    /// one) or at `deadline` (this rank then declares itself dead, so that its peers fail at
    /// once rather than at their own deadlines).
    fn wait_until(
        &self,
        ready: impl Fn() -> bool,
        counter: Counter,
        at_least: u64,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        if ready() {
            return Ok(());
        }
        let spin_until = Instant::now() + SPIN;
        loop {
            for _ in 0..64 {
                spin_loop();
            }
            if ready() {
                return Ok(());
            }
            if Instant::now() >= spin_until {
                break;
            }
        }
        let head = self.control(0);
        loop {
            head.sleepers.0.fetch_add(1, SeqCst);
            let bell = head.doorbell.0.load(SeqCst);
            let verdict = if ready() {
                Some(Ok(()))
            } else if let Some(err) = self.first_dead(tag) {
                Some(Err(err))
            } else {
                let now = Instant::now();
                if now >= deadline {
                    Some(Err(self.give_up(counter, at_least, tag)))
                } else {
                    futex_wait(&head.doorbell.0, bell, (deadline - now).min(MAX_NAP));
                    None
                }
            };
            head.sleepers.0.fetch_sub(1, SeqCst);
            if let Some(verdict) = verdict {
                return verdict;
            }
        }
    }

    /// The timeout: names the ranks waited for, and declares this rank dead.
    fn give_up(&self, counter: Counter, at_least: u64, tag: &str) -> CommError {
        let missing: Vec<usize> = (0..self.size())
            .filter(|&r| counter.of(self.control(r)).load(SeqCst) < at_least)
            .map(|r| self.world_ranks[r])
            .collect();
        self.mark_dead(
            &format!(
                "it timed out after {:?} in collective `{tag}` waiting for ranks {missing:?}",
                self.timeout
            ),
            Death::Broken,
        );
        CommError::Timeout {
            rank: self.world_ranks[self.me],
            tag: tag.to_string(),
            after: self.timeout,
        }
    }

    /// The lowest local rank that is dead, as the error of collective `tag`.
    fn first_dead(&self, tag: &str) -> Option<CommError> {
        (0..self.size())
            .filter(|&r| r != self.me)
            .find(|&r| self.control(r).dead.0.load(SeqCst) != 0)
            .map(|r| {
                // SAFETY: written before `dead` was raised, never after.
                let note = unsafe { &*self.control(r).death.get() };
                let len = (note.len as usize).min(MAX_REASON_BYTES);
                CommError::RankFailed {
                    rank: self.world_ranks[r],
                    tag: tag.to_string(),
                    reason: String::from_utf8_lossy(&note.text[..len]).into_owned(),
                }
            })
    }

    /// Whether some local rank gave up in the middle of a collective (it may have left a
    /// collective on the node unfinished: the segment must not be freed under it).
    pub(crate) fn any_broken(&self) -> bool {
        (0..self.size()).any(|r| self.control(r).dead.0.load(SeqCst) == Death::Broken as u32)
    }

    /// Declares this rank dead (first reason wins) and wakes every sleeper, so that the
    /// peers fail with `reason` instead of waiting for it.
    pub(crate) fn mark_dead(&self, reason: &str, how: Death) {
        let own = self.control(self.me);
        if own.dead.0.load(SeqCst) == 0 {
            let bytes = &reason.as_bytes()[..reason.len().min(MAX_REASON_BYTES)];
            // SAFETY: only this rank writes its note, and peers read it only once `dead` is 1.
            unsafe {
                let note = &mut *own.death.get();
                note.text[..bytes.len()].copy_from_slice(bytes);
                note.len = bytes.len() as u32;
            }
            own.dead.0.store(how as u32, SeqCst);
        }
        let head = self.control(0);
        head.doorbell.0.fetch_add(1, SeqCst);
        futex_wake_all(&head.doorbell.0);
    }

    /// Agrees on the next collective: publishes this rank's descriptor and tag, waits for
    /// every local rank's, and returns the verdict every local rank reaches from the same
    /// descriptors: a mismatch naming both ranks, or whether the collective can run in a
    /// world of `world` ranks. Passing it is also a barrier.
    pub(crate) fn agree(&mut self, desc: &OpDesc, tag: &str, world: usize, deadline: Instant) -> Result<(), CommError> {
        // A collective with a dead peer can never complete (and the dead one may have arrived
        // at this slot before it gave up).
        if let Some(err) = self.first_dead(tag) {
            return Err(err);
        }
        let parity = (self.slot % 2) as usize;
        self.slot += 1;
        let tag_bytes = &tag.as_bytes()[..tag.len().min(MAX_TAG_BYTES)];
        // SAFETY: this rank's descriptor of this parity is read by peers only after they see
        // `arrived` reach this slot, and no peer still reads the previous one of this parity
        // (they all arrived at the slot in between, see `Control::descs`).
        unsafe {
            let slot: &mut DescSlot = &mut (*self.control(self.me).descs.get())[parity];
            slot.bytes = desc.encode();
            slot.tag[..tag_bytes.len()].copy_from_slice(tag_bytes);
            slot.tag_len = tag_bytes.len() as u32;
        }
        self.publish(Counter::Arrived, self.slot);
        self.wait_all(Counter::Arrived, self.slot, tag, deadline)?;
        let mut descs = Vec::with_capacity(self.size());
        let mut tags = Vec::with_capacity(self.size());
        for r in 0..self.size() {
            // SAFETY: published before `arrived` reached this slot (waited for above).
            let slot: &DescSlot = unsafe { &(*self.control(r).descs.get())[parity] };
            let decoded = OpDesc::decode(&slot.bytes).ok_or_else(|| {
                CommError::Internal(format!(
                    "rank {}: rank {} left an unreadable descriptor in collective `{tag}` (a different \
                     Brigade build?)",
                    self.world_ranks[self.me], self.world_ranks[r]
                ))
            })?;
            descs.push(decoded);
            let len = (slot.tag_len as usize).min(MAX_TAG_BYTES);
            tags.push(String::from_utf8_lossy(&slot.tag[..len]).into_owned());
        }
        if let Some(found) = first_mismatch(&descs) {
            return Err(CommError::Mismatch {
                tag: tags[0].clone(),
                slot: descs[0].slot,
                expected_rank: self.world_ranks[0],
                expected: descs[0].describe(&tags[0]),
                found_rank: self.world_ranks[found],
                found: descs[found].describe(&tags[found]),
            });
        }
        validate(&descs[0], world, tag)
    }

    /// Starts block `g`: waits until this rank's half `g % 2` is free (every rank finished
    /// reading it, in block `g - 2`).
    fn next_block(&mut self, tag: &str, deadline: Instant) -> Result<(u64, usize), CommError> {
        self.block += 1;
        let g = self.block;
        if g > 2 {
            self.wait_all(Counter::Done, g - 2, tag, deadline)?;
        }
        Ok((g, (g % 2) as usize))
    }

    /// Copies the parts of block `data[..m]` that the peers reduce into this rank's half, and
    /// waits until every rank did the same.
    ///
    /// # Safety
    /// `data` is valid for `m` reads; the half is this rank's for block `g` (`next_block`).
    unsafe fn share_block<E: Element>(
        &self,
        data: *const E,
        m: usize,
        g: u64,
        half: usize,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let size = self.size();
        let mine = self.half::<E>(self.me, half);
        for r in (0..size).filter(|&r| r != self.me) {
            let (a, b) = chunk(m, size, r);
            // SAFETY: in bounds of both; nobody reads this half before `published` says so.
            unsafe { std::ptr::copy_nonoverlapping(data.add(a), mine.add(a), b - a) };
        }
        self.publish(Counter::Published, g);
        self.wait_all(Counter::Published, g, tag, deadline)
    }

    /// Where this rank's chunk of block `g` lives on every rank (rank order): this rank's own
    /// input at `own`, the peers' halves otherwise; offset to the chunk's start `a`.
    fn sources<E>(&self, own: *const E, half: usize, a: usize) -> Vec<*const E> {
        (0..self.size())
            .map(|r| {
                let base = if r == self.me {
                    own
                } else {
                    self.half::<E>(r, half).cast_const()
                };
                // SAFETY: `a` is within the block, hence within both buffers.
                unsafe { base.add(a) }
            })
            .collect()
    }

    /// Copies the peers' reduced chunks of block `g` from their halves into `data[..m]`,
    /// then says this rank is done with block `g`.
    ///
    /// # Safety
    /// `data` is valid for `m` writes and not read by anyone else meanwhile.
    unsafe fn fetch_block<E: Element>(
        &self,
        data: *mut E,
        m: usize,
        g: u64,
        half: usize,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let size = self.size();
        for r in (0..size).filter(|&r| r != self.me) {
            self.wait_one(r, Counter::Reduced, g, tag, deadline)?;
            let (a, b) = chunk(m, size, r);
            // SAFETY: rank r reduced chunk r of its half and no longer writes it this block.
            unsafe { std::ptr::copy_nonoverlapping(self.half::<E>(r, half).add(a), data.add(a), b - a) };
        }
        self.publish(Counter::Done, g);
        Ok(())
    }

    /// In-place all-reduce of `data` over the local ranks (f32 accumulation in local rank
    /// order; `Avg` divides by `divisor`), block by block through the segment.
    ///
    /// # Safety
    /// `data` is valid for `n` reads and writes and used by nobody else during the call; every
    /// local rank calls this with the same `n`, `E` and `op` (agreed first).
    pub(crate) unsafe fn all_reduce<E: Element>(
        &mut self,
        data: *mut E,
        n: usize,
        op: ReduceOp,
        divisor: f32,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let per_block = SLOT_BYTES / std::mem::size_of::<E>();
        let size = self.size();
        let mut lo = 0;
        while lo < n {
            let m = per_block.min(n - lo);
            let (g, half) = self.next_block(tag, deadline)?;
            // SAFETY: `lo + m <= n`; the half is ours for block g.
            let block = unsafe { data.add(lo) };
            unsafe { self.share_block(block.cast_const(), m, g, half, tag, deadline)? };
            let (a, b) = chunk(m, size, self.me);
            let srcs = self.sources(block.cast_const(), half, a);
            // SAFETY: chunk `me` of this block is this rank's alone: peers read only their own
            // chunk of our half, and our own input's chunk is private.
            let dsts = unsafe { [block.add(a), self.half::<E>(self.me, half).add(a)] };
            unsafe { reduce_range(&srcs, &dsts, 0, b - a, op, divisor) };
            self.publish(Counter::Reduced, g);
            unsafe { self.fetch_block(block, m, g, half, tag, deadline)? };
            lo += m;
        }
        Ok(())
    }

    /// The first half of a hierarchical all-reduce: reduces `data` (`n` elements) over the
    /// local ranks with `op` (`Avg` sums: the division comes at the end), keeping this rank's
    /// chunk of every block, unrounded, in `shard` (blocks in order).
    ///
    /// # Safety
    /// As [`ShmNode::all_reduce`] (`data` is only read).
    pub(crate) unsafe fn reduce_scatter_f32<E: Element>(
        &mut self,
        data: *const E,
        n: usize,
        op: ReduceOp,
        shard: &mut Vec<f32>,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let per_block = SLOT_BYTES / std::mem::size_of::<E>();
        let size = self.size();
        let combine = if op == ReduceOp::Max {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        shard.clear();
        let mut lo = 0;
        while lo < n {
            let m = per_block.min(n - lo);
            let (g, half) = self.next_block(tag, deadline)?;
            // SAFETY: as in `all_reduce`.
            let block = unsafe { data.add(lo) };
            unsafe { self.share_block(block, m, g, half, tag, deadline)? };
            let (a, b) = chunk(m, size, self.me);
            let start = shard.len();
            shard.resize(start + (b - a), 0.0);
            let srcs = self.sources(block, half, a);
            // SAFETY: `shard` holds `b - a` elements from `start`.
            let dsts = [unsafe { shard.as_mut_ptr().add(start) }];
            unsafe { reduce_range(&srcs, &dsts, 0, b - a, combine, 1.0) };
            self.publish(Counter::Done, g);
            lo += m;
        }
        Ok(())
    }

    /// The second half of a hierarchical all-reduce: every local rank's `shard` (from
    /// [`ShmNode::reduce_scatter_f32`] on the same `n`, then reduced across nodes) rounded
    /// into its place in `data`, divided by `divisor` for `Avg`.
    ///
    /// # Safety
    /// As [`ShmNode::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn all_gather_f32<E: Element>(
        &mut self,
        shard: &[f32],
        data: *mut E,
        n: usize,
        op: ReduceOp,
        divisor: f32,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let per_block = SLOT_BYTES / std::mem::size_of::<E>();
        let size = self.size();
        let mut lo = 0;
        let mut pos = 0;
        while lo < n {
            let m = per_block.min(n - lo);
            let (g, half) = self.next_block(tag, deadline)?;
            let (a, b) = chunk(m, size, self.me);
            let part = &shard[pos..pos + (b - a)];
            pos += b - a;
            // SAFETY: chunk `me` of our half and of `data`'s block are ours in this block.
            unsafe {
                let out = std::slice::from_raw_parts_mut(data.add(lo + a), b - a);
                finish_into(part, out, op, divisor);
                std::ptr::copy_nonoverlapping(out.as_ptr(), self.half::<E>(self.me, half).add(a), b - a);
            }
            self.publish(Counter::Reduced, g);
            unsafe { self.fetch_block(data.add(lo), m, g, half, tag, deadline)? };
            lo += m;
        }
        Ok(())
    }
}
