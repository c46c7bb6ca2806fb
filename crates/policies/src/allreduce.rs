//! The default policy: one averaging all-reduce per bucket, in place, in the bucket's dtype.

use brigade_comm::ReduceOp;
use brigade_ddp::policy::{Group, PolicyBucket, ReducerPolicy, Reduction, WireModel};

/// PyTorch's default reduction (DDP without a hook): each full bucket is averaged over the
/// ranks by one all-reduce on its own buffer (lent to the collective, no copy); the user's
/// optimizer steps every parameter.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllReduce;

impl ReducerPolicy for AllReduce {
    fn name(&self) -> String {
        "allreduce".into()
    }

    fn keeps_state(&self) -> brigade_ddp::KeepsState {
        brigade_ddp::KeepsState::Nothing
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        Ok(Reduction::Full(comm.all_reduce(
            &bucket.tensor,
            ReduceOp::Avg,
            &bucket.tag(),
        )))
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::AllReduce { bytes_per_element: 4.0 })
    }
}
