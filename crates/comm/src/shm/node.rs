//! One process's end of a node's shared segment: its phases, waits and deaths, and agreement
//! on each collective. How a collective's data moves (through the slots, or in place in the
//! ranks' heaps) is `moves.rs`.
//!
//! # Phases
//! Every rank runs the same sequence of *phases*, numbered from 1 and counted across
//! collectives. In phase `q` a rank writes its slot `q % SLOTS` (and, for an agreement, its
//! descriptor), then sets its `phase` counter to `q`, then waits until every local rank did.
//! After phase `q` it may read what the peers wrote in phase `q`. A slot written in phase `q`
//! is read in phase `q` (after the wait) and `q + 1`, and rewritten in phase `q + 3`, when every
//! peer is past phase `q + 2` (the wait of phase `q + 2`): no slot is written while read.

use std::hint::spin_loop;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use super::segment::{
    futex_wait, futex_wake_all, Control, DescSlot, CONTROL_BYTES, MAX_NAP, MAX_REASON_BYTES, MAX_TAG_BYTES,
    NOT_IN_HEAP, SLOTS, SLOT_BYTES,
};
use crate::collective::{first_mismatch, validate, OpDesc};
use crate::heap::offset_in;
use crate::CommError;

/// How long a waiter polls before it sleeps when a collective starts: a peer a few
/// microseconds behind is caught without a system call; a peer that is still computing is
/// waited for asleep.
pub(super) const SPIN: Duration = Duration::from_micros(20);
/// How long a waiter polls between two phases of one collective: its peers are in the same
/// collective, at most a block or so behind (about 100 µs per 1 MiB block here). Sleeping
/// there cost a futex wake-up per block, and a woken rank starts the next block late, so its
/// peer sleeps in turn: at 16-64 MiB, 2 ranks slept in 20-45% of the phases with the
/// arrival's 20 µs spin, and in 0.2-4% with a 300 µs to 1 ms poll (BENCHMARKS.md). Past
/// [`SPIN`] the poll yields the core between looks, so a compute thread bound to the same core
/// (mpirun binds a rank's threads to one core) runs instead: the DDP step of the reference
/// MLP and GPT under mpirun was no slower (0.98-1.0x), where a plain spin made the GPT's 2-4%
/// slower. A peer later than this (descheduled) is waited for asleep, as before.
pub(super) const BLOCK_SPIN: Duration = Duration::from_micros(500);

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
    pub(super) regions: Vec<*mut u8>,
    /// This process's local rank.
    pub(super) me: usize,
    /// World rank of each local rank (errors name world ranks).
    pub(super) world_ranks: Vec<usize>,
    pub(super) timeout: Duration,
    /// Phases this rank finished (the same count on every local rank: they agree on every
    /// length, so they run the same phases).
    pub(super) phase: u64,
    /// Every local rank's shared heap as this process maps it, `(base, bytes)` in local rank
    /// order (`crate::heap`), when all of them have one.
    pub(super) heaps: Option<Vec<(*mut u8, usize)>>,
    /// All-reduces that ran in place in the ranks' heaps.
    pub(super) in_place: u64,
    /// Every local rank's buffer, as this process maps it, when the last
    /// [`ShmNode::reduce_scatter_f32`] ran in place: its [`ShmNode::all_gather_f32`] then
    /// writes into them directly.
    pub(super) gather_into: Option<Vec<*mut u8>>,
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
    pub(super) fn own_heap_offset(&self, data: *const u8, bytes: usize) -> u64 {
        let Some(heaps) = &self.heaps else { return NOT_IN_HEAP };
        let (base, len) = heaps[self.me];
        offset_in(base, len, data, bytes).map_or(NOT_IN_HEAP, |off| off as u64)
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

    pub(super) fn control(&self, rank: usize) -> &Control {
        // SAFETY: every region starts with a `Control`, mapped for our lifetime (`new`).
        unsafe { &*(self.regions[rank] as *const Control) }
    }

    /// Slot `slot` of local rank `rank`, as elements of `E`.
    pub(super) fn slot<E>(&self, rank: usize, slot: usize) -> *mut E {
        // SAFETY: in bounds of the region (`new`).
        unsafe { self.regions[rank].add(CONTROL_BYTES + slot * SLOT_BYTES).cast() }
    }

    /// Runs the next phase: `write(self, slot)` fills this rank's part of it (its slot
    /// `slot`, its descriptor), then the phase is published and every local rank's awaited.
    /// Returns the phase's number.
    pub(super) fn run_phase(
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
    pub(super) fn write_heap_offset(&self, q: u64, heap_offset: u64) {
        // SAFETY: as in `write_desc`.
        unsafe { (*self.control(self.me).descs.get())[(q % 2) as usize].heap_offset = heap_offset };
    }

    /// Writes this rank's descriptor of phase `q`'s collective.
    pub(super) fn write_desc(&self, q: u64, desc: &OpDesc, tag: &str, heap_offset: u64) {
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
    pub(super) fn verdict(&self, q: u64, tag: &str, world: usize) -> Result<(), CommError> {
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
    pub(super) fn check_peers(&self, tag: &str) -> Result<(), CommError> {
        match self.first_dead(tag) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}
