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

use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

use ::mpi::ffi;
use half::{bf16, f16};

use super::node::{NodePath, Topology};
use super::raw::{self, mpi_check, RawComm, RawOp};
use super::watchdog::Watchdog;
use super::world::LiveGuard;
use crate::desc::{all_agree, first_mismatch, validate, OpDesc, OpKind, DESC_BYTES};
use crate::heap;
use crate::kernels::{finish_into, Element};
use crate::shm::Death;
use crate::stream::Transport;
use crate::{Buffer, CommError, DType, ReduceOp};

/// Longest tag text shown in a mismatch error.
const MAX_TAG_BYTES: usize = 256;

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
                if node.single_node() && !matches!(buf.dtype(), DType::U8 | DType::I8) =>
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
                        Buffer::U8(_) | Buffer::I8(_) => unreachable!("matched above"),
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

    /// Step 1: every rank learns whether all issued the same collective, and whether it can
    /// run.
    fn agree(&mut self, desc: &OpDesc, tag: &str, deadline: Instant) -> Result<(), CommError> {
        if let Some(node) = self.node.as_mut().filter(|n| n.single_node()) {
            return node.shm.agree(desc, tag, self.world, deadline);
        }
        let mut words = desc.agreement_words();
        let comm = self.comm.as_ref().expect("communicator present until drop");
        self.guarded(desc, tag, "MPI_Allreduce(descriptor)", deadline, || {
            comm.all_reduce_u64(self.rank, &mut words, raw::band_op(), "MPI_Allreduce(descriptor)")
        })?;
        if all_agree(&words) {
            return validate(desc, self.world, tag);
        }
        let descs = self.gather_descriptors(desc, tag, deadline)?;
        let found_rank = first_mismatch(&descs).ok_or_else(|| {
            CommError::Internal(format!(
                "rank {}: the descriptor words of collective `{tag}` differ but the descriptors do not",
                self.rank
            ))
        })?;
        let tags = self.gather_tags(desc, &descs, tag, deadline)?;
        Err(CommError::Mismatch {
            tag: tags[0].clone(),
            slot: descs[0].slot,
            expected_rank: 0,
            expected: descs[0].describe(&tags[0]),
            found_rank,
            found: descs[found_rank].describe(&tags[found_rank]),
        })
    }

    /// After a disagreement (every rank saw it): all-gathers every rank's `width` bytes.
    fn all_gather_bytes(
        &mut self,
        desc: &OpDesc,
        mine: &[u8],
        tag: &str,
        what: &'static str,
        deadline: Instant,
    ) -> Result<Vec<u8>, CommError> {
        let width = mine.len();
        let mut all = vec![0u8; self.world * width];
        let (send, recv, comm, rank) = (mine.as_ptr(), all.as_mut_ptr(), self.comm(), self.rank);
        self.guarded(desc, tag, what, deadline, || {
            mpi_check!(rank, what, unsafe {
                ffi::MPI_Allgather(
                    send.cast(),
                    width as c_int,
                    ffi::RSMPI_UINT8_T,
                    recv.cast(),
                    width as c_int,
                    ffi::RSMPI_UINT8_T,
                    comm,
                )
            })
        })?;
        Ok(all)
    }

    fn gather_descriptors(&mut self, desc: &OpDesc, tag: &str, deadline: Instant) -> Result<Vec<OpDesc>, CommError> {
        let all = self.all_gather_bytes(desc, &desc.encode(), tag, "MPI_Allgather(descriptors)", deadline)?;
        all.chunks(DESC_BYTES)
            .enumerate()
            .map(|(r, b)| {
                OpDesc::decode(b).ok_or_else(|| {
                    CommError::Internal(format!(
                        "rank {}: rank {r} sent an unreadable descriptor in collective `{tag}` \
                         (a different Brigade build?)",
                        self.rank
                    ))
                })
            })
            .collect()
    }

    /// Every rank's tag text, padded to the longest (at most [`MAX_TAG_BYTES`]).
    fn gather_tags(
        &mut self,
        desc: &OpDesc,
        descs: &[OpDesc],
        tag: &str,
        deadline: Instant,
    ) -> Result<Vec<String>, CommError> {
        let width = descs
            .iter()
            .map(|d| d.tag_len as usize)
            .max()
            .unwrap_or(0)
            .min(MAX_TAG_BYTES);
        if width == 0 {
            return Ok(vec![String::new(); self.world]);
        }
        let mut mine = tag.as_bytes()[..tag.len().min(width)].to_vec();
        mine.resize(width, 0);
        let all = self.all_gather_bytes(desc, &mine, tag, "MPI_Allgather(tags)", deadline)?;
        Ok((0..self.world)
            .map(|r| {
                let raw = &all[r * width..(r + 1) * width];
                let n = (descs[r].tag_len as usize).min(width);
                String::from_utf8_lossy(&raw[..n]).into_owned()
            })
            .collect())
    }

    /// Step 2: the collective on the data. Every rank runs the same branch (the descriptors
    /// agree).
    fn move_data(
        &mut self,
        desc: &OpDesc,
        buf: Option<&mut Buffer>,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        // A barrier is its agreement.
        let Some(buf) = buf else { return Ok(()) };
        let len = count(buf.len(), tag)?;
        if len == 0 {
            // Same on every rank (the lengths agree). Empty `Vec`s have dangling addresses
            // that MPI may take for aliasing or for `MPI_IN_PLACE` (address 1 in Open MPI).
            return Ok(());
        }
        let dt = raw::datatype(buf.dtype());
        let (rank, comm) = (self.rank, self.comm());
        match desc.kind {
            OpKind::AllReduce(op) if self.node.is_some() => self.all_reduce_node(desc, buf, op, tag, deadline),
            OpKind::AllReduce(op) => self.all_reduce_mpi(desc, buf, op, tag, deadline),
            OpKind::ReduceScatter(op) => self.reduce_scatter_data(desc, buf, op, tag, deadline),
            OpKind::Broadcast { root } => {
                let ptr = buf.as_mut_ptr();
                self.guarded(desc, tag, "MPI_Bcast", deadline, || {
                    mpi_check!(rank, "MPI_Bcast", unsafe {
                        ffi::MPI_Bcast(ptr.cast(), len, dt, root as c_int, comm)
                    })
                })
            }
            OpKind::AllGather => {
                let n = buf.len();
                buf.resize(n * self.world);
                if self.rank > 0 {
                    buf.copy_within(0, n, self.rank * n);
                }
                let recv = buf.as_mut_ptr();
                let send = match raw::in_place() {
                    Some(in_place) => in_place,
                    None => {
                        let esize = buf.dtype().size_in_bytes();
                        // SAFETY: `buf` holds world * n elements; this rank's are at rank * n.
                        let own =
                            unsafe { std::slice::from_raw_parts(buf.as_ptr().add(self.rank * n * esize), n * esize) };
                        self.bytes.clear();
                        self.bytes.extend_from_slice(own);
                        self.bytes.as_ptr().cast::<c_void>()
                    }
                };
                self.guarded(desc, tag, "MPI_Allgather", deadline, || {
                    mpi_check!(rank, "MPI_Allgather", unsafe {
                        ffi::MPI_Allgather(send, len, dt, recv.cast(), len, dt, comm)
                    })
                })
            }
            OpKind::Barrier => unreachable!("a barrier has no buffer"),
        }
    }

    fn mpi_op(&self, op: ReduceOp) -> ffi::MPI_Op {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => raw::sum_op(),
            ReduceOp::Max => self.max_op.as_ref().expect("operator present until drop").0,
        }
    }

    /// Blocking `MPI_Allreduce` of `n` f32s at `data` on `comm`, in place when the library's
    /// `MPI_IN_PLACE` is known (otherwise out of a copy in `send`).
    #[allow(clippy::too_many_arguments)]
    fn mpi_all_reduce_f32(
        &mut self,
        desc: &OpDesc,
        comm: ffi::MPI_Comm,
        data: *mut f32,
        n: usize,
        op: ReduceOp,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (mpi_op, rank) = (self.mpi_op(op), self.rank);
        let send: *const c_void = match raw::in_place() {
            Some(in_place) => in_place,
            None => {
                self.send.clear();
                // SAFETY: `data` holds `n` f32s.
                self.send
                    .extend_from_slice(unsafe { std::slice::from_raw_parts(data, n) });
                self.send.as_ptr().cast()
            }
        };
        self.guarded(desc, tag, "MPI_Allreduce", deadline, || {
            mpi_check!(rank, "MPI_Allreduce", unsafe {
                ffi::MPI_Allreduce(send, data.cast(), n as c_int, raw::f32_datatype(), mpi_op, comm)
            })
        })
    }

    /// The flat path: MPI's all-reduce over every rank.
    fn all_reduce_mpi(
        &mut self,
        desc: &OpDesc,
        buf: &mut Buffer,
        op: ReduceOp,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (n, world, comm) = (buf.len(), self.world as f32, self.comm());
        match buf {
            Buffer::F32(v) => {
                self.mpi_all_reduce_f32(desc, comm, v.as_mut_ptr(), n, op, tag, deadline)?;
                if op == ReduceOp::Avg {
                    v.iter_mut().for_each(|x| *x /= world);
                }
            }
            Buffer::F16(_) | Buffer::BF16(_) => {
                let mut acc = std::mem::take(&mut self.recv);
                stage_f32(&mut acc, buf);
                let result = self.mpi_all_reduce_f32(desc, comm, acc.as_mut_ptr(), n, op, tag, deadline);
                if result.is_ok() {
                    match buf {
                        Buffer::F16(v) => finish_into(&acc, v, op, world),
                        Buffer::BF16(v) => finish_into(&acc, v, op, world),
                        _ => unreachable!(),
                    }
                    self.recv = acc;
                } else {
                    std::mem::forget(acc); // MPI may still write it
                }
                result?;
            }
            Buffer::U8(_) | Buffer::I8(_) => unreachable!("validate rejects reductions on u8 and i8"),
        }
        Ok(())
    }

    /// Across nodes: through the node's segment and over MPI (hierarchical).
    fn all_reduce_node(
        &mut self,
        desc: &OpDesc,
        buf: &mut Buffer,
        op: ReduceOp,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        match buf {
            Buffer::F32(v) => self.hierarchical(desc, v, op, tag, deadline),
            Buffer::F16(v) => self.hierarchical(desc, v, op, tag, deadline),
            Buffer::BF16(v) => self.hierarchical(desc, v, op, tag, deadline),
            Buffer::U8(_) | Buffer::I8(_) => unreachable!("validate rejects reductions on u8 and i8"),
        }
    }

    /// Reduce-scatter in the node, all-reduce of the f32 shard across nodes, all-gather in the
    /// node.
    fn hierarchical<E: Element>(
        &mut self,
        desc: &OpDesc,
        data: &mut [E],
        op: ReduceOp,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (n, world) = (data.len(), self.world as f32);
        let node = self.node.as_mut().expect("hierarchical runs with a node");
        let mut shard = std::mem::take(&mut node.shard);
        // SAFETY: as in `all_reduce_node`.
        unsafe {
            node.shm
                .reduce_scatter_f32(data.as_ptr(), n, op, &mut shard, tag, deadline)?
        };
        let cross = node
            .cross
            .as_ref()
            .expect("hierarchical runs with a cross communicator")
            .0;
        let result = self.mpi_all_reduce_f32(desc, cross, shard.as_mut_ptr(), shard.len(), op, tag, deadline);
        if let Err(err) = result {
            std::mem::forget(shard); // MPI may still write it
            return Err(err);
        }
        let node = self.node.as_mut().expect("hierarchical runs with a node");
        // SAFETY: as above; every local rank's shard comes from the same `n`.
        let result = unsafe {
            node.shm
                .all_gather_f32(&shard, data.as_mut_ptr(), n, op, world, tag, deadline)
        };
        node.shard = shard;
        result
    }

    fn reduce_scatter_data(
        &mut self,
        desc: &OpDesc,
        buf: &mut Buffer,
        op: ReduceOp,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let chunk = buf.len() / self.world;
        let (mpi_op, rank, comm) = (self.mpi_op(op), self.rank, self.comm());
        stage_f32(&mut self.send, buf);
        self.recv.resize(chunk, 0.0);
        let (send, recv) = (self.send.as_ptr(), self.recv.as_mut_ptr());
        self.guarded(desc, tag, "MPI_Reduce_scatter_block", deadline, || {
            mpi_check!(rank, "MPI_Reduce_scatter_block", unsafe {
                ffi::MPI_Reduce_scatter_block(
                    send.cast(),
                    recv.cast(),
                    chunk as c_int,
                    raw::f32_datatype(),
                    mpi_op,
                    comm,
                )
            })
        })?;
        let world = self.world as f32;
        match buf {
            Buffer::F32(v) => {
                v.truncate(chunk);
                finish_into(&self.recv, v, op, world);
            }
            Buffer::F16(v) => {
                v.truncate(chunk);
                finish_into(&self.recv, v, op, world);
            }
            Buffer::BF16(v) => {
                v.truncate(chunk);
                finish_into(&self.recv, v, op, world);
            }
            Buffer::U8(_) | Buffer::I8(_) => unreachable!("validate rejects reductions on u8 and i8"),
        }
        Ok(())
    }
}

/// An element count as MPI's `int`; lengths agree on every rank, so every rank fails alike.
fn count(len: usize, tag: &str) -> Result<c_int, CommError> {
    c_int::try_from(len).map_err(|_| {
        CommError::InvalidArgument(format!(
            "collective `{tag}`: {len} elements exceed MPI's count limit {}; split the buffer",
            c_int::MAX
        ))
    })
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
    std::mem::forget(std::mem::replace(
        buf,
        Buffer::zeros(dtype, 0).unwrap_or(Buffer::U8(Vec::new())),
    ));
}

/// Copies a reduction's input into `send` as f32 (f16/bf16 are reduced with f32
/// accumulation).
fn stage_f32(send: &mut Vec<f32>, buf: &Buffer) {
    send.clear();
    match buf {
        Buffer::F32(v) => send.extend_from_slice(v),
        Buffer::F16(v) => send.extend(v.iter().map(|x| f16::to_f32(*x))),
        Buffer::BF16(v) => send.extend(v.iter().map(|x| bf16::to_f32(*x))),
        Buffer::U8(_) | Buffer::I8(_) => unreachable!("validate rejects reductions on u8 and i8"),
    }
}
