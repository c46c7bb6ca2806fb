//! Recording a step profile from a live [`DistributedDataParallel`]: the training loop hands
//! over the instants only it knows (the step's start and end, the optimizer's span); the
//! parameters, the bucket caps and the pass's times come from DDP itself.

use std::time::Instant;

use crate::overlap::{ParamProfile, ProfilePolicy, RankProfile, StepProfile, PROFILE_VERSION};
use crate::reducer::grad_bytes;
use crate::DistributedDataParallel;

/// The instants of one training step that DDP does not see, on this rank's clock.
#[derive(Debug, Clone, Copy)]
pub struct StepInstants {
    /// When the step began (every time in the profile counts from here).
    pub start: Instant,
    /// When the optimizer step began.
    pub optimizer_start: Instant,
    /// When the optimizer step ended.
    pub optimizer_end: Instant,
    /// When the step ended.
    pub end: Instant,
}

impl RankProfile {
    /// This rank's profile of the step `ddp` last synchronized (see [`RankProfile::from_pass`]);
    /// `None` when its backward pass did not run to its end.
    pub fn record(ddp: &DistributedDataParallel, at: &StepInstants) -> Option<RankProfile> {
        let rank = ddp.comm().rank();
        RankProfile::from_pass(
            rank,
            at.start,
            &ddp.last_pass(),
            &ddp.param_gathers(),
            (at.optimizer_start, at.optimizer_end),
            at.end,
        )
    }
}

impl StepProfile {
    /// The profile of the step `ddp` last synchronized with this rank's entry alone (gather
    /// every rank's entry into `ranks` to replay it): the parameters in registration order,
    /// the bucket caps that step ran with and the pass's times. `None` when its backward pass
    /// did not run to its end. Call it before anything changes the caps (the autotuner).
    pub fn record(ddp: &DistributedDataParallel, at: &StepInstants) -> Option<StepProfile> {
        let mine = RankProfile::record(ddp, at)?;
        let (bucket_cap_mb, first_bucket_cap_mb) = ddp.bucket_caps();
        Some(StepProfile {
            version: PROFILE_VERSION,
            world_size: ddp.comm().world_size(),
            bucket_cap_mb,
            first_bucket_cap_mb,
            activation_checkpointing: 0,
            policy: Some(ProfilePolicy::of(ddp)),
            run: None,
            params: ParamProfile::all_of(ddp),
            ranks: vec![mine],
        })
    }
}

impl ProfilePolicy {
    /// `ddp`'s policy as a step profile records it.
    pub(crate) fn of(ddp: &DistributedDataParallel) -> ProfilePolicy {
        let (wire, after_step) = ddp.wire_model();
        ProfilePolicy {
            name: ddp.policy_name(),
            wire,
            after_step,
        }
    }
}

impl ParamProfile {
    /// The bytes of each of `ddp`'s parameters' gradient in a bucket, in registration order (0
    /// for a frozen parameter), with its shape: the `params` of a step profile.
    pub(crate) fn all_of(ddp: &DistributedDataParallel) -> Vec<ParamProfile> {
        ddp.params()
            .iter()
            .map(|p| ParamProfile {
                name: p.name().unwrap_or("<unnamed>").to_string(),
                bytes: if p.requires_grad() { grad_bytes(p) } else { 0 },
                shape: p.shape(),
            })
            .collect()
    }
}
