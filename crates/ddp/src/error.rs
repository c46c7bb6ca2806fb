//! The ddp crate's error type.

use brigade_autograd::AutogradError;
use brigade_comm::CommError;
use brigade_tensor::{DType, TensorError};

/// What can go wrong while wrapping a model or reducing its gradients.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A collective failed (a dead rank, a timeout, a mismatch). The [`CommError`] is this
    /// error's `source()`, so a caller walking the chain finds it.
    #[error("{0}")]
    Comm(#[from] CommError),
    /// Recording or differentiating failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The ranks hold different models.
    #[error("the ranks hold different models: rank {rank_a} has {entry_a}, rank {rank_b} has {entry_b} (parameter #{index}); every rank must build the same model")]
    ModelMismatch {
        /// Registration index of the first parameter that differs.
        index: usize,
        /// The reference rank (0).
        rank_a: usize,
        /// Its parameter (`'name' [shape] dtype`), or `no parameter`.
        entry_a: String,
        /// The first rank that differs.
        rank_b: usize,
        /// Its parameter.
        entry_b: String,
    },
    /// A bucket cap that is not a positive number of MiB.
    #[error("invalid DDP configuration: bucket caps must be positive numbers of MiB, got bucket_cap_mb {bucket_cap_mb}, first_bucket_cap_mb {first_bucket_cap_mb}")]
    BucketCap {
        /// The configured cap of every bucket but the first.
        bucket_cap_mb: f64,
        /// The configured cap of the first bucket.
        first_bucket_cap_mb: f64,
    },
    /// A parameter whose dtype DDP cannot reduce.
    #[error(
        "parameter '{param}' is {dtype:?}; DDP reduces f32 parameters, or parameters all of one 16-bit float dtype"
    )]
    UnsupportedDType {
        /// The parameter.
        param: String,
        /// Its dtype.
        dtype: DType,
    },
    /// A bucket's storage, or a buffer a collective handed back, is not of the dtype the
    /// reducer put there (a backend bug).
    #[error("{what}: expected a {expected:?} buffer, found {found}")]
    BufferDType {
        /// Which buffer (`bucket3`, `ddp.rebuild_buckets`).
        what: String,
        /// The dtype the reducer gave.
        expected: DType,
        /// What it found.
        found: String,
    },
    /// Rank 0's ready order, broadcast to rebuild the buckets, is not a permutation of the
    /// parameters that require grad.
    #[error("bucket rebuild: rank 0's ready order {order:?} is not a permutation of the {expected} parameters that require grad")]
    RebuildOrder {
        /// The order received (registration indices).
        order: Vec<usize>,
        /// How many parameters it should list.
        expected: usize,
    },
    /// Parameters that take no part in this backward pass, without
    /// `find_unused_parameters`.
    #[error(
        "rank {rank}: these parameters receive no gradient in this backward pass: {params:?}. \
         Every parameter that requires grad must take part in the loss on every rank; freeze the others \
         (requires_grad false) before wrapping the model, or construct DDP with \
         find_unused_parameters = true (CLI: --find-unused-parameters) so that they are marked \
         ready and reduced as they are"
    )]
    UnusedParameters {
        /// This rank.
        rank: usize,
        /// The parameters' names.
        params: Vec<String>,
    },
    /// Backward ended before some parameters were announced.
    #[error("rank {rank}: backward finished but these parameters were never ready: {params:?}")]
    NeverReady {
        /// This rank.
        rank: usize,
        /// The parameters' names.
        params: Vec<String>,
    },
    /// A step profile the overlap model cannot replay, or a replay setting out of range.
    #[error("overlap model: {0}")]
    Replay(String),
    /// A policy could not draw its piece of a parameter's initial values (from the
    /// parameter's recipe, or read from the file that holds them).
    #[error("policy '{policy}': parameter '{param}': {source}")]
    InitialValues {
        /// The policy's name.
        policy: String,
        /// The parameter's name.
        param: String,
        /// The parameter's shape.
        shape: Vec<usize>,
        /// Why the draw failed: a file that cannot be read, or a NaN or infinity in it
        /// ([`AutogradError::NonFiniteStored`]).
        source: AutogradError,
    },
    /// A reducer policy refused something or failed (what, and what to change).
    #[error("policy '{policy}': {reason}")]
    Policy {
        /// The policy's name.
        policy: String,
        /// What is wrong and what to change.
        reason: String,
    },
    /// A policy's future completed with something that does not fit its bucket.
    #[error("policy '{policy}' returned {found} for bucket {bucket} of {expected}; a policy must return the bucket's new contents (element for element, in its dtype) or this rank's shard of it")]
    PolicyResult {
        /// The policy's name.
        policy: String,
        /// The bucket.
        bucket: usize,
        /// What the bucket holds (`1024 x f32`).
        expected: String,
        /// What came back.
        found: String,
    },
    /// Policy state that does not fit the policy or the group (a checkpoint saved under another
    /// policy or group size).
    #[error("policy state: {0}")]
    PolicyState(String),
    /// A recorded bucket grouping ([`crate::DdpConfig::grouping`]) does not fit the model.
    #[error("the recorded bucket grouping does not fit this model: {0}")]
    BucketGrouping(String),
    /// A rank's own parameters or optimizer state (a diverging policy's checkpoint) do not fit.
    #[error("a rank's own state: {0}")]
    RankState(String),
    /// A device call of a device process group (NCCL's, or host-staged on a device) failed.
    #[error("rank {rank}: {during} failed: {detail}")]
    Cuda {
        /// This rank.
        rank: usize,
        /// What was being done (`recording bucket 3's ready event`).
        during: String,
        /// The driver's error.
        detail: String,
    },
    /// A parameter was announced twice in one backward pass (autograd must announce once).
    #[error("parameter '{param}' was marked ready twice in one backward pass")]
    ReadyTwice {
        /// The parameter.
        param: String,
    },
    /// A gradient was announced although no backward pass had started.
    #[error("parameter '{param}' was announced outside a backward pass")]
    ReadyOutsideBackward {
        /// The parameter.
        param: String,
    },
    /// The bucket caps were changed while a backward pass was in flight.
    #[error("the bucket caps can change only between backward passes, not while buckets are in flight")]
    RebuildDuringBackward,
    /// The bucket-cap autotuner could not agree on a decision across the ranks.
    #[error("bucket-cap autotune: {0}")]
    Autotune(String),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, DdpError>;
