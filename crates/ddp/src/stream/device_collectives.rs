//! A device comm stream's collectives, ordered by events: every collective a policy issues on
//! a [`super::DeviceStream`] goes to the stream's backend (NCCL, or host-staged) inside a
//! scope of the comm stream, with the modelled link's delay before it when one is simulated.
//!
//! Inside a bucket's launch the comm stream is the caller's stream and already behind the
//! bucket's ready event. A collective issued outside one (ZeRO's parameter all-gather in its
//! optimizer step, a sharded gradient norm, local SGD's model averaging) is ordered the same
//! way from the issuing stream: the comm stream waits on an event recorded on the caller's
//! current stream, and the caller's stream waits on an event recorded after the collective (so
//! those collectives do not overlap the caller's next kernels).

use std::time::Duration;

use brigade_comm::{CommError, NetModel, ReduceOp, RingOp};
use brigade_tensor::{DType, Stream, Tensor};

use crate::collectives::{spans_storage, CollectiveBackend, TensorWork};
use crate::DdpError;

/// The backend `comm` on the comm stream `comm_stream`, with the simulated link's delay.
pub(super) struct DeviceCollectives<C> {
    // Dropped before the stream: NCCL's communicator borrows the comm stream.
    pub(super) comm: C,
    pub(super) comm_stream: Stream,
    pub(super) link: Option<NetModel>,
}

fn bytes(t: &Tensor) -> usize {
    t.numel() * t.dtype().size_in_bytes()
}

impl<C: CollectiveBackend> DeviceCollectives<C> {
    pub(super) fn new(comm: C, comm_stream: Stream) -> DeviceCollectives<C> {
        DeviceCollectives {
            comm,
            comm_stream,
            link: None,
        }
    }

    /// The modelled time of `op` on `bytes`, if a link is simulated (a ring of at least two).
    pub(super) fn link_delay(&self, op: RingOp, bytes: usize) -> Option<Duration> {
        let p = self.comm.world_size().max(2);
        self.link.map(|m| m.time(op, bytes, p))
    }

    pub(super) fn device_error(&self, during: String, e: impl std::fmt::Display) -> DdpError {
        DdpError::Cuda {
            rank: self.comm.rank(),
            during,
            detail: e.to_string(),
        }
    }

    /// Checks that `t` is a whole buffer on this stream's device that `op` can move.
    fn check_tensor(&self, t: &Tensor, op: RingOp, tag: &str) -> crate::Result<()> {
        let device = self.comm_stream.device();
        let float = matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
        let movable = float || (matches!(op, RingOp::AllGather) && matches!(t.dtype(), DType::U8 | DType::I8));
        if t.device() != device || !spans_storage(t) || !movable {
            return Err(self.device_error(
                format!("handing `{tag}` to {} ({op:?})", self.comm.name()),
                format!(
                    "expected a whole f32, f16 or bf16 buffer (u8 and i8 too for an all-gather) on {device}, found \
                     {} on {} ({} of {} elements)",
                    t.dtype(),
                    t.device(),
                    t.numel(),
                    t.storage_numel()
                ),
            ));
        }
        Ok(())
    }

    /// Enqueues one collective (`enqueue`, in a scope of the comm stream) moving `bytes`, ordered
    /// as the module docs say.
    fn issue(&self, op: RingOp, bytes: usize, enqueue: impl FnOnce() -> crate::Result<Tensor>) -> crate::Result<()> {
        let s = &self.comm_stream;
        let caller = Stream::current(s.device())?;
        let outside = caller != *s;
        if outside {
            s.wait_event(&caller.record_event()?)?;
        }
        if let Some(delay) = self.link_delay(op, bytes) {
            s.spin(delay)?;
        }
        s.scope(enqueue)?;
        if outside {
            caller.wait_event(&s.record_event()?)?;
        }
        Ok(())
    }

    fn done<T: Send + 'static>(&self, tag: &str, value: crate::Result<T>) -> TensorWork<T> {
        TensorWork::ready(self.rank(), tag, self.timeout(), value)
    }
}

impl<C: CollectiveBackend> CollectiveBackend for DeviceCollectives<C> {
    fn name(&self) -> &'static str {
        self.comm.name()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn timeout(&self) -> Duration {
        self.comm.timeout()
    }

    fn check(&self) -> crate::Result<()> {
        self.comm.check()
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let done = self
            .check_tensor(t, RingOp::AllReduce, tag)
            .and_then(|()| self.issue(RingOp::AllReduce, bytes(t), || self.comm.all_reduce(t, op, tag).wait()))
            .map(|()| t.clone());
        self.done(tag, done)
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let done = (|| {
            self.check_tensor(input, RingOp::ReduceScatter, tag)?;
            self.issue(RingOp::ReduceScatter, bytes(input), || {
                self.comm.reduce_scatter_into(input, output, op, tag).wait()
            })?;
            Ok(output.clone())
        })();
        self.done(tag, done)
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let done = (|| {
            self.check_tensor(input, RingOp::AllGather, tag)?;
            self.check_tensor(output, RingOp::AllGather, tag)?;
            if output.numel() != input.numel() * self.world_size() || output.dtype() != input.dtype() {
                return Err(DdpError::Comm(CommError::InvalidArgument(format!(
                    "all-gather `{tag}`: the output must hold {} x {} {} elements, got {} {}",
                    self.world_size(),
                    input.numel(),
                    input.dtype(),
                    output.numel(),
                    output.dtype()
                ))));
            }
            self.issue(RingOp::AllGather, bytes(input), || {
                self.comm.all_gather_into(input, output, tag).wait()
            })?;
            Ok(output.clone())
        })();
        self.done(tag, done)
    }
}
