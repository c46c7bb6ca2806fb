//! EF-SignSGD (Karimireddy et al., 2019): one bit per element and one scale per bucket, with
//! error feedback; what it does not send it keeps for the next step.

use brigade_ddp::policy::{BucketSpan, Group, PolicyBucket, ReducerPolicy, Reduction, StepContext, WireModel};
use brigade_ddp::KeepsState;
use brigade_tensor::{DType, Tensor};

use crate::residual::Residual;

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
///
/// Use it with SGD (with or without momentum), the optimizer its error feedback is proven
/// for. Under Adam or AdamW it trains poorly, as expected of sign compression there: every
/// element of a bucket arrives with the same magnitude (the bucket's mean), so Adam's
/// per-coordinate second moment sees one magnitude and its per-coordinate scaling is lost,
/// and Adam's division by that moment is not linear, so what error feedback adds back later
/// does not sum to the gradient it held back (1-bit Adam, Tang et al. 2021, freezes Adam's
/// variance before compressing for this reason). Measured on the default MLP at 2 ranks,
/// AdamW, 200 steps: final loss 2.06 against 0.76 for all-reduce and 0.84 for `topk:0.01`.
#[derive(Debug, Default)]
pub struct EfSign {
    residual: Residual,
}

/// `p`'s signs (a set bit: at least 0; `bits01` holds them as 0 or 1) as `ceil(n / 8)`
/// bytes, bit `j` of byte `i` for element `8i + j`: in one pass on the host, in tensor ops
/// elsewhere.
fn pack(p: &Tensor, bits01: &Tensor, n: usize) -> brigade_ddp::Result<Tensor> {
    if !p.device().is_cpu() {
        return pack_in_ops(bits01, n);
    }
    let bytes: Vec<u8> = (p.to_vec::<f32>()?.chunks(BITS))
        .map(|c| (c.iter().enumerate()).fold(0u8, |b, (j, &x)| b | (u8::from(x >= 0.0) << j)))
        .collect();
    let m = bytes.len();
    Ok(Tensor::from_vec(bytes, &[m])?)
}

/// [`pack`] in tensor ops: the bits weighted by powers of two and summed by eight.
fn pack_in_ops(bits01: &Tensor, n: usize) -> brigade_ddp::Result<Tensor> {
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

/// The mean over the ranks of `scale·sign` from every rank's bytes `[world, m]` and scale
/// `[world, 1]`: `n` elements, f32, summed in rank order from 0 then divided by the world
/// size. On the host in one pass over each rank's bytes; elsewhere in tensor ops.
fn mean_of_signs(bytes: &Tensor, scales: &Tensor, n: usize) -> brigade_ddp::Result<Tensor> {
    let on = bytes.device();
    if !on.is_cpu() {
        return mean_of_signs_in_ops(bytes, scales, n);
    }
    let (world, m) = (bytes.shape()[0], bytes.shape()[1]);
    let (bytes, scales) = (bytes.to_vec::<u8>()?, scales.to_vec::<f32>()?);
    let mut sum = vec![0.0f32; m * BITS];
    for (row, &scale) in bytes.chunks(m.max(1)).zip(&scales) {
        for (&byte, out) in row.iter().zip(sum.chunks_mut(BITS)) {
            for (j, o) in out.iter_mut().enumerate() {
                *o += if byte >> j & 1 == 1 { scale } else { -scale };
            }
        }
    }
    sum.truncate(n);
    let world = world as f32;
    sum.iter_mut().for_each(|s| *s /= world);
    Ok(Tensor::from_vec(sum, &[n])?)
}

/// [`mean_of_signs`] in tensor ops: each bit taken off the bytes, highest first.
fn mean_of_signs_in_ops(bytes: &Tensor, scales: &Tensor, n: usize) -> brigade_ddp::Result<Tensor> {
    let (world, m) = (bytes.shape()[0], bytes.shape()[1]);
    let on = bytes.device();
    let mut left = bytes.to_dtype(DType::F32)?;
    let bits = Tensor::zeros_on(&[world, m, BITS], DType::F32, on)?;
    for j in (0..BITS).rev() {
        let weight = (1u32 << j) as f64;
        let bit = left.in_range(weight, f64::INFINITY)?;
        left = left.sub(&bit.mul_scalar(weight)?)?;
        bits.narrow(2, j, 1)?.copy_from(&bit.reshape(&[world, m, 1])?)?;
    }
    let signs = (bits.reshape(&[world, m * BITS])?.narrow(1, 0, n)?)
        .mul_scalar(2.0)?
        .add_scalar(-1.0)?;
    Ok(signs
        .mul(scales)?
        .sum(&[0], false)?
        .div(&Tensor::full_on(&[], world as f64, DType::F32, on)?)?)
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
        self.residual.load_state_dict(state)
    }

    fn after_step(&mut self, step: &StepContext<'_>, _comm: &Group) -> brigade_ddp::Result<()> {
        self.residual.after_step(step)
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let dtype = bucket.tensor.dtype();
        let n = bucket.tensor.numel();
        if n == 0 {
            return Ok(Reduction::Full(comm.ready(bucket.tensor)));
        }
        let p = self.residual.added_to(&bucket)?;
        let scale = p.abs()?.mean(&[0], true)?;
        // a set bit: at least 0 (+1); a clear one: below 0, or NaN (whose scale is NaN anyway)
        let bits = p.in_range(0.0, f64::INFINITY)?;
        let sent = bits.mul_scalar(2.0)?.add_scalar(-1.0)?.mul(&scale)?;
        let residual = p.sub(&sent)?;
        self.residual.keep(&bucket, &residual)?;
        let gathered = comm.all_gather_with_side(&pack(&p, &bits, n)?, &scale, &bucket.tag());
        Ok(Reduction::Full(gathered.then(move |(bytes, scales)| {
            let mean = mean_of_signs(&bytes, &scales, n)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Elements with every sign, zeros of both signs and a bucket not a multiple of eight long.
    fn bucket(n: usize, seed: u32) -> Tensor {
        let mut state = seed;
        let v: Vec<f32> = (0..n)
            .map(|i| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                match i % 11 {
                    0 => 0.0,
                    1 => -0.0,
                    _ => (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5,
                }
            })
            .collect();
        Tensor::from_vec(v, &[n]).unwrap()
    }

    #[test]
    fn the_host_pack_and_mean_are_the_tensor_ops_bit_for_bit() {
        for (n, world) in [(1, 1), (13, 2), (64, 3), (1001, 3)] {
            let ranks: Vec<Tensor> = (0..world).map(|r| bucket(n, 7 + r as u32)).collect();
            let mut all_bytes = Vec::new();
            for p in &ranks {
                let bits = p.in_range(0.0, f64::INFINITY).unwrap();
                let host = pack(p, &bits, n).unwrap().to_vec::<u8>().unwrap();
                let ops = pack_in_ops(&bits, n).unwrap().to_vec::<u8>().unwrap();
                assert_eq!(host, ops, "n {n}");
                all_bytes.extend(host);
            }
            let m = n.div_ceil(BITS);
            let bytes = Tensor::from_vec(all_bytes, &[world, m]).unwrap();
            // a zero scale: -0.0 and 0.0 summed as the ops sum them
            let scales: Vec<f32> = (0..world).map(|r| [0.25, 0.0, 1.5e-3][r % 3]).collect();
            let scales = Tensor::from_vec(scales, &[world, 1]).unwrap();
            let host = mean_of_signs(&bytes, &scales, n).unwrap().to_vec::<f32>().unwrap();
            let ops = mean_of_signs_in_ops(&bytes, &scales, n)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&host), bits(&ops), "n {n} world {world}");
        }
    }
}
