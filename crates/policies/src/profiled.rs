//! The policy of a step profile as the overlap model replays it: a profile recorded before
//! policies were names none, and ran under the default, [`AllReduce`].

use brigade_ddp::overlap::{ProfilePolicy, StepProfile};
use brigade_ddp::ReducerPolicy;

use crate::AllReduce;

/// How `policy` is recorded in a step profile of a model whose parameters have `shapes`, on
/// `world_size` ranks: its name, its wire model and what it sends after the step.
pub fn profile_policy(policy: &dyn ReducerPolicy, shapes: &[Vec<usize>], world_size: usize) -> ProfilePolicy {
    ProfilePolicy {
        name: policy.name(),
        wire: policy.wire_model(shapes, world_size),
        after_step: policy.after_step_wire(shapes, world_size),
    }
}

/// Names the default policy in `profile` when it names none (recorded before policies were:
/// an f32 all-reduce), so that the overlap model can replay it.
pub fn name_default_policy(profile: &mut StepProfile) {
    if profile.policy.is_none() {
        let shapes: Vec<Vec<usize>> = profile.params.iter().map(|p| p.shape.clone()).collect();
        profile.policy = Some(profile_policy(&AllReduce, &shapes, profile.world_size));
    }
}
