//! NCCL as a process group: [`super::DeviceGroup`] over an NCCL communicator built on a second
//! stream of the bucket's GPU. Every reducer policy runs there unchanged (see `device.rs`):
//! its compute on the comm stream behind the bucket's ready event, its all-reduces,
//! reduce-scatters and all-gathers as NCCL calls on device memory (comm's raw handles,
//! [`DeviceSpan`]), the step behind the done events.

use std::time::Duration;

use brigade_comm::nccl::{NcclComm, NcclId};
use brigade_comm::{DeviceSpan, RawStream, ReduceOp};
use brigade_tensor::{Device, Storage, Stream, Tensor};

use super::{DeviceGroup, ProcessGroup, TensorWork};
use crate::DdpError;

/// Buckets reduced by their policy's collectives on NCCL, on a comm stream of their GPU,
/// ordered by events (see [`DeviceGroup`]).
pub type NcclGroup = DeviceGroup<NcclComm>;

impl DeviceGroup<NcclComm> {
    /// Rank `rank` of `world_size` joins the NCCL communicator `id` on CUDA device `device`,
    /// with a new comm stream of that device (the NCCL communicator runs there); the compute
    /// stream is the device's. Blocks until every rank joined (at most `timeout`).
    pub fn join(
        device: Device,
        rank: usize,
        world_size: usize,
        id: NcclId,
        timeout: Duration,
    ) -> crate::Result<NcclGroup> {
        let Device::Cuda(ordinal) = device else {
            return Err(DdpError::Cuda {
                rank,
                during: "joining NCCL".into(),
                detail: format!("the buckets live on {device}: NCCL reduces GPU memory (use --device cuda)"),
            });
        };
        let comm_stream = Stream::new(device)?;
        // SAFETY: `comm_stream` is a live stream of device `ordinal`, and it outlives the
        // communicator: both live in the stream's shared state, the communicator dropped first.
        let comm = unsafe {
            NcclComm::new(
                ordinal,
                RawStream(comm_stream.raw_handle()),
                rank,
                world_size,
                id,
                timeout,
            )?
        };
        DeviceGroup::from_parts(comm, device, comm_stream)
    }
}

/// A storage lent out of `t` for the duration of `f` (given the storage's memory as used on
/// `stream`), always restored.
fn with_span<R>(
    rank: usize,
    t: &Tensor,
    stream: &Stream,
    f: impl FnOnce(&Storage, DeviceSpan) -> crate::Result<R>,
) -> crate::Result<R> {
    let Device::Cuda(ordinal) = t.device() else {
        return Err(DdpError::Cuda {
            rank,
            during: "handing a tensor to NCCL".into(),
            detail: format!("{} is not GPU memory", t.device()),
        });
    };
    let storage = t.lend_storage()?;
    let r = storage.device_memory(stream).map_err(DdpError::from).and_then(|mem| {
        let span = DeviceSpan {
            ptr: mem.ptr,
            len: mem.len,
            dtype: mem.dtype,
            ordinal,
        };
        f(&storage, span)
    });
    t.restore_storage(storage)?;
    r
}

/// The work of a collective NCCL enqueued (or failed to), completing with `out`.
fn enqueued(comm: &NcclComm, tag: &str, out: &Tensor, r: crate::Result<()>) -> TensorWork<Tensor> {
    let rank = comm.rank();
    TensorWork::ready(rank, tag, comm.timeout(), r.map(|()| out.clone()))
}

/// NCCL serves the collective contract on device memory: each method enqueues on the current
/// stream (the comm stream the communicator was built on, inside `DeviceGroup`'s scope), and
/// its work completes once enqueued.
impl ProcessGroup for NcclComm {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }

    fn world_size(&self) -> usize {
        NcclComm::world_size(self)
    }

    fn timeout(&self) -> Duration {
        NcclComm::timeout(self)
    }

    fn check(&self) -> crate::Result<()> {
        Ok(NcclComm::check(self)?)
    }

    fn all_reduce(&self, buf: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let r = Stream::current(buf.device())
            .map_err(DdpError::from)
            .and_then(|stream| {
                with_span(NcclComm::rank(self), buf, &stream, |_, span| {
                    // SAFETY: `span` is `buf`'s whole memory on the communicator's GPU, lent out of
                    // the tensor (nobody else writes it) and, once restored, kept alive by the tensor
                    // the reduction holds until the compute stream waited on the bucket's done event;
                    // the comm stream is behind the event that ordered the caller's writes. Outside a
                    // bucket (ZeRO-3's gathers) a buffer dropped before the caller's stream waited on the
                    // done event is freed behind it: `device_memory` noted its use on the comm stream.
                    unsafe { Ok(self.all_reduce_device(span, op, None, None, tag)?) }
                })
            });
        enqueued(self, tag, buf, r)
    }

    fn reduce_scatter_into(&self, send: &Tensor, recv: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let rank = NcclComm::rank(self);
        let r = Stream::current(send.device())
            .map_err(DdpError::from)
            .and_then(|stream| {
                with_span(rank, send, &stream, |_, s| {
                    with_span(rank, recv, &stream, |_, r| {
                        // SAFETY: as in `all_reduce`, for two distinct storages.
                        unsafe { Ok(self.reduce_scatter_device(s, r, op, None, None, tag)?) }
                    })
                })
            });
        enqueued(self, tag, recv, r)
    }

    fn all_gather_into(&self, send: &Tensor, recv: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let rank = NcclComm::rank(self);
        let r = Stream::current(send.device())
            .map_err(DdpError::from)
            .and_then(|stream| {
                with_span(rank, send, &stream, |_, s| {
                    with_span(rank, recv, &stream, |_, r| {
                        // SAFETY: as in `all_reduce`, for two distinct storages.
                        unsafe { Ok(self.all_gather_device(s, r, None, None, tag)?) }
                    })
                })
            });
        enqueued(self, tag, recv, r)
    }
}
