//! How a collective's data moves between the ranks of a node: in blocks through the
//! segment's slots, or in place in the ranks' shared heaps (`crate::heap`) when every buffer
//! lies there. The phases, waits and agreement they run on are `node.rs`.
//!
//! An all-reduce of `B` blocks is `B + 1` phases: the first carries the descriptor and block 0's
//! input (where the whole job is one node, it *is* the agreement: nobody reads the input before
//! the descriptors agree); phase `1 + s` reduces this rank's chunk of block `s` (from its own
//! buffer and the peers' slots of the phase before) into its buffer and its slot, writes block
//! `s + 1`'s input into the next slot, and after the wait copies the peers' reduced chunks of
//! block `s` out of their slots. One handshake per block.
//!
//! In place, an all-reduce is two phases: the first carries the descriptor and the buffer's
//! offset in its heap, the second ends the collective after every rank reduced its chunk of
//! every rank's buffer into all of them.

use std::time::Instant;

use super::node::{ShmNode, BLOCK_SPIN, SPIN};
use super::segment::{chunk, NOT_IN_HEAP, SLOTS, SLOT_BYTES};
use crate::collective::OpDesc;
use crate::kernels::{finish_into, reduce_range, Element};
use crate::{CommError, ReduceOp};

/// How `n` elements of `E` go through the slots: the number of blocks, and block `s`'s
/// `(start, length)`.
fn blocks_of<E>(n: usize) -> (usize, impl Fn(usize) -> (usize, usize)) {
    let per_block = SLOT_BYTES / std::mem::size_of::<E>();
    (n.div_ceil(per_block), move |s| {
        (s * per_block, per_block.min(n - s * per_block))
    })
}

/// The elements of `n` that rank `me` of `size` reduces: its chunk of every block.
fn shard_len<E>(n: usize, size: usize, me: usize) -> usize {
    let (blocks, block) = blocks_of::<E>(n);
    (0..blocks)
        .map(|s| {
            let (a, b) = chunk(block(s).1, size, me);
            b - a
        })
        .sum()
}

impl ShmNode {
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
        let (blocks, block) = blocks_of::<E>(n);
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
        // Some rank's buffer is not in its heap: through the slots.
        // SAFETY: block 0 is within `data`.
        let first = unsafe { self.input_phase(first, &offsets, data.cast_const(), block(0).1, tag, deadline)? };
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

    /// The phase whose slots hold block 0's input (its first `m0` elements at `data`), on the
    /// way through the slots after a first phase `first` with these heap offsets: `first`,
    /// unless a rank whose buffer is in its heap held block 0 back there; then every rank shares
    /// it in one more phase.
    ///
    /// # Safety
    /// `data` is valid for `m0` reads.
    unsafe fn input_phase<E: Element>(
        &mut self,
        first: u64,
        offsets: &[u64],
        data: *const E,
        m0: usize,
        tag: &str,
        deadline: Instant,
    ) -> Result<u64, CommError> {
        if offsets.iter().all(|&o| o == NOT_IN_HEAP) {
            return Ok(first);
        }
        // SAFETY: the caller's contract; the slot is ours in this phase.
        self.run_phase(tag, deadline, BLOCK_SPIN, |node, slot| unsafe {
            node.share(data, m0, slot)
        })
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
    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
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
        let (blocks, block) = blocks_of::<E>(n);
        let combine = if op == ReduceOp::Max {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        let size = self.size();
        shard.clear();
        shard.resize(shard_len::<E>(n, size, self.me), 0.0);
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
        // SAFETY: block 0 is within `data`.
        let first = unsafe { self.input_phase(first, &offsets, data, block(0).1, tag, deadline)? };
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
        let (blocks, block) = blocks_of::<E>(n);
        let size = self.size();
        if let Some(ptrs) = self.gather_into.take() {
            // In place: this rank's chunk of every block, rounded once into its own buffer and
            // copied into every peer's (nobody else writes these chunks), then one phase.
            let mut pos = 0;
            for s in 0..blocks {
                let (lo, m) = block(s);
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
            }
            self.run_phase(tag, deadline, BLOCK_SPIN, |_, _| {})?;
            self.in_place += 1;
            return Ok(());
        }
        let mut pos = 0;
        for s in 0..blocks {
            let (lo, m) = block(s);
            let (a, b) = chunk(m, size, self.me);
            let part = &shard[pos..pos + (b - a)];
            pos += b - a;
            // SAFETY: our chunk of `data`'s block and of our slot are ours in this phase; after
            // it, the peers' chunks are final in their slot of the phase.
            unsafe {
                let own = data.add(lo);
                let spin = if s == 0 { SPIN } else { BLOCK_SPIN };
                let q = self.run_phase(tag, deadline, spin, |node, slot| {
                    let out = std::slice::from_raw_parts_mut(own.add(a), b - a);
                    finish_into(part, out, op, divisor);
                    std::ptr::copy_nonoverlapping(out.as_ptr(), node.slot::<E>(node.me, slot).add(a), b - a);
                })?;
                self.fetch(own, m, (q % SLOTS as u64) as usize);
            }
        }
        Ok(())
    }
}
