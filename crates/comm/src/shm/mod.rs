//! Collectives through a shared-memory segment between the processes of one node, as the
//! thread backend does between the threads of one process.
//!
//! The segment is mapped by every local rank (the MPI backend gets it from
//! `MPI_Win_allocate_shared` over the node's communicator); [`ShmNode`] is one process's view
//! of it and knows nothing of MPI.
//!
//! # One collective
//! 1. **Agree**: each rank writes its descriptor and tag into its control block and bumps its
//!    `arrived` counter; once every local rank arrived, each reads all descriptors and reaches
//!    the same verdict (a mismatch names both ranks and both tags, before any data moves).
//! 2. **Blocks** (all-reduce): the buffer is cut into blocks of one data half. For block `g`,
//!    each rank copies the parts the others reduce into its half `g % 2` (`published`), reduces
//!    its own part over its own input and the peers' halves in local rank order with f32
//!    accumulation, writes the result into its input and its half (`reduced`), and copies the
//!    peers' results out of their halves (`done`). A rank refills a half only once every rank
//!    is `done` with the block before last, so ranks run up to one block apart and a block's
//!    trip through the segment stays in the caches: each rank's memory traffic is about one
//!    read and one write of its buffer, a memcpy's.
//!
//!    **In place** instead, when every rank's buffer lies in its shared heap (`crate::heap`,
//!    mapped by every local rank: the descriptor carries the buffer's offset there): rank `r`
//!    reduces chunk `r` of every rank's buffer and writes it into all of them, then one more
//!    phase ends the collective. No block goes through the slots.
//! 3. The hierarchical all-reduce splits step 2: [`ShmNode::reduce_scatter_f32`] keeps each
//!    rank's part unrounded in f32, the caller reduces it across nodes, and
//!    [`ShmNode::all_gather_f32`] rounds it once and hands every rank the whole result. Both run
//!    in place when every local rank's buffer is in its heap (the reduce-scatter's first phase
//!    carries the offsets), in the same shard layout as through the slots, so that nodes that
//!    took different ways still reduce matching shards between them.
//!
//! # Waiting and failure
//! A waiter spins for a few microseconds when a collective starts (between the blocks of one,
//! where the peers are in the same collective, it then goes on polling for up to half a
//! millisecond, yielding its core between looks), then sleeps on a futex (the
//! node's doorbell, rung by whoever moves a counter while someone sleeps), so a rank that
//! arrived early gives its core back to compute. Every wait ends at the collective's deadline with
//! [`crate::CommError::Timeout`]; the rank then marks itself dead in its control block, with
//! the reason, and its peers fail at once with [`crate::CommError::RankFailed`]. A killed
//! process marks nothing: its peers time out (or are ended by the launcher first).

mod moves;
mod node;
mod segment;

pub(crate) use node::{Death, ShmNode};
pub(crate) use segment::REGION_BYTES;

#[cfg(test)]
mod tests;
