//! The overlap model: replay one recorded training step under other bucket caps and links.
//!
//! A [`StepProfile`] records, per rank, when each parameter's gradient became ready during
//! backward, when backward's compute ended, and how long the optimizer took. [`replay`]
//! re-runs only the communication of that step under another bucket cap (and, if asked,
//! another link or world size): it groups the parameters into buckets as DDP would, launches
//! them in strict bucket order on one comm stream shared by the group, costs each collective
//! by a [`LinkCost`], and reports the predicted step time, the communication left exposed after
//! backward, which buckets are exposed, and the lower bound for any cap (every byte leaving
//! the moment it is ready). The compute is taken as recorded, which is what makes the answer
//! independent of the noise of the minute: one recorded step answers every cap.

mod autotune;
mod price;
mod profile;
mod record;
mod replay;

pub use crate::policy::WireModel;
pub use autotune::{
    decide, AutotuneConfig, AutotuneDecision, AutotuneProgress, AutotuneReport, Autotuner, AUTOTUNE_CAPS_MB,
    AUTOTUNE_START_CAP_MB, DEFAULT_MIN_GAIN,
};
pub use price::RingPrice;
pub use profile::{
    BucketProfile, ControlProfile, GatherProfile, ParamProfile, PolicyTimes, ProfilePolicy, ProfileRun, RankProfile,
    StepProfile, PROFILE_VERSION,
};
pub use record::StepInstants;
pub use replay::{
    measured_link, replay, replay_with, wire_note, BucketOrder, LaunchCost, LaunchOverhead, LinkCost, ReplayBucket,
    ReplayConfig, ReplayGather, ReplayResult,
};
