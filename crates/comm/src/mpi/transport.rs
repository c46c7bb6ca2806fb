//! The MPI backend's transport: every collective is a non-blocking MPI collective that the comm
//! stream's thread polls to completion, so that no call ever blocks past the timeout.
//!
//! # One slot, two MPI collectives
//! 1. **Agree**: an `MPI_Iallgather` of a 40-byte descriptor (kind, dtype, length, op, root,
//!    tag hash, slot) from every rank. If they differ, every rank sees it, all-gathers the tags
//!    to name them, and every rank fails the slot with [`CommError::Mismatch`] before any data
//!    moves; the communicator stays usable. This costs one small all-gather per collective (a
//!    few microseconds over shared memory, one network round trip between hosts).
//! 2. **Move**: the collective itself on the rank's buffer, through scratch buffers owned by the
//!    transport (MPI's in-place mode is not portable through the bindings): f32 reductions copy
//!    the input once; f16/bf16 reductions convert to f32, reduce in f32, and convert back, so
//!    they accumulate in f32 like the thread backend. `Avg` is an MPI sum divided by the world
//!    size; `Max` is a user operator that propagates NaN (`nan_max`, as the thread backend).
//!
//! # Progress and timeouts
//! Open MPI advances a non-blocking collective only inside MPI calls, so the comm thread polls
//! `MPI_Test`: it spins for a few microseconds (short collectives), then yields the core
//! between polls (so that compute threads keep running while a long all-reduce is on the
//! wire), then sleeps briefly between polls (a peer that is late by milliseconds). A collective
//! that has not completed by the deadline fails with [`CommError::Timeout`]. MPI cannot cancel
//! a collective: its buffers are leaked (MPI may still write them) and the transport is broken
//! for good: every later collective fails at once with [`CommError::RankFailed`] naming this
//! rank, as a thread-backend rank that timed out declares itself dead. An MPI error is
//! reported as [`CommError::Internal`] and breaks the transport the same way.

use std::ffi::c_int;
use std::hint::spin_loop;
use std::time::{Duration, Instant};

use ::mpi::ffi;
use half::{bf16, f16};

use super::desc::{first_mismatch, validate, OpDesc, OpKind, DESC_BYTES};
use super::raw::{self, mpi_check, RawComm, RawOp};
use super::world::LiveGuard;
use crate::stream::Transport;
use crate::{Buffer, CommError, ReduceOp};

/// Busy polling lasts this long: collectives of a few KiB complete within it.
const SPIN: Duration = Duration::from_micros(50);
/// Then each poll yields the core, until the collective has run this long.
const YIELD: Duration = Duration::from_millis(20);
/// Then the thread sleeps this long between polls.
const NAP: Duration = Duration::from_micros(100);
/// Longest tag text shown in a mismatch error.
const MAX_TAG_BYTES: usize = 256;

/// One rank's end of an MPI communicator (a duplicate of `MPI_COMM_WORLD`): the [`Transport`]
/// of the MPI backend, made by [`super::MpiWorld::transport`] and driven by a
/// [`crate::CommStream`], whose thread is then the only one that calls MPI through it.
pub struct MpiTransport {
    comm: Option<RawComm>,
    rank: usize,
    world: usize,
    timeout: Duration,
    slot: u64,
    max_op: Option<RawOp>,
    /// Scratch: the f32 input of a reduction.
    send: Vec<f32>,
    /// Scratch: the f32 output of an f16/bf16 reduction or of a reduce-scatter.
    recv: Vec<f32>,
    /// Scratch: the input of an all-gather.
    bytes: Vec<u8>,
    /// Scratch: this rank's descriptor, and everyone's.
    desc_send: Vec<u8>,
    desc_recv: Vec<u8>,
    /// Why the transport can no longer be used (a collective timed out or MPI failed).
    broken: Option<String>,
    _live: LiveGuard,
}

impl MpiTransport {
    pub(crate) fn new(
        comm: RawComm,
        rank: usize,
        world: usize,
        timeout: Duration,
        live: LiveGuard,
    ) -> Result<Self, CommError> {
        let max_op = Some(RawOp::max_f32(rank)?);
        Ok(MpiTransport {
            comm: Some(comm),
            rank,
            world,
            timeout,
            slot: 0,
            max_op,
            send: Vec::new(),
            recv: Vec::new(),
            bytes: Vec::new(),
            desc_send: Vec::new(),
            desc_recv: Vec::new(),
            broken: None,
            _live: live,
        })
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
        let result = self
            .agree(&desc, tag, deadline)
            .and_then(|()| self.move_data(kind, buf.as_deref_mut(), tag, deadline));
        if let Err(err @ (CommError::Timeout { .. } | CommError::Internal(_))) = &result {
            self.break_down(err, buf);
        }
        result
    }

    /// MPI may still write every buffer of the failed collective: leak them, and refuse every
    /// later collective.
    fn break_down(&mut self, err: &CommError, buf: Option<&mut Buffer>) {
        self.broken = Some(format!("its MPI communicator is unusable after: {err}"));
        std::mem::forget(std::mem::take(&mut self.send));
        std::mem::forget(std::mem::take(&mut self.recv));
        std::mem::forget(std::mem::take(&mut self.bytes));
        std::mem::forget(std::mem::take(&mut self.desc_send));
        std::mem::forget(std::mem::take(&mut self.desc_recv));
        if let Some(buf) = buf {
            let dtype = buf.dtype();
            std::mem::forget(std::mem::replace(
                buf,
                Buffer::zeros(dtype, 0).unwrap_or(Buffer::U8(Vec::new())),
            ));
        }
    }

    /// Step 1: all-gathers the descriptors and checks them.
    fn agree(&mut self, desc: &OpDesc, tag: &str, deadline: Instant) -> Result<(), CommError> {
        self.desc_send.clear();
        self.desc_send.extend_from_slice(&desc.encode());
        self.desc_recv.resize(self.world * DESC_BYTES, 0);
        let (send, recv) = (self.desc_send.as_ptr(), self.desc_recv.as_mut_ptr());
        let req = self.post("MPI_Iallgather(descriptor)", |comm, req| unsafe {
            ffi::MPI_Iallgather(
                send.cast(),
                DESC_BYTES as c_int,
                ffi::RSMPI_UINT8_T,
                recv.cast(),
                DESC_BYTES as c_int,
                ffi::RSMPI_UINT8_T,
                comm,
                req,
            )
        })?;
        self.wait(req, "MPI_Iallgather(descriptor)", tag, deadline)?;
        let descs = self
            .desc_recv
            .chunks(DESC_BYTES)
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
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(found_rank) = first_mismatch(&descs) {
            let tags = self.gather_tags(&descs, tag, deadline)?;
            return Err(CommError::Mismatch {
                tag: tags[0].clone(),
                slot: descs[0].slot,
                expected_rank: 0,
                expected: descs[0].describe(&tags[0]),
                found_rank,
                found: descs[found_rank].describe(&tags[found_rank]),
            });
        }
        validate(&descs[0], self.world, tag)
    }

    /// After a mismatch (every rank saw it): all-gathers every rank's tag text, padded to the
    /// longest (at most [`MAX_TAG_BYTES`]).
    fn gather_tags(&mut self, descs: &[OpDesc], tag: &str, deadline: Instant) -> Result<Vec<String>, CommError> {
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
        self.desc_send.clear();
        self.desc_send.extend_from_slice(&mine);
        self.desc_recv.clear();
        self.desc_recv.resize(self.world * width, 0);
        let (send, recv) = (self.desc_send.as_ptr(), self.desc_recv.as_mut_ptr());
        let req = self.post("MPI_Iallgather(tags)", |comm, req| unsafe {
            ffi::MPI_Iallgather(
                send.cast(),
                width as c_int,
                ffi::RSMPI_UINT8_T,
                recv.cast(),
                width as c_int,
                ffi::RSMPI_UINT8_T,
                comm,
                req,
            )
        })?;
        self.wait(req, "MPI_Iallgather(tags)", tag, deadline)?;
        Ok((0..self.world)
            .map(|r| {
                let raw = &self.desc_recv[r * width..(r + 1) * width];
                let n = (descs[r].tag_len as usize).min(width);
                String::from_utf8_lossy(&raw[..n]).into_owned()
            })
            .collect())
    }

    /// Step 2: the collective on the data. Every rank runs the same branch (the descriptors
    /// agree).
    fn move_data(
        &mut self,
        kind: OpKind,
        buf: Option<&mut Buffer>,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let Some(buf) = buf else {
            let req = self.post("MPI_Ibarrier", |comm, req| unsafe { ffi::MPI_Ibarrier(comm, req) })?;
            return self.wait(req, "MPI_Ibarrier", tag, deadline);
        };
        let len = count(buf.len(), tag)?;
        if len == 0 {
            // Same on every rank (the lengths agree). Empty `Vec`s have dangling addresses
            // that MPI may take for aliasing or for `MPI_IN_PLACE` (address 1 in Open MPI).
            return Ok(());
        }
        let dt = raw::datatype(buf.dtype());
        match kind {
            OpKind::AllReduce(op) => self.all_reduce_data(buf, op, tag, deadline),
            OpKind::ReduceScatter(op) => self.reduce_scatter_data(buf, op, tag, deadline),
            OpKind::Broadcast { root } => {
                let ptr = buf.as_mut_ptr();
                let req = self.post("MPI_Ibcast", |comm, req| unsafe {
                    ffi::MPI_Ibcast(ptr.cast(), len, dt, root as c_int, comm, req)
                })?;
                self.wait(req, "MPI_Ibcast", tag, deadline)
            }
            OpKind::AllGather => {
                let bytes = buf.byte_len();
                self.bytes.clear();
                // SAFETY: `buf` holds `bytes` initialized bytes.
                self.bytes
                    .extend_from_slice(unsafe { std::slice::from_raw_parts(buf.as_ptr(), bytes) });
                buf.resize(buf.len() * self.world);
                let (send, recv) = (self.bytes.as_ptr(), buf.as_mut_ptr());
                let req = self.post("MPI_Iallgather", |comm, req| unsafe {
                    ffi::MPI_Iallgather(send.cast(), len, dt, recv.cast(), len, dt, comm, req)
                })?;
                self.wait(req, "MPI_Iallgather", tag, deadline)
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

    fn all_reduce_data(
        &mut self,
        buf: &mut Buffer,
        op: ReduceOp,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let n = buf.len();
        let mpi_op = self.mpi_op(op);
        stage_f32(&mut self.send, buf);
        let out: *mut f32 = match buf {
            Buffer::F32(v) => v.as_mut_ptr(),
            _ => {
                self.recv.resize(n, 0.0);
                self.recv.as_mut_ptr()
            }
        };
        let send = self.send.as_ptr();
        let req = self.post("MPI_Iallreduce", |comm, req| unsafe {
            ffi::MPI_Iallreduce(
                send.cast(),
                out.cast(),
                n as c_int,
                raw::f32_datatype(),
                mpi_op,
                comm,
                req,
            )
        })?;
        self.wait(req, "MPI_Iallreduce", tag, deadline)?;
        let world = self.world as f32;
        match buf {
            Buffer::F32(v) => finish_f32(v, op, world),
            Buffer::F16(v) => finish_half(&mut self.recv, v, op, world),
            Buffer::BF16(v) => finish_half(&mut self.recv, v, op, world),
            Buffer::U8(_) | Buffer::I8(_) => unreachable!("validate rejects reductions on u8 and i8"),
        }
        Ok(())
    }

    fn reduce_scatter_data(
        &mut self,
        buf: &mut Buffer,
        op: ReduceOp,
        tag: &str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let chunk = buf.len() / self.world;
        let mpi_op = self.mpi_op(op);
        stage_f32(&mut self.send, buf);
        self.recv.resize(chunk, 0.0);
        let (send, recv) = (self.send.as_ptr(), self.recv.as_mut_ptr());
        let req = self.post("MPI_Ireduce_scatter_block", |comm, req| unsafe {
            ffi::MPI_Ireduce_scatter_block(
                send.cast(),
                recv.cast(),
                chunk as c_int,
                raw::f32_datatype(),
                mpi_op,
                comm,
                req,
            )
        })?;
        self.wait(req, "MPI_Ireduce_scatter_block", tag, deadline)?;
        let world = self.world as f32;
        match buf {
            Buffer::F32(v) => {
                v.truncate(chunk);
                v.copy_from_slice(&self.recv);
                finish_f32(v, op, world);
            }
            Buffer::F16(v) => {
                v.truncate(chunk);
                finish_half(&mut self.recv, v, op, world);
            }
            Buffer::BF16(v) => {
                v.truncate(chunk);
                finish_half(&mut self.recv, v, op, world);
            }
            Buffer::U8(_) | Buffer::I8(_) => unreachable!("validate rejects reductions on u8 and i8"),
        }
        Ok(())
    }

    /// Starts a non-blocking MPI call on this transport's communicator.
    fn post(
        &self,
        what: &str,
        call: impl FnOnce(ffi::MPI_Comm, *mut ffi::MPI_Request) -> c_int,
    ) -> Result<ffi::MPI_Request, CommError> {
        // SAFETY: reading a constant handle; the call overwrites it.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        mpi_check!(self.rank, what, call(self.comm(), &mut req))?;
        Ok(req)
    }

    /// Polls `req` until it completes or `deadline` passes (see the module docs).
    fn wait(&self, mut req: ffi::MPI_Request, what: &str, tag: &str, deadline: Instant) -> Result<(), CommError> {
        let start = Instant::now();
        loop {
            let mut done: c_int = 0;
            mpi_check!(self.rank, what, unsafe {
                ffi::MPI_Test(&mut req, &mut done, ffi::RSMPI_STATUS_IGNORE)
            })?;
            if done != 0 {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    tag: tag.to_string(),
                    after: self.timeout,
                });
            }
            let waited = now - start;
            if waited < SPIN {
                for _ in 0..32 {
                    spin_loop();
                }
            } else if waited < YIELD {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP);
            }
        }
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

/// `Avg` divides the f32 sum by the world size, as the thread backend does.
fn finish_f32(v: &mut [f32], op: ReduceOp, world: f32) {
    if op == ReduceOp::Avg {
        v.iter_mut().for_each(|x| *x /= world);
    }
}

/// A 16-bit float type reduced through f32.
trait Half: Copy {
    fn from_f32(x: f32) -> Self;
}

impl Half for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Half for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Writes the f32 result `acc` (divided for `Avg`) into the 16-bit buffer `out`, rounding once.
fn finish_half<H: Half>(acc: &mut [f32], out: &mut [H], op: ReduceOp, world: f32) {
    finish_f32(acc, op, world);
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = H::from_f32(*a);
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
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        // A broken transport may have a collective pending on its communicator and operator:
        // those are leaked, not freed under MPI's feet.
        if self.broken.is_none() {
            if let Some(comm) = self.comm.take() {
                comm.free();
            }
            if let Some(op) = self.max_op.take() {
                op.free();
            }
        }
    }
}

/// Copies a reduction's input into `send` as f32 (f16/bf16 are reduced with f32
/// accumulation).
fn stage_f32(send: &mut Vec<f32>, buf: &Buffer) {
    send.clear();
    match buf {
        Buffer::F32(v) => send.extend_from_slice(v),
        Buffer::F16(v) => send.extend(v.iter().map(|x| x.to_f32())),
        Buffer::BF16(v) => send.extend(v.iter().map(|x| x.to_f32())),
        Buffer::U8(_) | Buffer::I8(_) => unreachable!("validate rejects reductions on u8 and i8"),
    }
}
