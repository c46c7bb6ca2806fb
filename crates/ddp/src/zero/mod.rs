//! ZeRO (Rajbhandari et al., 2020; DeepSpeed, PyTorch's `ZeroRedundancyOptimizer`): shard the
//! optimizer state (stage 1) and the gradients (stage 2) over the ranks instead of holding
//! them whole on every rank.
//!
//! Where it plugs in: [`crate::DdpConfig::zero`] selects the stage. Each bucket's flat buffer is
//! padded to a multiple of the world size and cut into equal contiguous shards, rank `r`
//! owning shard `r` ([`shard`]). The reducer launches a full bucket, in bucket order, as one
//! averaging **reduce-scatter** instead of the communication hook's all-reduce, so a rank
//! receives only the average of its shard. Stage 1 writes the shard back in place (the rest
//! of the bucket is zeroed: this rank does not know it); stage 2 keeps only the shard and frees
//! the full buffer, which is allocated again when the next backward makes a gradient of the
//! bucket final (`attach_grad`). The optimizer is a [`ZeroOptimizer`]: one inner optimizer per
//! bucket over this rank's pieces of the parameters (state only for them), stepping its shard
//! and then **all-gathering** the updated parameters bucket by bucket, each bucket's
//! all-gather overlapping the next bucket's step. The buckets are never rebuilt under ZeRO
//! (the shards, and the optimizer state in them, are fixed at construction, as in DeepSpeed).

mod memory;
mod optimizer;
pub mod shard;

use std::sync::Arc;

use brigade_autograd::Var;
use brigade_comm::{Buffer, CommError, Communicator, ReduceOp, Work};
use brigade_tensor::{Storage, Tensor};

use crate::bucket::Bucket;
use crate::hooks::GradBucket;
use crate::{bucket_tag, DdpError, Result};

pub(crate) use memory::measure as memory_of;
pub use memory::RankMemory;
pub use optimizer::{BuildOptimizer, ZeroOptimizer, ALL_GATHER_CAP_BYTES};
pub use shard::{padded_len, shard_len};

/// How much of the training state is sharded over the ranks (`--zero 0|1|2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroStage {
    /// Plain DDP: every rank holds everything (stage 0).
    #[default]
    Off,
    /// Stage 1: optimizer state sharded; gradients reduce-scattered, parameters all-gathered.
    One,
    /// Stage 2: stage 1, and each rank keeps only its shard of the reduced gradients.
    Two,
}

impl ZeroStage {
    /// The stage for `--zero LEVEL` (0, 1 or 2).
    pub fn from_level(level: u8) -> Option<ZeroStage> {
        match level {
            0 => Some(ZeroStage::Off),
            1 => Some(ZeroStage::One),
            2 => Some(ZeroStage::Two),
            _ => None,
        }
    }

    /// The stage's number (0, 1, 2).
    pub fn level(self) -> u8 {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
        }
    }
}

/// What a bucket's buffer is padded to a multiple of under `stage` on `world` ranks.
pub(crate) fn pad_to(stage: ZeroStage, world: usize) -> usize {
    match stage {
        ZeroStage::Off => 1,
        _ => world.max(1),
    }
}

fn into_f32(b: Buffer) -> std::result::Result<Vec<f32>, CommError> {
    b.into_f32()
        .map_err(|b| CommError::Internal(format!("expected an f32 buffer back, got {:?}", b.dtype())))
}

/// ZeRO's reduction of a full bucket, as the host bucket stream's hook
/// ([`crate::stream::HostStream`]): [`reduce_scatter`] at `stage`.
pub(crate) struct ReduceScatterHook(pub(crate) ZeroStage);

impl crate::hooks::CommHook for ReduceScatterHook {
    fn name(&self) -> String {
        format!("zero{}-reduce-scatter", self.0.level())
    }

    fn reduce(&self, comm: &Arc<dyn Communicator>, bucket: GradBucket) -> Work<Vec<f32>> {
        reduce_scatter(comm, bucket, self.0)
    }
}

/// Launches `bucket` (its padded buffer) as one averaging reduce-scatter. Stage 1 completes with
/// the whole buffer again, this rank's averaged shard in its place and zeros elsewhere; stage 2
/// with the shard alone (its allocation shrunk to it).
pub(crate) fn reduce_scatter(comm: &Arc<dyn Communicator>, bucket: GradBucket, stage: ZeroStage) -> Work<Vec<f32>> {
    let rank = comm.rank();
    let full = bucket.buffer.len();
    comm.reduce_scatter(Buffer::F32(bucket.buffer), ReduceOp::Avg, &bucket_tag(bucket.index))
        .then(move |b| {
            let mut shard = into_f32(b)?;
            if stage == ZeroStage::Two {
                shard.shrink_to_fit();
                return Ok(shard);
            }
            let per = shard.len();
            shard.resize(full, 0.0);
            if rank > 0 {
                shard.copy_within(0..per, rank * per);
                shard[..per].fill(0.0);
            }
            Ok(shard)
        })
}

/// Stage 2, after the reduce-scatter: keeps `shard` as the bucket's gradient shard, leaves the
/// full buffer freed (lent to the collective, never given back) and drops the parameters'
/// gradient views into it (PyTorch's `p.grad = None`).
pub(crate) fn keep_grad_shard(bucket: &mut Bucket, shard: Vec<f32>, params: &[Var], world: usize) -> Result<()> {
    let per = bucket.flat.numel() / world.max(1);
    if shard.len() != per {
        return Err(DdpError::Zero(format!(
            "the reduce-scatter returned {} elements for a shard of {per}",
            shard.len()
        )));
    }
    let device = bucket.flat.device();
    bucket.grad_shard = Some(Tensor::from_vec(shard, &[per])?.to_device(device)?);
    for &p in &bucket.params {
        params[p].set_grad(None)?;
    }
    Ok(())
}

/// Stage 2, when parameter `p`'s gradient becomes final: gives its bucket a full buffer again
/// if it was freed (zeros; the last step's shard is dropped) and moves the gradient into its
/// slice, unless it already accumulates there (a later microbatch).
pub(crate) fn attach_grad(bucket: &mut Bucket, params: &[Var], p: usize) -> Result<()> {
    if bucket.flat.storage_numel() < bucket.flat.numel() {
        bucket.grad_shard = None;
        let zeros = Storage::from_host_vec(vec![0.0f32; bucket.flat.numel()], bucket.flat.device())?;
        bucket.flat.restore_storage(zeros)?;
    }
    if params[p].grad().is_some_and(|g| g.shares_storage(&bucket.flat)) {
        return Ok(());
    }
    let offset: usize = bucket
        .params
        .iter()
        .take_while(|&&q| q != p)
        .map(|&q| params[q].value().numel())
        .sum();
    params[p].set_grad_buffer(bucket.flat.flat_view(offset, &params[p].shape())?)?;
    Ok(())
}

/// This rank's shard of bucket `bucket`'s reduced gradients, as a tensor beside the parameters.
pub(crate) fn grad_shard(bucket: &Bucket, stage: ZeroStage, world: usize, rank: usize) -> Result<Tensor> {
    let per = bucket.flat.numel() / world.max(1);
    match stage {
        ZeroStage::Two => bucket.grad_shard.clone().ok_or_else(|| {
            DdpError::Zero("no gradient shard: the optimizer stepped before a synchronized backward".into())
        }),
        _ => Ok(bucket.flat.flat_view(rank * per, &[per])?),
    }
}
