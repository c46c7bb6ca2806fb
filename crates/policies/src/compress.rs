//! fp16 / bf16 compression (PyTorch's `fp16_compress_hook`, `bf16_compress_hook`).

use std::sync::{Arc, Mutex};

use brigade_comm::ReduceOp;
use brigade_ddp::policy::{Group, PolicyBucket, ReducerPolicy, Reduction, StepContext, TensorWork, WireModel};
use brigade_ddp::DdpError;
use brigade_tensor::{DType, Device, Tensor};

/// The 16-bit type a [`Compress`] policy sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfType {
    /// IEEE half precision: 10 mantissa bits, range ±65504.
    F16,
    /// bfloat16: f32's range, 7 mantissa bits.
    BF16,
}

impl HalfType {
    /// The type of the compression policy named `name` (`None`: not a compression policy).
    pub fn of_policy(name: &str) -> Option<HalfType> {
        [HalfType::F16, HalfType::BF16]
            .into_iter()
            .find(|&h| Compress::new(h).name() == name)
    }

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
/// rounded to 16 bits once), and the result is widened back into the bucket (f32, or a
/// mixed-precision run's bf16 bucket).
///
/// On a bucket of its own type (bf16 on bf16 gradients, fp16 on fp16 ones) it is a pass-through:
/// the same bytes as the all-reduce, each share rounded once.
///
/// An fp16 sum of wider gradients that overflows (a share of a gradient, or the sum of the
/// shares, beyond ±65504) is reported as such — the bucket and the largest gradient over the
/// ranks — instead of reaching the parameters as infinities unnoticed (PyTorch's hook casts,
/// then divides, so it overflows too; a lower learning rate does not help). Host-staged (thread, MPI) the bucket's
/// reduction fails with it. On a device stream nothing is read back inside backward: each
/// bucket's check stays on the device, summed over the step's buckets, and read once after the
/// optimizer step ([`ReducerPolicy::after_step`]), which then fails with the same report.
#[derive(Debug, Clone)]
pub struct Compress {
    half: HalfType,
    /// The device path's checks not read yet (see [`Compress`]).
    pending: Arc<Mutex<Vec<DeviceCheck>>>,
}

/// One bucket's fp16 check on the device: the sum of squares of its reduced bucket (not finite:
/// an overflow, or a non-finite gradient), whether this rank's gradients were finite (their
/// sum of squares in f64) and their largest magnitude.
#[derive(Debug)]
struct DeviceCheck {
    bucket: usize,
    reduced_sq: Tensor,
    input_sq: Tensor,
    largest: Tensor,
}

impl Compress {
    /// A policy sending `half`.
    pub fn new(half: HalfType) -> Compress {
        Compress {
            half,
            pending: Arc::default(),
        }
    }

    /// Reads the device checks not read yet (one read when they all pass) and reports the
    /// first overflow over the ranks.
    fn read_device_checks(&self, comm: &Group) -> brigade_ddp::Result<()> {
        let checks = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let Some(first) = checks.first() else {
            return Ok(());
        };
        let mut total = first.reduced_sq.clone();
        for c in &checks[1..] {
            total = total.add(&c.reduced_sq)?;
        }
        if total.item()?.is_finite() {
            return Ok(());
        }
        // Every rank holds the same sums, so every rank takes this path.
        for c in &checks {
            if c.reduced_sq.item()?.is_finite() {
                continue;
            }
            let local = if c.input_sq.item()?.is_finite() {
                c.largest.item()?
            } else {
                f64::NAN
            };
            return overflow_over_ranks(comm, c.largest.device(), c.bucket, local, comm.world_size()).wait();
        }
        Ok(())
    }
}

/// The overflow report of `bucket` once the ranks agreed on the largest gradient (`local` is
/// this rank's, NaN when one of its gradients is not finite: then it is no overflow, and
/// passes on for the run's own checks).
fn overflow_over_ranks(comm: &Group, on: Device, bucket: usize, local: f64, world: usize) -> TensorWork<()> {
    let largest = match Tensor::from_vec(vec![local as f32], &[1]).and_then(|t| t.to_device(on)) {
        Ok(t) => t,
        Err(e) => return comm.failed(e.into()),
    };
    comm.all_reduce(&largest, ReduceOp::Max, "fp16.overflow")
        .then(move |m| {
            let m = m.item()?;
            if !m.is_finite() {
                // a gradient was already non-finite: the run's own checks report it
                return Ok(());
            }
            Err(DdpError::Policy {
                policy: "fp16".into(),
                reason: format!(
                    "overflow in bucket {bucket}: the largest gradient over the ranks is {m:.4e}; fp16 holds at most \
                 {F16_MAX} in each rank's share (gradient / {world}) and in the sum of the shares. A lower learning \
                 rate does not help: reduce this model with bf16 (the same bytes, f32's range) or allreduce"
                ),
            })
        })
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

    fn keeps_state(&self) -> brigade_ddp::KeepsState {
        brigade_ddp::KeepsState::Nothing
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let world = comm.world_size();
        let on = bucket.tensor.device();
        let on_host = !comm.enqueues();
        if !on_host && bucket.index == 0 {
            // checks left by a pass whose optimizer step was not DDP's (no after_step)
            self.read_device_checks(comm)?;
        }
        // A 16-bit bucket (mixed precision) is divided in f32 and rounded once to the wire's
        // type: bf16 on bf16 buckets and fp16 on fp16 buckets change no bytes (the share is
        // rounded, the sum accumulated in f32 and rounded once), fp16 on bf16 buckets is a cast
        // (exact within fp16's range, which the overflow check guards). The result comes back in
        // the bucket's dtype. An fp16 bucket needs no overflow check: the average of fp16
        // gradients fits fp16, and an inf already in it (under loss scaling, a skipped step)
        // is the run's to see, not an overflow of the wire.
        let bucket_dtype = bucket.tensor.dtype();
        let wide_input = match bucket_dtype {
            DType::F32 => bucket.tensor.clone(),
            _ => bucket.tensor.to_dtype(DType::F32)?,
        };
        let scaled = wide_input.div(&Tensor::full_on(&[], world as f64, DType::F32, on)?)?;
        let half = scaled.to_dtype(self.half.dtype())?;
        let checked = self.half == HalfType::F16 && bucket_dtype != DType::F16;
        let (index, input) = (bucket.index, wide_input);
        let (comm2, pending) = (comm.clone(), self.pending.clone());
        let summed = comm.all_reduce(&half, ReduceOp::Sum, &bucket.tag());
        let back = move |wide: Tensor| -> brigade_ddp::Result<Tensor> {
            Ok(match bucket_dtype {
                DType::F32 => wide,
                _ => wide.to_dtype(bucket_dtype)?,
            })
        };
        Ok(Reduction::Full(summed.and_then(move |h| {
            let wide = h.to_dtype(DType::F32)?;
            if !checked {
                return Ok(comm2.ready(back(wide)?));
            }
            // f16 results are at most 65504: their squares sum finitely unless one is not finite
            let reduced_sq = wide.sqr()?.sum_all()?;
            if !on_host {
                let check = DeviceCheck {
                    bucket: index,
                    reduced_sq,
                    input_sq: input.to_dtype(DType::F64)?.sqr()?.sum_all()?,
                    largest: input.sqr()?.max_dim(0, false)?.sqrt()?,
                };
                pending.lock().unwrap_or_else(|e| e.into_inner()).push(check);
                return Ok(comm2.ready(back(wide)?));
            }
            if reduced_sq.item()?.is_finite() {
                return Ok(comm2.ready(back(wide)?));
            }
            // Every rank holds the same sum, so every rank takes this path: find the largest
            // gradient over the ranks (NaN-propagating max: a non-finite input is not an overflow).
            let local = if all_finite(&input)? {
                input.to_f64_vec()?.iter().fold(0.0f64, |m, x| m.max(x.abs()))
            } else {
                f64::NAN
            };
            Ok(overflow_over_ranks(&comm2, on, index, local, world).then(move |()| back(wide)))
        })))
    }

    fn after_step(&mut self, _step: &StepContext<'_>, comm: &Group) -> brigade_ddp::Result<()> {
        self.read_device_checks(comm)
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::AllReduce { bytes_per_element: 2.0 })
    }
}
