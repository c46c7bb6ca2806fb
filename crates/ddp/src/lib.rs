//! Brigade's data parallelism: [`DistributedDataParallel`] hides gradient communication
//! behind the backward pass, and a [`ReducerPolicy`] decides how it communicates and steps.
//!
//! The path of one gradient: backward finishes a parameter's gradient (accumulated
//! directly into its slice of a flat bucket) and announces it on the gradient-ready bus;
//! the reducer counts the parameter's bucket down; when the bucket is full, and every
//! bucket before it has been launched, the bucket is handed (not copied) to the rank's reducer
//! policy, which issues its collectives through DDP's tensor-level [`ProcessGroup`] (an
//! averaging all-reduce, fp16 compression, PowerSGD, ZeRO's reduce-scatter, a user's own); backward meanwhile continues with earlier layers. At the end of backward the
//! reducer waits for every bucket's future and puts its result back under the gradient views
//! (or keeps the rank's shard), so the optimizer the policy built sees it.
//!
//! Three layers from a full bucket to the transport: the reducer, the policy, the process group
//! ([`group`]: the host group over the rank's comm stream by default, a device group on a
//! CUDA comm stream with NCCL or host-staged collectives), then the transport below. The built-in policies live in `brigade-policies`, written against
//! [`policy`] alone.

#![warn(missing_docs)]

mod ddp;
mod error;
pub mod group;
mod memory;
pub mod overlap;
mod peak_parts;
mod phase;
pub mod policy;
mod reducer;
mod signature;

pub use ddp::{BucketInfo, DdpOptimizer, DistributedDataParallel};
pub use error::{DdpError, Result};
pub use group::{Group, ProcessGroup, TensorWork};
pub use memory::MemoryReport;
pub use peak_parts::{MemoryPart, PeakParts};
pub use phase::{bucket_of, Phase};
pub use policy::{bucket_tag, KeepsState, RankState, ReducerPolicy, Replicas};
pub use reducer::{assign_buckets, BucketGrouping, PassBucket, PassTimes};
pub use signature::{broadcast_from_rank0, PARAMETER_BROADCAST_MIN_PACK_BYTES};

use brigade_comm::{CommMeter, Recorder};

/// How DDP buckets gradients. Defaults follow PyTorch. How each bucket is reduced, and what
/// the optimizer steps, is the [`ReducerPolicy`] given beside it.
#[derive(Clone)]
pub struct DdpConfig {
    /// Cap of every bucket but the first, in MiB (PyTorch: 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, in MiB (PyTorch: 1), small so that communication starts early.
    pub first_bucket_cap_mb: f64,
    /// Mark parameters that get no gradient ready at the start of backward instead of
    /// failing.
    pub find_unused_parameters: bool,
    /// Rebuild the buckets once, after the first iteration, from the observed ready order
    /// (when the policy lets DDP regroup them).
    pub rebuild_buckets: bool,
    /// Start every rank from rank 0's parameter values.
    pub broadcast_parameters: bool,
    /// Where to record per-layer backward spans (and nothing else: trace the comm stream,
    /// [`brigade_comm::CommStream::traced`], for the comm track).
    pub recorder: Option<Recorder>,
    /// Counts what DDP sends while it trains: every collective its policy issues (on any
    /// backend; step profiles record each bucket's part) and the bucket rebuild's broadcast;
    /// not the parameter check and broadcast of construction, nor checkpoints' gathers.
    pub meter: CommMeter,
    /// The dtype the gradient buckets hold and are reduced in (FSDP2's
    /// `MixedPrecisionPolicy.reduce_dtype`) where the policy takes DDP's default layout
    /// ([`policy::PolicyContext::reduce_dtype`]): `None` for the parameters' dtype; f32 beside 16-bit
    /// parameters gives f32 buckets, the 16-bit gradients widened as they accumulate.
    pub reduce_dtype: Option<brigade_tensor::DType>,
    /// Start from this grouping of the buckets (a checkpoint's,
    /// [`DistributedDataParallel::bucket_grouping`]) instead of grouping by the caps, and rebuild
    /// no more: a resume reduces on the buckets the run it continues had. Under other caps than
    /// the recorded ones the recorded order is regrouped by this configuration's; ignored when
    /// the policy fixes its buckets (`BucketLayout::regroup: false`, `bucket_groups`).
    pub grouping: Option<BucketGrouping>,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 1.0,
            find_unused_parameters: false,
            rebuild_buckets: true,
            broadcast_parameters: true,
            recorder: None,
            meter: CommMeter::new(),
            reduce_dtype: None,
            grouping: None,
        }
    }
}
