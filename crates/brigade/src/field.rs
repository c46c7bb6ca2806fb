//! The configuration fields the library's messages name, as paths in
//! [`crate::config::TrainConfig`] (`recipe.precision.reduce_dtype`), so that a program over the
//! library can say them its own way: the `brigade` binary names the flag that sets each.

/// The dtype the gradients are reduced in.
pub const REDUCE_DTYPE: &str = "recipe.precision.reduce_dtype";
/// The run's mixed precision.
pub const PRECISION: &str = "recipe.precision";
/// Where the model and its state live.
pub const DEVICE: &str = "runtime.device";
/// What ranks do when their data ends at different steps.
pub const JOIN: &str = "data.join";
/// The reducer policy.
pub const POLICY: &str = "distributed.policy";
/// The learning-rate schedule's T.
pub const DECAY_STEPS: &str = "recipe.schedule.decay_steps";
/// Whether a run records step profiles.
pub const PROFILE: &str = "runtime.instrument.profile";

/// The bucket cap, in MiB (every bucket but the first).
pub const BUCKET_CAP: &str = "distributed.ddp.bucket_cap_mb";
/// The first bucket's cap, in MiB.
pub const FIRST_BUCKET_CAP: &str = "distributed.ddp.first_bucket_cap_mb";

/// Every field above, longest path first (so that a path is never read as the start of a
/// longer one).
pub const ALL: [&str; 9] = [
    FIRST_BUCKET_CAP,
    BUCKET_CAP,
    REDUCE_DTYPE,
    DECAY_STEPS,
    PROFILE,
    PRECISION,
    DEVICE,
    POLICY,
    JOIN,
];
