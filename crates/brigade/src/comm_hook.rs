//! How the trainer gets each rank's reducer policy: a policy holds one rank's state (error
//! feedback, PowerSGD's factors, ZeRO's shards), so a run carries a recipe, [`MakeCommHook`],
//! and every rank makes its own. A [`PolicySpec`] is one recipe (the built-in policies), and
//! so is any closure `Fn(rank) -> Box<dyn ReducerPolicy>`: that is where a user's own reducer
//! policy plugs in.

use brigade_ddp::ReducerPolicy;
use brigade_policies::{PolicySpec, Registry, ZeroStage};

use crate::error::Result;

/// Makes one rank's [`ReducerPolicy`] (called once per rank, on that rank).
pub trait MakeCommHook: Send + Sync {
    /// A new policy for `rank`.
    fn make(&self, rank: usize) -> Result<Box<dyn ReducerPolicy>>;

    /// The ZeRO stage the policy shards at, as checkpoints record it (`Off` unless it is ZeRO).
    fn zero_stage(&self) -> ZeroStage {
        ZeroStage::Off
    }
}

impl MakeCommHook for PolicySpec {
    fn make(&self, _rank: usize) -> Result<Box<dyn ReducerPolicy>> {
        Ok(self.build(&Registry::new())?)
    }

    fn zero_stage(&self) -> ZeroStage {
        PolicySpec::zero_stage(self)
    }
}

impl<F> MakeCommHook for F
where
    F: Fn(usize) -> Box<dyn ReducerPolicy> + Send + Sync,
{
    fn make(&self, rank: usize) -> Result<Box<dyn ReducerPolicy>> {
        Ok(self(rank))
    }
}
