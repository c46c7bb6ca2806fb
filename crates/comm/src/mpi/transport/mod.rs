//! The MPI backend's transport: each collective is agreed on, then moved through the node's
//! shared segment, MPI's blocking collectives, or both (hierarchical), on the comm stream's
//! thread (or on a caller's thread that waits for the collective while the stream is idle: one
//! thread at a time either way).
//!
//! # One slot
//! 1. **Agree** (before any data moves): every rank compares its descriptor (kind, dtype,
//!    length, op, root, tag hash) with everyone's. On one node with the shared segment this
//!    happens in the segment; otherwise it is one blocking `MPI_Allreduce` with `MPI_BAND` of
//!    8 words, whose result says whether every rank sent the same words, whatever the number of
//!    ranks. Only when they differ are the descriptors and tags all-gathered, so that every rank
//!    fails the slot with [`CommError::Mismatch`] naming both ranks; the communicator stays
//!    usable. Agreement is also the barrier.
//! 2. **Move**: an all-reduce inside one node goes through the shared segment
//!    ([`crate::shm`]), in place in the ranks' shared heaps when every buffer is a
//!    [`crate::host_vec`] there (DDP's buckets are; so do the node's steps of the hierarchy
//!    below); across nodes of equal size it is hierarchical: a reduce-scatter in the
//!    node through the segment (unrounded f32 shards), an `MPI_Allreduce` of each shard among
//!    the ranks with the same local rank on every node, an all-gather in the node through the
//!    segment. Without the segment (`BRIGADE_MPI_SHM=0`, one rank per node, nodes of unequal
//!    sizes) it is MPI's blocking `MPI_Allreduce` in place on the caller's f32 buffer (f16 and
//!    bf16 through an f32 copy, so that they accumulate in f32 like the thread backend).
//!    Broadcast, all-gather and reduce-scatter are MPI's blocking collectives. `Avg` is a sum
//!    divided by the world size; `Max` propagates NaN (`nan_max`) on every path.
//!
//! # Why blocking, and how no call waits past the timeout
//! Open MPI's non-blocking collectives (`MPI_Iallreduce`, libnbc) run other, slower algorithms
//! than its blocking ones, and polling them costs latency; `brigade bench comm --backend mpi`
//! prints both beside Brigade's. So the comm thread makes the blocking call (it is the stream's
//! own thread: the caller goes on computing; a caller that would only wait for it makes the call
//! itself, see [`crate::CommStream`]), and a [`Watchdog`] ends the job with `MPI_Abort`,
//! naming the collective and the rank, if a call outlives the collective's deadline, as
//! PyTorch's NCCL watchdog does. Waits in the shared segment return [`CommError::Timeout`]
//! instead (and mark this rank dead there, so that its node peers fail at once); the transport
//! is then broken for good: MPI may still write the buffers of a collective it did not
//! finish, so they are leaked, and every later collective fails at once with
//! [`CommError::RankFailed`] naming this rank. An MPI error is reported as
//! [`CommError::Internal`] and breaks the transport the same way.

use std::time::{Duration, Instant};

use ::mpi::ffi;

use super::node::{NodePath, Topology};
use super::raw::{RawComm, RawOp};
use super::watchdog::Watchdog;
use super::world::LiveGuard;
use crate::collective::{OpDesc, OpKind};
use crate::heap;
use crate::shm::Death;
use crate::stream::Transport;
use crate::{Buffer, CommError, DType, ReduceOp};

mod agree;
mod moves;

/// One rank's end of an MPI communicator (a duplicate of `MPI_COMM_WORLD`, and the node's
/// segment when there is one): the [`Transport`] of the MPI backend, made by
/// [`super::MpiWorld::transport`] and driven by a [`crate::CommStream`], which lets one thread
/// at a time call MPI through it (`MPI_THREAD_SERIALIZED` is enough).
pub struct MpiTransport {
    comm: Option<RawComm>,
    node: Option<NodePath>,
    topology: Topology,
    rank: usize,
    world: usize,
    timeout: Duration,
    slot: u64,
    max_op: Option<RawOp>,
    /// Scratch: f32 copies of f16/bf16 data, reduce-scatter input and output.
    send: Vec<f32>,
    recv: Vec<f32>,
    /// Scratch: descriptors and tags after a mismatch; all-gather input without in-place.
    bytes: Vec<u8>,
    bytes_out: Vec<u8>,
    watchdog: Watchdog,
    /// Why the transport can no longer be used (a collective timed out or MPI failed).
    broken: Option<String>,
    _live: LiveGuard,
}

/// How the transport's data reaches the other ranks, as [`MpiTransport::path`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiPath {
    /// All-reduce through the node's shared segment (the whole job is one node).
    SharedMemory,
    /// All-reduce in the node through the segment and across nodes over MPI.
    Hierarchical,
    /// MPI's collectives only.
    Mpi,
}

impl MpiTransport {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        comm: RawComm,
        node: Option<NodePath>,
        topology: Topology,
        rank: usize,
        world: usize,
        timeout: Duration,
        watchdog: Watchdog,
        live: LiveGuard,
    ) -> Result<Self, CommError> {
        let max_op = Some(RawOp::max_f32(rank)?);
        Ok(MpiTransport {
            comm: Some(comm),
            node,
            topology,
            rank,
            world,
            timeout,
            slot: 0,
            max_op,
            send: Vec::new(),
            recv: Vec::new(),
            bytes: Vec::new(),
            bytes_out: Vec::new(),
            watchdog,
            broken: None,
            _live: live,
        })
    }

    /// How all-reduces travel (decided when the communicator was made).
    pub fn path(&self) -> MpiPath {
        match &self.node {
            Some(node) if node.single_node() => MpiPath::SharedMemory,
            Some(_) => MpiPath::Hierarchical,
            None => MpiPath::Mpi,
        }
    }

    /// All-reduces so far that ran in place in the node's shared heaps (`crate::host_vec`
    /// buffers on every local rank; on several nodes, the node's steps of the hierarchical
    /// all-reduce): the others copied through the segment or went through MPI alone.
    pub fn in_place_all_reduces(&self) -> u64 {
        self.node.as_ref().map_or(0, |n| n.shm.in_place_count())
    }

    /// Whether this rank's node maps every local rank's shared heap (all-reduces of
    /// `crate::host_vec` buffers then run in place).
    pub fn has_shared_heaps(&self) -> bool {
        self.node.as_ref().is_some_and(|n| n.shm.has_heaps())
    }

    /// Ranks on this process's node (MPI's grouping by host, or `BRIGADE_NODE_SIZE`).
    pub fn node_size(&self) -> usize {
        self.topology.node_size
    }

    fn comm(&self) -> ffi::MPI_Comm {
        self.comm.as_ref().expect("communicator present until drop").0
    }

    /// Runs one slot: agree on the collective, then move the data.
    fn run_slot(&mut self, kind: OpKind, mut buf: Option<&mut Buffer>, tag: &str) -> Result<(), CommError> {
        if let Some(reason) = &self.broken {
            return Err(CommError::RankFailed {
                rank: self.rank,
                tag: tag.to_string(),
                reason: reason.clone(),
            });
        }
        let deadline = Instant::now() + self.timeout;
        let (dtype, len) = buf.as_ref().map_or((None, 0), |b| (Some(b.dtype()), b.len()));
        let desc = OpDesc::new(self.slot, kind, dtype, len, tag);
        self.slot += 1;
        let result = match (kind, buf.as_deref_mut(), &mut self.node) {
            // Inside one node an all-reduce agrees and moves in the same phases.
            (OpKind::AllReduce(op), Some(buf), Some(node))
                if node.single_node() && matches!(buf.dtype(), DType::F32 | DType::F16 | DType::BF16) =>
            {
                let (world, n) = (self.world, buf.len());
                let divisor = world as f32;
                // SAFETY: `buf` is ours for the call; the segment's protocol moves nothing
                // unless every local rank issued the same collective.
                unsafe {
                    match buf {
                        Buffer::F32(v) => {
                            node.shm
                                .all_reduce(&desc, v.as_mut_ptr(), n, op, divisor, tag, world, deadline)
                        }
                        Buffer::F16(v) => {
                            node.shm
                                .all_reduce(&desc, v.as_mut_ptr(), n, op, divisor, tag, world, deadline)
                        }
                        Buffer::BF16(v) => {
                            node.shm
                                .all_reduce(&desc, v.as_mut_ptr(), n, op, divisor, tag, world, deadline)
                        }
                        _ => unreachable!("matched above"),
                    }
                }
            }
            _ => self
                .agree(&desc, tag, deadline)
                .and_then(|()| self.move_data(&desc, buf.as_deref_mut(), tag, deadline)),
        };
        match &result {
            Err(err @ (CommError::Timeout { .. } | CommError::Internal(_))) => self.break_down(err, buf),
            // A peer still in the collective may write a buffer in this rank's heap: it must
            // not go back to the heap, where a later buffer would take its place.
            Err(_) => {
                if let Some(buf) = buf.filter(|b| heap::in_heap(b.as_ptr(), b.byte_len())) {
                    leak(buf);
                }
            }
            Ok(()) => {}
        }
        result
    }

    /// Calls `call` (a blocking MPI collective) under the watchdog: past `deadline` the job
    /// ends, naming the collective `desc`/`tag`, the MPI call and this rank.
    fn guarded<R>(
        &self,
        desc: &OpDesc,
        tag: &str,
        what: &'static str,
        deadline: Instant,
        call: impl FnOnce() -> R,
    ) -> R {
        let (desc, tag, rank) = (desc.clone(), tag.to_string(), self.rank);
        let _armed = self.watchdog.arm(deadline, move || {
            format!("rank {rank}: collective {} ({what})", desc.describe(&tag))
        });
        call()
    }

    /// MPI may still write every buffer of the failed collective: leak them, tell the node's
    /// peers, and refuse every later collective.
    fn break_down(&mut self, err: &CommError, buf: Option<&mut Buffer>) {
        let reason = format!("its MPI communicator is unusable after: {err}");
        if let Some(node) = &self.node {
            node.shm.mark_dead(&reason, Death::Broken);
        }
        self.broken = Some(reason);
        std::mem::forget(std::mem::take(&mut self.send));
        std::mem::forget(std::mem::take(&mut self.recv));
        std::mem::forget(std::mem::take(&mut self.bytes));
        std::mem::forget(std::mem::take(&mut self.bytes_out));
        if let Some(node) = &mut self.node {
            std::mem::forget(std::mem::take(&mut node.shard));
        }
        if let Some(buf) = buf {
            leak(buf);
        }
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError> {
        self.run_slot(OpKind::AllReduce(op), Some(buf), tag)
    }

    fn broadcast(&mut self, buf: &mut Buffer, root: usize, tag: &str) -> Result<(), CommError> {
        self.run_slot(OpKind::Broadcast { root }, Some(buf), tag)
    }

    fn all_gather(&mut self, buf: &mut Buffer, tag: &str) -> Result<(), CommError> {
        self.run_slot(OpKind::AllGather, Some(buf), tag)
    }

    fn reduce_scatter(&mut self, buf: &mut Buffer, op: ReduceOp, tag: &str) -> Result<(), CommError> {
        self.run_slot(OpKind::ReduceScatter(op), Some(buf), tag)
    }

    fn barrier(&mut self, tag: &str) -> Result<(), CommError> {
        self.run_slot(OpKind::Barrier, None, tag)
    }

    fn close(&mut self, reason: &str) {
        // The node's peers waiting for this rank in the segment fail at once.
        if let Some(node) = &self.node {
            node.shm.mark_dead(reason, Death::Closed);
        }
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        // A broken transport may have a collective pending on its communicators, operator and
        // window: those are leaked, not freed under MPI's feet. Freeing the window waits for
        // every local rank: not when one of them broke (it leaks its part and never frees).
        let node_broken = self.node.as_ref().is_some_and(|n| n.shm.any_broken());
        if self.broken.is_none() && !node_broken {
            if let Some(node) = self.node.take() {
                node.free();
            }
            if let Some(comm) = self.comm.take() {
                comm.free();
            }
            if let Some(op) = self.max_op.take() {
                op.free();
            }
        } else if let Some(node) = self.node.take() {
            std::mem::forget(node);
        }
    }
}

/// Leaves `buf`'s allocation to whoever may still write it (MPI, a peer), and `buf` empty.
fn leak(buf: &mut Buffer) {
    let dtype = buf.dtype();
    std::mem::forget(std::mem::replace(buf, Buffer::zeros(dtype, 0)));
}
