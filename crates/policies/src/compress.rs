//! fp16 / bf16 compression (PyTorch's `fp16_compress_hook`, `bf16_compress_hook`).

use brigade_comm::ReduceOp;
use brigade_ddp::policy::{Collectives, PolicyBucket, ReducerPolicy, Reduction, WireModel};
use brigade_ddp::DdpError;
use brigade_tensor::{DType, Tensor};

/// The 16-bit type a [`Compress`] policy sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfType {
    /// IEEE half precision: 10 mantissa bits, range ±65504.
    F16,
    /// bfloat16: f32's range, 7 mantissa bits.
    BF16,
}

impl HalfType {
    fn dtype(self) -> DType {
        match self {
            HalfType::F16 => DType::F16,
            HalfType::BF16 => DType::BF16,
        }
    }
}

/// Largest finite f16.
const F16_MAX: f64 = 65504.0;

/// Halves the bytes on the wire: each rank divides its gradients by the world size, rounds
/// them to 16 bits, the ranks sum the 16-bit buffers (accumulated in f32 by the backends,
/// rounded to 16 bits once), and the result is widened back into the f32 bucket.
///
/// An fp16 sum that overflows (a share of a gradient, or the sum of the shares, beyond ±65504)
/// is reported as such — the bucket and the largest gradient over the ranks — instead of
/// reaching the parameters as infinities (PyTorch's hook casts, then divides, so it overflows
/// too; a lower learning rate does not help).
#[derive(Debug, Clone, Copy)]
pub struct Compress {
    half: HalfType,
}

impl Compress {
    /// A policy sending `half`.
    pub fn new(half: HalfType) -> Compress {
        Compress { half }
    }
}

/// True when every element of `t` is finite (its sum of squares in f64 is).
fn all_finite(t: &Tensor) -> brigade_ddp::Result<bool> {
    Ok(t.to_dtype(DType::F64)?.sqr()?.sum_all()?.item()?.is_finite())
}

impl ReducerPolicy for Compress {
    fn name(&self) -> String {
        match self.half {
            HalfType::F16 => "fp16".into(),
            HalfType::BF16 => "bf16".into(),
        }
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Collectives) -> brigade_ddp::Result<Reduction> {
        let world = comm.world_size();
        let scaled = bucket.tensor.div(&Tensor::scalar(world as f64, DType::F32))?;
        let half = scaled.to_dtype(self.half.dtype())?;
        let (index, input, checked) = (bucket.index, bucket.tensor.clone(), self.half == HalfType::F16);
        let comm2 = comm.clone();
        let summed = comm.all_reduce(&half, ReduceOp::Sum, &bucket.tag());
        Ok(Reduction::Full(summed.and_then(move |h| {
            let wide = h.to_dtype(DType::F32)?;
            // f16 results are at most 65504: their squares sum finitely unless one is not finite
            if !checked || wide.sqr()?.sum_all()?.item()?.is_finite() {
                return Ok(comm2.ready(wide));
            }
            // Every rank holds the same sum, so every rank takes this path: find the largest
            // gradient over the ranks (NaN-propagating max: a non-finite input is not an overflow).
            let local = if all_finite(&input)? {
                input.to_f64_vec()?.iter().fold(0.0f64, |m, x| m.max(x.abs()))
            } else {
                f64::NAN
            };
            let largest = Tensor::from_vec(vec![local as f32], &[1])?;
            Ok(comm2
                .all_reduce(&largest, ReduceOp::Max, "fp16.overflow")
                .then(move |m| {
                    let m = m.item()?;
                    if !m.is_finite() {
                        // a gradient was already non-finite: the run's own checks report it
                        return Ok(wide);
                    }
                    Err(DdpError::Policy {
                        policy: "fp16".into(),
                        reason: format!(
                            "overflow in bucket {index}: the largest gradient over the ranks is {m:.4e}; fp16 holds at \
                             most {F16_MAX} in each rank's share (gradient / {world}) and in the sum of the shares. A \
                             lower learning rate does not help: reduce this model with bf16 (the same bytes, f32's \
                             range) or allreduce"
                        ),
                    })
                }))
        })))
    }

    fn wire_model(&self) -> Option<WireModel> {
        Some(WireModel::AllReduce { bytes_per_element: 2.0 })
    }
}
