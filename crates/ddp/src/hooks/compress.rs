//! fp16 / bf16 compression (PyTorch's `fp16_compress_hook`, `bf16_compress_hook`).

use std::sync::Arc;

use brigade_comm::{Buffer, CommError, Communicator, ReduceOp, Work};
use half::{bf16, f16};

use super::{CommHook, GradBucket};
use crate::bucket_tag;

/// The 16-bit type a [`CompressHook`] sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfType {
    /// IEEE half precision: 10 mantissa bits, range ±65504.
    F16,
    /// bfloat16: f32's range, 7 mantissa bits.
    BF16,
}

/// Halves the bytes on the wire: each rank divides its gradients by the world size, rounds
/// them to 16 bits, the ranks sum in 16-bit buffers (accumulated in f32 by the backends), and
/// the result is widened back into the f32 bucket.
#[derive(Debug, Clone, Copy)]
pub struct CompressHook {
    half: HalfType,
}

impl CompressHook {
    /// A hook sending `half`.
    pub fn new(half: HalfType) -> CompressHook {
        CompressHook { half }
    }
}

fn widen<T: Copy>(v: Option<&[T]>, f: impl Fn(T) -> f32) -> Result<Vec<f32>, CommError> {
    v.map(|v| v.iter().map(|&x| f(x)).collect())
        .ok_or_else(|| CommError::Unsupported("the 16-bit all-reduce returned another dtype".into()))
}

impl CommHook for CompressHook {
    fn name(&self) -> String {
        match self.half {
            HalfType::F16 => "fp16".into(),
            HalfType::BF16 => "bf16".into(),
        }
    }

    fn reduce(&self, comm: &Arc<dyn Communicator>, bucket: GradBucket) -> Work<Vec<f32>> {
        let world = comm.world_size() as f32;
        let scaled = bucket.buffer.iter().map(|&g| g / world);
        let buf = match self.half {
            HalfType::F16 => Buffer::F16(scaled.map(f16::from_f32).collect()),
            HalfType::BF16 => Buffer::BF16(scaled.map(bf16::from_f32).collect()),
        };
        let half = self.half;
        comm.all_reduce(buf, ReduceOp::Sum, &bucket_tag(bucket.index))
            .then(move |b| match half {
                HalfType::F16 => widen(b.as_f16(), f16::to_f32),
                HalfType::BF16 => widen(b.as_bf16(), bf16::to_f32),
            })
    }
}
