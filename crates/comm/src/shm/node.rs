//! One process's end of a node's shared segment: agreement on each collective, and the
//! all-reduce (whole, or split into its reduce-scatter and all-gather halves for the
//! hierarchical path) in blocks through the segment.
//!
//! # Phases
//! Every rank runs the same sequence of *phases*, numbered from 1 and counted across
//! collectives. In phase `q` a rank writes its slot `q % SLOTS` (and, for an agreement, its
//! descriptor), then sets its `phase` counter to `q`, then waits until every local rank did.
//! After phase `q` it may read what the peers wrote in phase `q`. A slot written in phase `q`
//! is read in phase `q` (after the wait) and `q + 1`, and rewritten in phase `q + 3`, when every
//! peer is past phase `q + 2` (the wait of phase `q + 2`): no slot is written while read.
//!
//! An all-reduce of `B` blocks is `B + 1` phases: the first carries the descriptor and block 0's
//! input (where the whole job is one node, it *is* the agreement: nobody reads the input before
//! the descriptors agree); phase `1 + s` reduces this rank's chunk of block `s` (from its own
//! buffer and the peers' slots of the phase before) into its buffer and its slot, writes block
//! `s + 1`'s input into the next slot, and after the wait copies the peers' reduced chunks of
//! block `s` out of their slots. One handshake per block.

use std::hint::spin_loop;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use super::segment::{
    chunk, futex_wait, futex_wake_all, Control, DescSlot, CONTROL_BYTES, MAX_NAP, MAX_REASON_BYTES, MAX_TAG_BYTES,
    NOT_IN_HEAP, SLOTS, SLOT_BYTES,
};
use crate::desc::{first_mismatch, validate, OpDesc};
use crate::kernels::{finish_into, reduce_range, Element};
use crate::{CommError, ReduceOp};

/// How long a waiter polls before it sleeps when a collective starts: a peer a few
/// microseconds behind is caught without a system call; a peer that is still computing is
/// waited for asleep.
const SPIN: Duration = Duration::from_micros(20);
/// How long a waiter polls between two phases of one collective: its peers are in the same
/// collective, at most a block or so behind (about 100 µs per 1 MiB block here). Sleeping
/// there cost a futex wake-up per block, and a woken rank starts the next block late, so its
/// peer sleeps in turn: at 16-64 MiB, 2 ranks slept in 20-45% of the phases with the
/// arrival's 20 µs spin, and in 0.2-4% with a 300 µs to 1 ms poll (BENCHMARKS.md). Past
/// [`SPIN`] the poll yields the core between looks, so a compute thread bound to the same core
/// (mpirun binds a rank's threads to one core) runs instead: the DDP step of the reference
/// MLP and GPT under mpirun was no slower (0.98-1.0x), where a plain spin made the GPT's 2-4%
/// slower. A peer later than this (descheduled) is waited for asleep, as before.
const BLOCK_SPIN: Duration = Duration::from_micros(500);

/// How a rank left the node (the value of its `dead` flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Death {
    /// In the middle of a collective (a timeout, an MPI error).
    Broken = 1,
    /// Between collectives (its communicator was dropped).
    Closed = 2,
}

/// One local rank's view of the node's segment (see the module docs).
pub(crate) struct ShmNode {
    /// Base of each local rank's region, local rank order.
    regions: Vec<*mut u8>,
    /// This process's local rank.
    me: usize,
    /// World rank of each local rank (errors name world ranks).
    world_ranks: Vec<usize>,
    timeout: Duration,
    /// Phases this rank finished (the same count on every local rank: they agree on every
    /// length, so they run the same phases).
    phase: u64,
    /// Every local rank's shared heap as this process maps it, `(base, bytes)` in local rank
    /// order (`crate::heap`), when all of them have one.
    heaps: Option<Vec<(*mut u8, usize)>>,
    /// All-reduces that ran in place in the ranks' heaps.
    in_place: u64,
    /// Every local rank's buffer, as this process maps it, when the last
    /// [`ShmNode::reduce_scatter_f32`] ran in place: its [`ShmNode::all_gather_f32`] then
    /// writes into them directly.
    gather_into: Option<Vec<*mut u8>>,
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
            phase: 0,
            heaps: None,
            in_place: 0,
            gather_into: None,
        }
    }

    /// Gives the node every local rank's shared heap, `(base, bytes)` in local rank order as
    /// this process maps them: an all-reduce whose buffers all lie in them runs in place.
    ///
    /// # Safety
    /// Every heap stays mapped for the node's lifetime, and every local rank's node gets the
    /// same heaps (each mapped in its own process), or none does.
    pub(crate) unsafe fn with_heaps(mut self, heaps: Vec<(*mut u8, usize)>) -> Self {
        debug_assert_eq!(heaps.len(), self.regions.len());
        self.heaps = Some(heaps);
        self
    }

    /// Whether the node has every local rank's heap.
    pub(crate) fn has_heaps(&self) -> bool {
        self.heaps.is_some()
    }

    /// All-reduces so far that ran in place in the ranks' heaps.
    pub(crate) fn in_place_count(&self) -> u64 {
        self.in_place
    }

    /// Where `bytes` bytes at `data` lie in this rank's heap.
    fn own_heap_offset(&self, data: *const u8, bytes: usize) -> u64 {
        let Some(heaps) = &self.heaps else { return NOT_IN_HEAP };
        let (base, len) = heaps[self.me];
        let off = (data as usize).wrapping_sub(base as usize);
        if off < len && bytes <= len - off {
            off as u64
        } else {
            NOT_IN_HEAP
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

    /// Slot `slot` of local rank `rank`, as elements of `E`.
    fn slot<E>(&self, rank: usize, slot: usize) -> *mut E {
        // SAFETY: in bounds of the region (`new`).
        unsafe { self.regions[rank].add(CONTROL_BYTES + slot * SLOT_BYTES).cast() }
    }

    /// Runs the next phase: `write(self, slot)` fills this rank's part of it (its slot
    /// `slot`, its descriptor), then the phase is published and every local rank's awaited.
    /// Returns the phase's number.
    fn run_phase(
        &mut self,
        tag: &str,
        deadline: Instant,
        spin: Duration,
        write: impl FnOnce(&Self, usize),
    ) -> Result<u64, CommError> {
        let q = self.phase + 1;
        write(self, (q % SLOTS as u64) as usize);
        self.phase = q;
        self.control(self.me).phase.0.store(q, SeqCst);
        let head = self.control(0);
        if head.sleepers.0.load(SeqCst) > 0 {
            head.doorbell.0.fetch_add(1, SeqCst);
            futex_wake_all(&head.doorbell.0);
        }
        self.wait_all(q, tag, deadline, spin)?;
        Ok(q)
    }

    /// Spins (for `spin`: briefly, then yielding the core between looks), then sleeps on the
    /// doorbell until every local rank finished phase `q`;
    /// fails when a peer is dead (readiness is checked first: a peer that finished its part
    /// and then left fails no one) or at `deadline` (this rank then declares itself dead, so
    /// that its peers fail at once rather than at their own deadlines).
    fn wait_all(&self, q: u64, tag: &str, deadline: Instant, spin: Duration) -> Result<(), CommError> {
        let ready = || (0..self.size()).all(|r| self.control(r).phase.0.load(SeqCst) >= q);
        if ready() {
            return Ok(());
        }
        let start = Instant::now();
        loop {
            for _ in 0..64 {
                spin_loop();
            }
            if ready() {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= spin {
                break;
            }
            if waited >= SPIN {
                std::thread::yield_now();
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
                    Some(Err(self.give_up(q, tag)))
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
    fn give_up(&self, q: u64, tag: &str) -> CommError {
        let missing: Vec<usize> = (0..self.size())
            .filter(|&r| self.control(r).phase.0.load(SeqCst) < q)
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
            // SAFETY: only this rank writes its note, and peers read it only once `dead` is set.
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

    /// Writes only the heap offset of this rank's descriptor of phase `q` (a collective
    /// agreed on elsewhere).
    fn write_heap_offset(&self, q: u64, heap_offset: u64) {
        // SAFETY: as in `write_desc`.
        unsafe { (*self.control(self.me).descs.get())[(q % 2) as usize].heap_offset = heap_offset };
    }

    /// Writes this rank's descriptor of phase `q`'s collective.
    fn write_desc(&self, q: u64, desc: &OpDesc, tag: &str, heap_offset: u64) {
        let tag_bytes = &tag.as_bytes()[..tag.len().min(MAX_TAG_BYTES)];
        // SAFETY: peers read this rank's descriptor of this parity only after it publishes
        // phase `q`, and none still reads the one of phase `q - 2` (module docs).
        unsafe {
            let slot: &mut DescSlot = &mut (*self.control(self.me).descs.get())[(q % 2) as usize];
            slot.bytes = desc.encode();
            slot.heap_offset = heap_offset;
            slot.tag[..tag_bytes.len()].copy_from_slice(tag_bytes);
            slot.tag_len = tag_bytes.len() as u32;
        }
    }

    /// The verdict every local rank reaches from the descriptors of phase `q`: a mismatch
    /// naming both ranks and tags, or whether the collective can run on `world` ranks.
    fn verdict(&self, q: u64, tag: &str, world: usize) -> Result<(), CommError> {
        let mut descs = Vec::with_capacity(self.size());
        let mut tags = Vec::with_capacity(self.size());
        for r in 0..self.size() {
            // SAFETY: published with phase `q`, which every rank finished.
            let slot: &DescSlot = unsafe { &(*self.control(r).descs.get())[(q % 2) as usize] };
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

    /// Agrees on a collective that moves no data through the segment: every local rank
    /// publishes its descriptor and tag, and all reach the same verdict (see
    /// [`ShmNode::verdict`]). Passing it is also a barrier.
    pub(crate) fn agree(&mut self, desc: &OpDesc, tag: &str, world: usize, deadline: Instant) -> Result<(), CommError> {
        self.check_peers(tag)?;
        let q = self.run_phase(tag, deadline, SPIN, |node, _| {
            node.write_desc(node.phase + 1, desc, tag, NOT_IN_HEAP)
        })?;
        self.verdict(q, tag, world)
    }

    /// A collective with a dead peer can never complete (and the dead one may have finished
    /// the phase it died in).
    fn check_peers(&self, tag: &str) -> Result<(), CommError> {
        match self.first_dead(tag) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Copies the parts of a block (`m` elements at `data`) that the peers reduce into slot
    /// `slot` of this rank.
    ///
    /// # Safety
    /// `data` is valid for `m` reads; the slot is this rank's to write in this phase.
    unsafe fn share<E: Element>(&self, data: *const E, m: usize, slot: usize) {
        let size = self.size();
        let mine = self.slot::<E>(self.me, slot);
        for r in (0..size).filter(|&r| r != self.me) {
            let (a, b) = chunk(m, size, r);
            // SAFETY: in bounds of both; nobody reads this slot before the phase is published.
            unsafe { std::ptr::copy_nonoverlapping(data.add(a), mine.add(a), b - a) };
        }
    }

    /// Reduces this rank's chunk `a..b` of a block over its own input `own` and the peers'
    /// slot `slot`, into `dsts` (offset to the chunk's start).
    ///
    /// # Safety
    /// The peers' slot holds the block's input (published in an awaited phase); `own` and every
    /// `dsts` pointer hold the chunk, which nobody else touches meanwhile.
    unsafe fn reduce_chunk<E: Element, O: Element>(
        &self,
        own: *const E,
        slot: usize,
        (a, b): (usize, usize),
        dsts: &[*mut O],
        op: ReduceOp,
        divisor: f32,
    ) {
        let srcs: Vec<*const E> = (0..self.size())
            .map(|r| {
                let base = if r == self.me {
                    own
                } else {
                    self.slot::<E>(r, slot).cast_const()
                };
                // SAFETY: `a` is within the block, hence within both buffers.
                unsafe { base.add(a) }
            })
            .collect();
        // SAFETY: the caller's contract.
        unsafe { reduce_range(&srcs, dsts, 0, b - a, op, divisor) };
    }

    /// Copies the peers' chunks of a block (`m` elements at `data`) from their slot `slot`.
    ///
    /// # Safety
    /// The peers' chunks are final in that slot (an awaited phase); `data` is valid for `m`
    /// writes and nobody else touches it.
    unsafe fn fetch<E: Element>(&self, data: *mut E, m: usize, slot: usize) {
        let size = self.size();
        for r in (0..size).filter(|&r| r != self.me) {
            let (a, b) = chunk(m, size, r);
            // SAFETY: the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(self.slot::<E>(r, slot).add(a), data.add(a), b - a) };
        }
    }

    /// Agrees on an all-reduce (see [`ShmNode::agree`]) and runs it: `data` (`n` elements) is
    /// reduced in place over the local ranks with f32 accumulation in local rank order
    /// (`Avg` divides by `divisor`), block by block through the segment. Block 0's input
    /// travels with the descriptor; nobody reads it unless all agree.
    ///
    /// # Safety
    /// `data` is valid for `n` reads and writes and used by nobody else during the call.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn all_reduce<E: Element>(
        &mut self,
        desc: &OpDesc,
        data: *mut E,
        n: usize,
        op: ReduceOp,
        divisor: f32,
        tag: &str,
        world: usize,
        deadline: Instant,
    ) -> Result<(), CommError> {
        self.check_peers(tag)?;
        let per_block = SLOT_BYTES / std::mem::size_of::<E>();
        let blocks = n.div_ceil(per_block);
        let block = |s: usize| (s * per_block, per_block.min(n - s * per_block));
        let in_heap = self.own_heap_offset(data.cast_const().cast(), n * std::mem::size_of::<E>());
        let first = self.run_phase(tag, deadline, SPIN, |node, slot| {
            node.write_desc(node.phase + 1, desc, tag, in_heap);
            if blocks > 0 && in_heap == NOT_IN_HEAP {
                // SAFETY: block 0 is within `data`; the slot is ours in this phase.
                unsafe { node.share(data.cast_const(), block(0).1, slot) };
            }
        })?;
        self.verdict(first, tag, world)?;
        let offsets = self.heap_offsets(first);
        if blocks == 0 {
            return Ok(());
        }
        if offsets.iter().all(|&o| o != NOT_IN_HEAP) {
            // SAFETY: every rank's buffer is final (it published the phase) and lies in its
            // heap; every rank reads the same offsets and runs the same branch.
            return unsafe { self.reduce_in_place::<E>(&offsets, n, op, divisor, tag, deadline) };
        }
        // Some rank's buffer is not in its heap: through the slots. A rank whose buffer is in
        // its heap held block 0 back: every rank shares it now.
        let first = if offsets.iter().any(|&o| o != NOT_IN_HEAP) {
            self.run_phase(tag, deadline, BLOCK_SPIN, |node, slot| {
                // SAFETY: as above.
                unsafe { node.share(data.cast_const(), block(0).1, slot) }
            })?
        } else {
            first
        };
        let size = self.size();
        for s in 0..blocks {
            let (lo, m) = block(s);
            let input = ((first + s as u64) % SLOTS as u64) as usize;
            let (a, b) = chunk(m, size, self.me);
            // SAFETY: `lo + m <= n`; block s's input is in every peer's slot `input` (the phase
            // before, awaited); our chunk of `data` and of our slot `input` are ours alone.
            unsafe {
                let own = data.add(lo);
                self.run_phase(tag, deadline, BLOCK_SPIN, |node, next| {
                    let dsts = [own.add(a), node.slot::<E>(node.me, input).add(a)];
                    node.reduce_chunk(own.cast_const(), input, (a, b), &dsts, op, divisor);
                    if s + 1 < blocks {
                        let (next_lo, next_m) = block(s + 1);
                        node.share(data.add(next_lo).cast_const(), next_m, next);
                    }
                })?;
                self.fetch(own, m, input);
            }
        }
        Ok(())
    }

    /// Every local rank's heap offset in its descriptor of phase `q`.
    fn heap_offsets(&self, q: u64) -> Vec<u64> {
        (0..self.size())
            .map(|r| {
                // SAFETY: published with phase `q`, which every rank finished.
                unsafe { (*self.control(r).descs.get())[(q % 2) as usize].heap_offset }
            })
            .collect()
    }

    /// Every local rank's buffer of `n` elements of `E`, at `offsets` in the ranks' heaps, as
    /// this process maps them; an error if one does not lie inside its heap (every rank reads
    /// the same offsets, so all fail alike).
    fn heap_buffers<E: Element>(&self, offsets: &[u64], n: usize, tag: &str) -> Result<Vec<*mut E>, CommError> {
        let heaps = self.heaps.as_ref().expect("offsets are only set with heaps");
        let bytes = n * std::mem::size_of::<E>();
        let mut ptrs = Vec::with_capacity(offsets.len());
        for (r, (&off, &(base, len))) in offsets.iter().zip(heaps).enumerate() {
            let off = off as usize;
            if off > len || bytes > len - off || off % std::mem::align_of::<E>() != 0 {
                return Err(CommError::Internal(format!(
                    "rank {}: rank {}'s buffer of collective `{tag}` ({bytes} bytes at offset {off}) is not \
                     inside its shared heap of {len} bytes",
                    self.world_ranks[self.me], self.world_ranks[r]
                )));
            }
            // SAFETY: inside the heap, which is mapped (`with_heaps`).
            ptrs.push(unsafe { base.add(off) }.cast());
        }
        Ok(ptrs)
    }

    /// The all-reduce in place, as the thread backend runs it: every rank's buffer (`n`
    /// elements at `offsets` in the ranks' heaps) is visible here, so this rank reduces its
    /// chunk over all of them and writes the result into all of them, then waits for the others
    /// to have done the same. Each rank reads and writes about one buffer's bytes, a memcpy's.
    ///
    /// # Safety
    /// Every rank agreed on this all-reduce (same `n`, `E`, `op`) with these offsets, and its
    /// buffer stays untouched by anyone else until it returns.
    unsafe fn reduce_in_place<E: Element>(
        &mut self,
        offsets: &[u64],
        n: usize,
        op: ReduceOp,
        divisor: f32,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let ptrs: Vec<*mut E> = self.heap_buffers::<E>(offsets, n, tag)?;
        let srcs: Vec<*const E> = ptrs.iter().map(|p| p.cast_const()).collect();
        let (a, b) = chunk(n, self.size(), self.me);
        // SAFETY: chunk `a..b` of every buffer is this rank's alone until the phase below.
        unsafe { reduce_range(&srcs, &ptrs, a, b, op, divisor) };
        self.run_phase(tag, deadline, BLOCK_SPIN, |_, _| {})?;
        self.in_place += 1;
        Ok(())
    }

    /// The first half of a hierarchical all-reduce (agreed on beforehand): reduces `data` (`n`
    /// elements) over the local ranks with `op` (`Avg` sums: the division comes at the end),
    /// keeping this rank's chunk of every block, unrounded, in `shard` (blocks in order).
    ///
    /// # Safety
    /// `data` is valid for `n` reads; every local rank calls this with the same `n`, `E`, `op`.
    pub(crate) unsafe fn reduce_scatter_f32<E: Element>(
        &mut self,
        data: *const E,
        n: usize,
        op: ReduceOp,
        shard: &mut Vec<f32>,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        self.check_peers(tag)?;
        let per_block = SLOT_BYTES / std::mem::size_of::<E>();
        let blocks = n.div_ceil(per_block);
        let block = |s: usize| (s * per_block, per_block.min(n - s * per_block));
        let combine = if op == ReduceOp::Max {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        let size = self.size();
        shard.clear();
        shard.resize(
            (0..blocks)
                .map(|s| {
                    let (a, b) = chunk(block(s).1, size, self.me);
                    b - a
                })
                .sum(),
            0.0,
        );
        self.gather_into = None;
        if blocks == 0 {
            return Ok(());
        }
        let in_heap = self.own_heap_offset(data.cast(), n * std::mem::size_of::<E>());
        let first = self.run_phase(tag, deadline, SPIN, |node, slot| {
            node.write_heap_offset(node.phase + 1, in_heap);
            if in_heap == NOT_IN_HEAP {
                // SAFETY: block 0 is within `data`; the slot is ours in this phase.
                unsafe { node.share(data, block(0).1, slot) }
            }
        })?;
        let offsets = self.heap_offsets(first);
        if offsets.iter().all(|&o| o != NOT_IN_HEAP) {
            // In place: this rank's chunk of every block, straight from every rank's buffer
            // (final: all published the phase), in the slots' shard layout (nodes may differ
            // in which way they take; the shards they reduce across nodes must not).
            let ptrs = self.heap_buffers::<E>(&offsets, n, tag)?;
            let mut pos = 0;
            for s in 0..blocks {
                let (lo, m) = block(s);
                let (a, b) = chunk(m, size, self.me);
                // SAFETY: chunk `a..b` of block `s` is read by this rank alone, and `shard`
                // holds `b - a` elements from `pos`.
                unsafe {
                    let srcs: Vec<*const E> = ptrs.iter().map(|p| p.add(lo + a).cast_const()).collect();
                    reduce_range(&srcs, &[shard.as_mut_ptr().add(pos)], 0, b - a, combine, 1.0);
                }
                pos += b - a;
            }
            self.gather_into = Some(ptrs.into_iter().map(|p| p.cast()).collect());
            return Ok(());
        }
        let first = if offsets.iter().any(|&o| o != NOT_IN_HEAP) {
            // Some rank held block 0 back (its buffer is in its heap): all share it now.
            // SAFETY: as above.
            self.run_phase(tag, deadline, BLOCK_SPIN, |node, slot| unsafe {
                node.share(data, block(0).1, slot)
            })?
        } else {
            first
        };
        let mut pos = 0;
        for s in 0..blocks {
            let (lo, m) = block(s);
            let input = ((first + s as u64) % SLOTS as u64) as usize;
            let (a, b) = chunk(m, size, self.me);
            // SAFETY: as in `all_reduce`; `shard` holds `b - a` elements from `pos`.
            unsafe {
                let out = [shard.as_mut_ptr().add(pos)];
                self.run_phase(tag, deadline, BLOCK_SPIN, |node, next| {
                    node.reduce_chunk(data.add(lo), input, (a, b), &out, combine, 1.0);
                    if s + 1 < blocks {
                        let (next_lo, next_m) = block(s + 1);
                        node.share(data.add(next_lo), next_m, next);
                    }
                })?;
            }
            pos += b - a;
        }
        Ok(())
    }

    /// The second half of a hierarchical all-reduce: every local rank's `shard` (from
    /// [`ShmNode::reduce_scatter_f32`] on the same `n`, then reduced across nodes) rounded
    /// into its place in `data`, divided by `divisor` for `Avg`.
    ///
    /// # Safety
    /// `data` is valid for `n` writes and used by nobody else during the call; every local
    /// rank calls this with the same `n`, `E` and `op`.
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
        self.check_peers(tag)?;
        let per_block = SLOT_BYTES / std::mem::size_of::<E>();
        let size = self.size();
        if let Some(ptrs) = self.gather_into.take() {
            // In place: this rank's chunk of every block, rounded once into its own buffer and
            // copied into every peer's (nobody else writes these chunks), then one phase.
            let (mut lo, mut pos) = (0, 0);
            while lo < n {
                let m = per_block.min(n - lo);
                let (a, b) = chunk(m, size, self.me);
                // SAFETY: `ptrs` are every rank's buffer of `n` elements of `E` (from the
                // reduce-scatter of this all-reduce); chunk `a..b` of this block is ours.
                unsafe {
                    let own = std::slice::from_raw_parts_mut(data.add(lo + a), b - a);
                    finish_into(&shard[pos..pos + (b - a)], own, op, divisor);
                    for (r, &p) in ptrs.iter().enumerate() {
                        if r != self.me {
                            std::ptr::copy_nonoverlapping(own.as_ptr(), p.cast::<E>().add(lo + a), b - a);
                        }
                    }
                }
                pos += b - a;
                lo += m;
            }
            self.run_phase(tag, deadline, BLOCK_SPIN, |_, _| {})?;
            self.in_place += 1;
            return Ok(());
        }
        let (mut lo, mut pos) = (0, 0);
        while lo < n {
            let m = per_block.min(n - lo);
            let (a, b) = chunk(m, size, self.me);
            let part = &shard[pos..pos + (b - a)];
            pos += b - a;
            // SAFETY: our chunk of `data`'s block and of our slot are ours in this phase; after
            // it, the peers' chunks are final in their slot of the phase.
            unsafe {
                let block = data.add(lo);
                let spin = if lo == 0 { SPIN } else { BLOCK_SPIN };
                let q = self.run_phase(tag, deadline, spin, |node, slot| {
                    let out = std::slice::from_raw_parts_mut(block.add(a), b - a);
                    finish_into(part, out, op, divisor);
                    std::ptr::copy_nonoverlapping(out.as_ptr(), node.slot::<E>(node.me, slot).add(a), b - a);
                })?;
                self.fetch(block, m, (q % SLOTS as u64) as usize);
            }
            lo += m;
        }
        Ok(())
    }
}
