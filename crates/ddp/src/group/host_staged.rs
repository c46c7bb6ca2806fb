//! A device comm stream's collectives without NCCL: a group over a host group, each collective
//! staged through the host and waited on.

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{Communicator, ReduceOp};
use brigade_tensor::Tensor;

use super::host::{lend, tensor_of};
use super::{ProcessGroup, TensorWork};

/// A [`ProcessGroup`] for a [`super::DeviceGroup`] over a host communicator: each collective
/// copies its input out of device memory on the current stream (the comm stream, inside the
/// device group's scope), runs on the communicator while the caller waits, and copies the
/// result back in on that stream; its work has completed when the method returns. On the
/// counting fake device this runs the device group's exact event logic with thread ranks (every
/// staged copy counted); on a GPU without NCCL it is a correct, slow, device comm stream.
pub struct HostStaged {
    comm: Arc<dyn Communicator>,
}

impl HostStaged {
    /// Collectives over `comm`, staged.
    pub fn new(comm: Arc<dyn Communicator>) -> HostStaged {
        HostStaged { comm }
    }

    /// `t`'s elements on the host, copied out on the current stream (`t` keeps its memory).
    fn stage_out(t: &Tensor) -> crate::Result<brigade_comm::Buffer> {
        Ok(lend(&t.copy()?)?.0)
    }

    fn done(&self, tag: &str, value: crate::Result<Tensor>) -> TensorWork<Tensor> {
        TensorWork::ready(self.rank(), tag, self.timeout(), value)
    }
}

impl ProcessGroup for HostStaged {
    fn name(&self) -> &'static str {
        "host-staged"
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

    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let comm = &self.comm;
        let done = (|| {
            let (b, lent) = lend(t)?;
            t.restore_buffer(comm.all_reduce_blocking(b, op, tag)?, lent)?;
            Ok(t.clone())
        })();
        self.done(tag, done)
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let comm = &self.comm;
        let done = (|| {
            let b = comm.reduce_scatter(Self::stage_out(input)?, op, tag).wait()?;
            output.copy_from(&tensor_of(b, output.shape(), output.device())?)?;
            Ok(output.clone())
        })();
        self.done(tag, done)
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let comm = &self.comm;
        let done = (|| {
            let b = comm.all_gather(Self::stage_out(input)?, tag).wait()?;
            output.copy_from(&tensor_of(b, output.shape(), output.device())?)?;
            Ok(output.clone())
        })();
        self.done(tag, done)
    }
}
