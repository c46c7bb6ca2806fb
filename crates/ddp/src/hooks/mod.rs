//! Communication hooks: how a bucket's gradients are reduced (PyTorch's `register_comm_hook`).
//!
//! The reducer hands each full bucket to a [`CommHook`] as a [`GradBucket`]: its index, its
//! flat f32 buffer holding this rank's gradients (*not* divided by the world size), and where
//! each parameter sits in it. The hook returns a [`Work`] that completes with the bucket's new
//! contents, normally the average over ranks, which the reducer writes back under the
//! gradients. Hooks are called on the compute thread in bucket order, the moment a bucket is
//! ready, and must not block: decompression and division are chained with [`Work::then`].
//!
//! Built in: [`AllReduceHook`] (the default: one averaging all-reduce, exactly today's
//! reducer), [`CompressHook`] (fp16 / bf16: divide, round to 16 bits, all-reduce, widen) and
//! [`PowerSgdHook`] (low-rank compression with error feedback).

mod compress;
mod powersgd;

use std::sync::Arc;

use brigade_comm::{Buffer, CommError, Communicator, ReduceOp, Work};

use crate::bucket_tag;

pub use compress::{CompressHook, HalfType};
pub use powersgd::{PowerSgdConfig, PowerSgdHook};

/// Where one parameter's gradient sits in its bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketParam {
    /// Registration index of the parameter.
    pub index: usize,
    /// Its name (`layers.0.weight`).
    pub name: String,
    /// First element of its gradient in the bucket's buffer.
    pub offset: usize,
    /// Its shape (the gradient has `shape.iter().product()` elements).
    pub shape: Vec<usize>,
}

impl BucketParam {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True for a zero-size parameter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One bucket handed to a [`CommHook`] (PyTorch's `GradBucket`).
#[derive(Debug, Clone, PartialEq)]
pub struct GradBucket {
    /// The bucket's index: its place in the launch order, the same on every rank.
    pub index: usize,
    /// This rank's gradients, flat, not divided by the world size.
    pub buffer: Vec<f32>,
    /// The parameters in the buffer, in buffer order.
    pub params: Vec<BucketParam>,
    /// Whether this is the last bucket of the backward pass (PyTorch's `is_last`).
    pub is_last: bool,
}

/// A policy for reducing gradient buckets (see the module docs). A hook may keep state across
/// iterations (PowerSGD's error feedback); that state is one rank's, so with ranks as threads
/// give each rank its own hook, as each PyTorch process has its own.
pub trait CommHook: Send + Sync {
    /// A short name for reports (`allreduce`, `fp16`, `powersgd:4`).
    fn name(&self) -> String;

    /// Reduces `bucket` over the ranks of `comm`: a work that completes with the bucket's new
    /// contents (the same length as `bucket.buffer`). Called on the compute thread, in bucket
    /// order, when the bucket is ready; it must return at once.
    fn reduce(&self, comm: &Arc<dyn Communicator>, bucket: GradBucket) -> Work<Vec<f32>>;
}

fn into_f32(b: Buffer) -> Result<Vec<f32>, CommError> {
    b.into_f32()
        .map_err(|b| CommError::Unsupported(format!("expected an f32 buffer back, got {:?}", b.dtype())))
}

/// The default policy: one all-reduce averaging the bucket over the ranks, in f32.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllReduceHook;

impl CommHook for AllReduceHook {
    fn name(&self) -> String {
        "allreduce".into()
    }

    fn reduce(&self, comm: &Arc<dyn Communicator>, bucket: GradBucket) -> Work<Vec<f32>> {
        comm.all_reduce(Buffer::F32(bucket.buffer), ReduceOp::Avg, &bucket_tag(bucket.index))
            .then(into_f32)
    }
}
