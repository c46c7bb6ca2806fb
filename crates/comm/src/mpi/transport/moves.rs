//! Step 2 of a slot: the data, through the node's segment, MPI's blocking collectives, or both
//! (hierarchical; see the parent module).

use std::ffi::{c_int, c_void};
use std::time::Instant;

use ::mpi::ffi;
use half::{bf16, f16};

use super::MpiTransport;
use crate::collective::{OpDesc, OpKind};
use crate::kernels::{finish_into, Element};
use crate::mpi::raw::{self, mpi_check};
use crate::{Buffer, CommError, ReduceOp};

impl MpiTransport {
    /// Step 2: the collective on the data. Every rank runs the same branch (the descriptors
    /// agree).
    pub(super) fn move_data(
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
            Buffer::F64(_) | Buffer::I64(_) | Buffer::U8(_) | Buffer::I8(_) => {
                unreachable!("validate rejects reductions on f64 and the integer types")
            }
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
            Buffer::F64(_) | Buffer::I64(_) | Buffer::U8(_) | Buffer::I8(_) => {
                unreachable!("validate rejects reductions on f64 and the integer types")
            }
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
            Buffer::F64(_) | Buffer::I64(_) | Buffer::U8(_) | Buffer::I8(_) => {
                unreachable!("validate rejects reductions on f64 and the integer types")
            }
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

/// Copies a reduction's input into `send` as f32 (f16/bf16 are reduced with f32
/// accumulation).
fn stage_f32(send: &mut Vec<f32>, buf: &Buffer) {
    send.clear();
    match buf {
        Buffer::F32(v) => send.extend_from_slice(v),
        Buffer::F16(v) => send.extend(v.iter().map(|x| f16::to_f32(*x))),
        Buffer::BF16(v) => send.extend(v.iter().map(|x| bf16::to_f32(*x))),
        Buffer::F64(_) | Buffer::I64(_) | Buffer::U8(_) | Buffer::I8(_) => {
            unreachable!("validate rejects reductions on f64 and the integer types")
        }
    }
}
