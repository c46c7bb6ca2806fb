//! How the trainer gets each rank's reducer policy: a policy holds one rank's state (error
//! feedback, PowerSGD's factors, ZeRO's shards), so a run carries a recipe, [`MakePolicy`],
//! and every rank makes its own. A [`PolicySpec`] is one recipe (the built-in policies), and
//! so is any closure `Fn(rank) -> P` whose `P` is a [`ReducerPolicy`]: that is where a user's
//! own reducer policy plugs in.
//!
//! ```
//! use std::sync::Arc;
//! use brigade::policies::AllReduce;
//! use brigade::policy::MakePolicy;
//!
//! // a plain closure: no box, no cast
//! let make: Arc<dyn MakePolicy> = Arc::new(|_rank: usize| AllReduce);
//! assert_eq!(make.make(0).unwrap().name(), "allreduce");
//! // the same, with the rank's type inferred
//! let make = brigade::policy::per_rank(|_rank| AllReduce);
//! assert_eq!(make.make(1).unwrap().name(), "allreduce");
//! ```

use std::sync::Arc;

use brigade_ddp::ReducerPolicy;
use brigade_policies::{PolicySpec, Registry, StateLayout};

use crate::error::Result;

/// Makes one rank's [`ReducerPolicy`] (called once per rank, on that rank).
pub trait MakePolicy: Send + Sync {
    /// A new policy for `rank`.
    fn make(&self, rank: usize) -> Result<Box<dyn ReducerPolicy>>;

    /// How the policy lays the training state out over the ranks, as checkpoints record it
    /// (the whole state on every rank unless it shards).
    fn state_layout(&self) -> StateLayout {
        StateLayout::WHOLE
    }

    /// Whether each rank keeps only its shard of the parameters, gathered per unit around
    /// their forward and backward (so every rank must issue every gather).
    fn shards_params(&self) -> bool {
        false
    }

    /// Whether each rank keeps only its shard of the reduced gradients, their full buckets
    /// freed as they are reduced (ZeRO-2, ZeRO-3): what [`crate::config::DataConfig::accum_into_shard`]
    /// accumulates into.
    fn shards_grads(&self) -> bool {
        self.shards_params()
    }

    /// The policy's name, for messages (`None`: a recipe that does not say).
    fn name(&self) -> Option<String> {
        None
    }
}

impl MakePolicy for PolicySpec {
    fn make(&self, _rank: usize) -> Result<Box<dyn ReducerPolicy>> {
        Ok(self.build(&Registry::new())?)
    }

    fn state_layout(&self) -> StateLayout {
        PolicySpec::state_layout(self)
    }

    fn shards_params(&self) -> bool {
        PolicySpec::shards_params(self)
    }

    fn shards_grads(&self) -> bool {
        PolicySpec::shards_grads(self)
    }

    fn name(&self) -> Option<String> {
        Some(self.to_string())
    }
}

/// A spec whose user policies `registry` makes (a bare [`PolicySpec`] knows the built-in
/// ones alone).
#[derive(Clone)]
pub struct Registered {
    /// The policy.
    pub spec: PolicySpec,
    /// Where its user policy is registered.
    pub registry: Registry,
}

impl MakePolicy for Registered {
    fn make(&self, _rank: usize) -> Result<Box<dyn ReducerPolicy>> {
        Ok(self.spec.build(&self.registry)?)
    }

    fn state_layout(&self) -> StateLayout {
        self.spec.state_layout()
    }

    fn shards_params(&self) -> bool {
        self.spec.shards_params()
    }

    fn shards_grads(&self) -> bool {
        self.spec.shards_grads()
    }

    fn name(&self) -> Option<String> {
        Some(self.spec.to_string())
    }
}

impl<F, P> MakePolicy for F
where
    F: Fn(usize) -> P + Send + Sync,
    P: ReducerPolicy + 'static,
{
    fn make(&self, rank: usize) -> Result<Box<dyn ReducerPolicy>> {
        Ok(Box::new(self(rank)))
    }
}

/// `make` as a run's policy recipe: `per_rank(|rank| MyPolicy::new(rank))`, the closure's
/// argument (the rank) inferred.
pub fn per_rank<F, P>(make: F) -> Arc<dyn MakePolicy>
where
    F: Fn(usize) -> P + Send + Sync + 'static,
    P: ReducerPolicy + 'static,
{
    Arc::new(make)
}
