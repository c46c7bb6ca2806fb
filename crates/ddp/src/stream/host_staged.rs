//! Device collectives over any communicator, staged through the host: the device comm
//! stream's backend without NCCL.

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{Communicator, ReduceOp};
use brigade_tensor::Tensor;

use crate::collectives::{put_back, take, tensor_of, CollectiveBackend, TensorWork};

/// A [`CollectiveBackend`] over any [`Communicator`] (threads, MPI) for a device comm stream:
/// each collective copies its input out of device memory on the current stream (the comm
/// stream, inside `DeviceStream`), runs on the communicator while the caller waits, and copies
/// the result back in on that stream; its work has completed when the method returns. On the
/// counting fake device this runs the device stream's exact event logic with thread ranks
/// (every staged copy counted); on a GPU without NCCL it is a correct, slow, device comm stream.
pub struct HostStagedComm {
    comm: Arc<dyn Communicator>,
}

impl HostStagedComm {
    /// Collectives over `comm`.
    pub fn new(comm: Arc<dyn Communicator>) -> HostStagedComm {
        HostStagedComm { comm }
    }

    /// `t`'s elements on the host, copied out on the current stream (`t` keeps its memory).
    fn stage_out(t: &Tensor) -> crate::Result<brigade_comm::Buffer> {
        Ok(take(&t.copy()?)?.0)
    }

    fn done(&self, tag: &str, value: crate::Result<Tensor>) -> TensorWork<Tensor> {
        TensorWork::ready(self.comm.rank(), tag, self.comm.timeout(), value)
    }
}

impl CollectiveBackend for HostStagedComm {
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
        let done = (|| {
            let (b, lent) = take(t)?;
            let b = self.comm.all_reduce_blocking(b, op, tag)?;
            put_back(t, b, lent)
        })();
        self.done(tag, done)
    }

    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        let done = (|| {
            let b = self.comm.reduce_scatter(Self::stage_out(input)?, op, tag).wait()?;
            output.copy_from(&tensor_of(b, output.shape(), output.device())?)?;
            Ok(output.clone())
        })();
        self.done(tag, done)
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        let done = (|| {
            let b = self.comm.all_gather(Self::stage_out(input)?, tag).wait()?;
            output.copy_from(&tensor_of(b, output.shape(), output.device())?)?;
            Ok(output.clone())
        })();
        self.done(tag, done)
    }
}
