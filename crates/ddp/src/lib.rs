//! Brigade's data parallelism: [`DistributedDataParallel`] hides gradient
//! communication behind the backward pass.
//!
//! The path of one gradient: backward finishes a parameter's gradient (accumulated
//! directly into its slice of a flat bucket) and announces it on the gradient-ready bus;
//! the reducer counts the parameter's bucket down; when the bucket is full, and every
//! bucket before it has been launched, the bucket's buffer is handed (not copied) to the
//! comm stream for an all-reduce averaging it over ranks; backward meanwhile continues
//! with earlier layers. At the end of backward the reducer waits for every bucket and
//! gives the buffers back to the gradient views, so the optimizer sees the average.
//!
//! The reducer talks to a [`stream::BucketStream`] (ready event, collective, completion
//! event): the host comm stream by default, NCCL on a CUDA comm stream with `--backend nccl`.

#![warn(missing_docs)]

mod bucket;
mod ddp;
mod error;
pub mod hooks;
pub mod overlap;
mod reducer;
mod signature;
pub mod stream;
pub mod zero;

pub use bucket::assign_buckets;
pub use ddp::{BucketInfo, DistributedDataParallel, MemoryReport};
pub use error::{DdpError, Result};
pub use reducer::{bucket_tag, PassBucket, PassTimes};

use std::sync::Arc;

use brigade_comm::Recorder;
use hooks::{AllReduceHook, CommHook};
use zero::ZeroStage;

/// How DDP buckets and reduces gradients. Defaults follow PyTorch.
#[derive(Clone)]
pub struct DdpConfig {
    /// Cap of every bucket but the first, in MiB (PyTorch: 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, in MiB (PyTorch: 1), small so that communication starts early.
    pub first_bucket_cap_mb: f64,
    /// Mark parameters that get no gradient ready at the start of backward instead of
    /// failing.
    pub find_unused_parameters: bool,
    /// Rebuild the buckets once, after the first iteration, from the observed ready order.
    pub rebuild_buckets: bool,
    /// Start every rank from rank 0's parameter values.
    pub broadcast_parameters: bool,
    /// Where to record per-layer backward spans (and nothing else: wrap the communicator
    /// in [`brigade_comm::Traced`] for the comm track).
    pub recorder: Option<Recorder>,
    /// How each full bucket is reduced (PyTorch's `register_comm_hook`); default: one
    /// averaging all-reduce ([`hooks::AllReduceHook`]).
    pub comm_hook: Arc<dyn CommHook>,
    /// ZeRO stage ([`zero`]): shard the optimizer state (1) and the gradients (2) over the ranks;
    /// each bucket is reduce-scattered instead of reduced by `comm_hook` (which must be the
    /// default all-reduce), the buckets are never rebuilt, and the optimizer must be the one
    /// [`DistributedDataParallel::zero_optimizer`] wraps.
    pub zero: ZeroStage,
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
            comm_hook: Arc::new(AllReduceHook),
            zero: ZeroStage::Off,
        }
    }
}
