//! EF-SignSGD (Karimireddy et al., 2019): one bit per element and one scale per bucket, with
//! error feedback; what it does not send it keeps for the next step.

use brigade_ddp::policy::{
    BucketSpan, Group, ParamState, PolicyBucket, ReducerPolicy, Reduction, StepContext, WireModel,
};
use brigade_ddp::KeepsState;
use brigade_tensor::{DType, Tensor};

use crate::topk::{keep_through_loss_scaling, with_residual};

/// Bits packed into each byte sent.
const BITS: usize = 8;

/// EF-SignSGD, one per rank (the residual it keeps is its own): the simplest 1-bit compressor
/// that, with error feedback, converges like SGD with momentum. Each rank adds the residual it
/// kept to its bucket (in f32), sends the sign of each element (a set bit: at least 0; packed
/// eight to a byte) and one scale, the mean magnitude of the bucket, and keeps the residual
/// `p − scale·sign(p)`. The ranks all-gather the bits with the scale beside them
/// ([`brigade_ddp::ProcessGroup::all_gather_with_side`]), and each rank sums every rank's
/// `scale·sign` in rank order and divides by the world size: 1/32 of an f32 all-gather's
/// bytes. The residual is saved in [`ReducerPolicy::state_dict`] (a resume is exact) and kept
/// through loss scaling as int8's error is. A non-finite gradient makes its rank's scale
/// non-finite, so every rank's result is NaN: the run's checks see it.
#[derive(Debug)]
pub struct EfSign {
    residual: ParamState,
    /// Under loss scaling, the residual as the current step started; `None` otherwise.
    before_step: Option<ParamState>,
}

impl Default for EfSign {
    fn default() -> Self {
        EfSign {
            residual: ParamState::default(),
            before_step: Some(ParamState::default()),
        }
    }
}

/// `signs` (±1, f32, `n` elements) as `ceil(n / 8)` bytes, bit `j` of byte `i` set when element
/// `8i + j` is +1.
fn pack(bits01: &Tensor, n: usize) -> brigade_ddp::Result<Tensor> {
    let m = n.div_ceil(BITS);
    let on = bits01.device();
    let padded = Tensor::zeros_on(&[m * BITS], DType::F32, on)?;
    padded.narrow(0, 0, n)?.copy_from(bits01)?;
    let weights: Vec<f32> = (0..BITS).map(|j| (1u32 << j) as f32).collect();
    let weights = Tensor::from_vec(weights, &[BITS])?.to_device(on)?;
    // sums of distinct powers of two below 256: exact in f32
    Ok(padded
        .reshape(&[m, BITS])?
        .mul(&weights)?
        .sum(&[1], false)?
        .to_dtype(DType::U8)?)
}

/// Every rank's bytes `[world, m]` as its `[world, m * 8]` bits (0 or 1, f32): the highest bit
/// first, each taken off what is left.
fn unpack(bytes: &Tensor) -> brigade_ddp::Result<Tensor> {
    let (world, m) = (bytes.shape()[0], bytes.shape()[1]);
    let mut left = bytes.to_dtype(DType::F32)?;
    let bits = Tensor::zeros_on(&[world, m, BITS], DType::F32, bytes.device())?;
    for j in (0..BITS).rev() {
        let weight = (1u32 << j) as f64;
        let bit = left.in_range(weight, f64::INFINITY)?;
        left = left.sub(&bit.mul_scalar(weight)?)?;
        bits.narrow(2, j, 1)?.copy_from(&bit.reshape(&[world, m, 1])?)?;
    }
    Ok(bits.reshape(&[world, m * BITS])?)
}

impl ReducerPolicy for EfSign {
    fn name(&self) -> String {
        "efsign".into()
    }

    fn keeps_state(&self) -> KeepsState {
        KeepsState::InStateDict
    }

    fn buckets_built(&mut self, buckets: &[BucketSpan], _generation: u64) -> brigade_ddp::Result<()> {
        self.residual.buckets_built(buckets);
        Ok(())
    }

    fn state_dict(&self) -> brigade_ddp::Result<Vec<(String, Tensor)>> {
        Ok(self.residual.state_dict())
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_ddp::Result<()> {
        self.residual.load_state_dict(state)?;
        self.before_step = Some(self.residual.clone());
        Ok(())
    }

    fn after_step(&mut self, step: &StepContext<'_>, _comm: &Group) -> brigade_ddp::Result<()> {
        keep_through_loss_scaling(&mut self.residual, &mut self.before_step, step)
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let dtype = bucket.tensor.dtype();
        let n = bucket.tensor.numel();
        if n == 0 {
            return Ok(Reduction::Full(comm.ready(bucket.tensor)));
        }
        let p = with_residual(&bucket, &self.residual)?;
        let scale = p.abs()?.mean(&[0], true)?;
        // a set bit: at least 0 (+1); a clear one: below 0, or NaN (whose scale is NaN anyway)
        let bits = p.in_range(0.0, f64::INFINITY)?;
        let sent = bits.mul_scalar(2.0)?.add_scalar(-1.0)?.mul(&scale)?;
        let residual = p.sub(&sent)?;
        for q in &bucket.params {
            self.residual.insert(q, residual.narrow(0, q.offset, q.len())?.copy()?);
        }
        let (world, on) = (comm.world_size(), p.device());
        let gathered = comm.all_gather_with_side(&pack(&bits, n)?, &scale, &bucket.tag());
        Ok(Reduction::Full(gathered.then(move |(bytes, scales)| {
            let signs = unpack(&bytes)?.narrow(1, 0, n)?.mul_scalar(2.0)?.add_scalar(-1.0)?;
            let mean =
                signs
                    .mul(&scales)?
                    .sum(&[0], false)?
                    .div(&Tensor::full_on(&[], world as f64, DType::F32, on)?)?;
            Ok(match dtype {
                DType::F32 => mean,
                _ => mean.to_dtype(dtype)?,
            })
        })))
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::AllGather {
            bytes_per_element: 1.0,
            bytes_per_bucket: 4.0,
            density: 1.0 / BITS as f64,
        })
    }
}
