//! ZeRO++'s quantized collectives (Wang et al., 2023; DeepSpeed's qwZ and qgZ) as options of
//! [`super::Zero3`] ([`ZeroPlusPlus`]): blockwise int8 with one f32 scale per block of
//! [`BLOCK`] elements (its largest magnitude over 127), cut within each rank's shard.
//!
//! - **qwZ** (quantized weights): a unit's gather sends each rank's f32 master shard as int8
//!   blocks and their scales (one all-gather with the scales beside), and every rank
//!   dequantizes the rows into the parameters' dtype. Each gathered element is within half its
//!   block's scale of the master's (rounding half to even); the masters themselves are never
//!   rounded: the optimizer steps the f32 shards as without the option. Gathers for a
//!   checkpoint or an evaluation (`summon_full_params`) stay exact.
//! - **qgZ** (quantized gradients): there is no all-to-all among the collectives, so a unit's
//!   bucket is cut into its `world` destination chunks, each quantized blockwise by
//!   **stochastic rounding**, and the whole int8 bucket and its scales are all-gathered; each
//!   rank dequantizes every rank's copy of its own chunk and sums them in rank order, then
//!   averages. A rank sends `(world - 1)` times its padded bucket in bytes (plus the scales):
//!   `world / 4` of the f32 reduce-scatter's `4 (world - 1) / world` bytes per element (half
//!   at world 2, the same at world 4); DeepSpeed's all-to-all would send a quarter at any world.
//!
//! Stochastic rounding, not error feedback: ZeRO-3's point is a rank's memory, and error feedback
//! keeps a full-size f32 residual of every bucket on every rank (the bytes ZeRO-2 and 3 shard
//! away); stochastic rounding keeps nothing but a draw counter, and rounds each element to one
//! of its two neighbouring int8 steps with the probability that makes the expectation exact,
//! so the averaged gradient is unbiased and its variance falls with the ranks. The draws come
//! from a seed made of the rank and the counter (every rank draws its own, reproducibly), and
//! the counter is the policy's state ([`QgzState`]), so a resumed run rounds as the run it
//! continues.

use brigade_ddp::policy::{Group, TensorWork};
use brigade_tensor::{DType, Rng, Tensor};

use crate::spec::PolicySpec;

type Result<T> = brigade_ddp::Result<T>;

/// Elements per quantization block (one f32 scale each: 1.6% over the int8 bytes).
pub const BLOCK: usize = 256;

/// The smallest scale: an all-zero block quantizes to zeros.
const MIN_SCALE: f64 = 1e-30;

/// ZeRO++'s options of [`super::Zero3`] (spec `zero3:qwz`, `zero3:qgz`, `zero3:qwz:qgz`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ZeroPlusPlus {
    /// qwZ: parameter gathers in blockwise int8.
    pub qwz: bool,
    /// qgZ: gradient reductions in blockwise int8 with stochastic rounding.
    pub qgz: bool,
}

impl ZeroPlusPlus {
    /// Whether any option is on.
    pub fn any(&self) -> bool {
        self.qwz || self.qgz
    }

    /// The spec of ZeRO-3 with these options (`zero3` when none is on).
    pub fn spec(self) -> PolicySpec {
        match self.any() {
            true => PolicySpec::Zero3Quantized(self),
            false => PolicySpec::Zero3,
        }
    }

    /// The options of a `zero3` spec's argument: `qwz`, `qgz` or both, `:`-separated, each
    /// once (`spec` is the whole spec, for the error).
    pub(crate) fn read(spec: &str, args: Option<&str>) -> crate::Result<PolicySpec> {
        let mut options = ZeroPlusPlus::default();
        for a in args.map(|a| a.split(':').collect::<Vec<_>>()).unwrap_or_default() {
            let flag = match a {
                "qwz" => &mut options.qwz,
                "qgz" => &mut options.qgz,
                _ => {
                    return Err(crate::spec::spec_error(
                        spec,
                        format!("'{a}' is not an option of zero3 (the options: qwz, qgz; e.g. zero3:qwz:qgz)"),
                    ))
                }
            };
            if *flag {
                return Err(crate::spec::spec_error(spec, format!("option '{a}' is given twice")));
            }
            *flag = true;
        }
        Ok(options.spec())
    }

    /// The argument of `spec` when it is ZeRO-3's (empty for plain ZeRO-3).
    pub(crate) fn write(spec: &PolicySpec) -> Option<String> {
        match spec {
            PolicySpec::Zero3 => Some(String::new()),
            PolicySpec::Zero3Quantized(o) => {
                let names: Vec<&str> = [(o.qwz, "qwz"), (o.qgz, "qgz")]
                    .iter()
                    .filter(|(on, _)| *on)
                    .map(|(_, n)| *n)
                    .collect();
                Some(names.join(":"))
            }
            _ => None,
        }
    }
}

/// Blocks of a chunk of `len` elements.
pub fn blocks(len: usize) -> usize {
    len.div_ceil(BLOCK)
}

/// Bytes one rank hands to a quantized gather of a chunk of `len` elements: its int8 blocks
/// (the last padded) and their f32 scales.
pub fn chunk_bytes(len: usize) -> usize {
    blocks(len) * (BLOCK + 4)
}

/// `rows` (`[r, len]` f32) quantized blockwise: `([r, blocks·BLOCK]` int8, `[r, blocks]` f32
/// scales`)`; each row padded with zeros to whole blocks. `noise` (`[r, blocks·BLOCK]`, in
/// `[0, 1)`) rounds stochastically (`floor(x / s + u)`), `None` to the nearest.
pub fn quantize_rows(rows: &Tensor, noise: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let (r, len) = (rows.shape()[0], rows.shape()[1]);
    let nb = blocks(len);
    let padded = Tensor::zeros_on(&[r, nb * BLOCK], DType::F32, rows.device())?;
    padded.narrow(1, 0, len)?.copy_from(rows)?;
    let blocked = padded.reshape(&[r, nb, BLOCK])?;
    let scales = blocked
        .abs()?
        .amax(&[2], true)?
        .clamp(MIN_SCALE, f64::INFINITY)?
        .mul_scalar(1.0 / 127.0)?;
    let mut y = blocked.div(&scales)?;
    if let Some(u) = noise {
        // the cast rounds to the nearest: floor(y + u) is round(y + u - 1/2) but at ties
        y = y.add(&u.reshape(&[r, nb, BLOCK])?)?.add_scalar(-0.5)?;
    }
    let q = y.to_dtype(DType::I8)?.reshape(&[r, nb * BLOCK])?;
    Ok((q, scales.reshape(&[r, nb])?))
}

/// `q` (`[r, blocks·BLOCK]` int8) and `scales` (`[r, blocks]`) back to f32 rows of `len`
/// elements (`[r, len]`).
pub fn dequantize_rows(q: &Tensor, scales: &Tensor, len: usize) -> Result<Tensor> {
    let (r, nb) = (scales.shape()[0], scales.shape()[1]);
    let values = q
        .to_dtype(DType::F32)?
        .reshape(&[r, nb, BLOCK])?
        .mul(&scales.reshape(&[r, nb, 1])?)?
        .reshape(&[r, nb * BLOCK])?;
    Ok(values.narrow(1, 0, len)?.contiguous()?)
}

/// qwZ: all-gathers `shard` (this rank's f32 shard of a unit) quantized; completes with every
/// rank's dequantized shard, rank-major, in `dtype` (`[world · shard]` elements).
pub fn gather_weights(comm: &Group, shard: &Tensor, dtype: DType, tag: &str) -> Result<TensorWork<Tensor>> {
    let len = shard.numel();
    let (q, scales) = quantize_rows(&shard.reshape(&[1, len])?, None)?;
    let world = comm.world_size();
    let gathered = comm.all_gather_with_side(&q.reshape(&[q.numel()])?, &scales.reshape(&[scales.numel()])?, tag);
    Ok(gathered.then(move |(q, s)| {
        let full = dequantize_rows(&q, &s, len)?.reshape(&[world * len])?;
        Ok(match dtype {
            DType::F32 => full,
            _ => full.to_dtype(dtype)?,
        })
    }))
}

/// qgZ's state: how many reductions it has drawn rounding noise for (every rank the same).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QgzState {
    /// Reductions drawn so far.
    pub draws: u64,
}

/// The key of [`QgzState`] in the policy's state dict.
pub const QGZ_STATE_KEY: &str = "zero3.qgz.draws";

impl QgzState {
    /// The state as the policy's state dict.
    pub fn state_dict(&self) -> Vec<(String, Tensor)> {
        vec![(
            QGZ_STATE_KEY.to_string(),
            Tensor::from_vec(vec![self.draws as i64], &[1]).expect("one element"),
        )]
    }

    /// The state from a state dict (absent: none drawn yet).
    pub fn load(state: &[(String, Tensor)]) -> Result<QgzState> {
        let Some((_, t)) = state.iter().find(|(k, _)| k == QGZ_STATE_KEY) else {
            return Ok(QgzState::default());
        };
        let v = t.to_dtype(DType::I64)?.to_vec::<i64>()?;
        match v.as_slice() {
            [d] if *d >= 0 => Ok(QgzState { draws: *d as u64 }),
            _ => Err(brigade_ddp::DdpError::Policy {
                policy: "zero3".into(),
                reason: format!("state '{QGZ_STATE_KEY}' must be one count >= 0, got {v:?}"),
            }),
        }
    }

    /// The rounding noise of this reduction on `rank` (`[world, blocks·BLOCK]`), advancing the
    /// counter.
    fn noise(&mut self, rank: usize, shape: &[usize], bucket: &Tensor) -> Result<Tensor> {
        let seed = splitmix(0x5a45_524f_2b2b ^ ((rank as u64) << 48) ^ self.draws);
        self.draws += 1;
        let mut rng = Rng::new(seed);
        Ok(Tensor::rand_uniform(shape, 0.0, 1.0, DType::F32, &mut rng).to_device(bucket.device())?)
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// qgZ: this rank's chunk of the average of every rank's `bucket` (padded to a multiple of
/// the ranks), each rank's chunks quantized by stochastic rounding, all-gathered whole, and
/// summed in rank order after dequantizing; in the bucket's dtype.
pub fn reduce_gradients(comm: &Group, bucket: &Tensor, state: &mut QgzState, tag: &str) -> Result<TensorWork<Tensor>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dtype = bucket.dtype();
    let per = bucket.numel() / world;
    let rows = match dtype {
        DType::F32 => bucket.reshape(&[world, per])?,
        _ => bucket.to_dtype(DType::F32)?.reshape(&[world, per])?,
    };
    let nb = blocks(per);
    let noise = state.noise(rank, &[world, nb * BLOCK], bucket)?;
    let (q, scales) = quantize_rows(&rows, Some(&noise))?;
    let gathered = comm.all_gather_with_side(&q.reshape(&[q.numel()])?, &scales.reshape(&[scales.numel()])?, tag);
    Ok(gathered.then(move |(q, s)| {
        // every rank's copy of this rank's chunk: [world, nb·BLOCK] and [world, nb]
        let mine = q.narrow(1, rank * nb * BLOCK, nb * BLOCK)?;
        let scales = s.narrow(1, rank * nb, nb)?;
        let values = dequantize_rows(&mine, &scales, per)?;
        let sum = values.narrow(0, 0, 1)?.copy()?;
        for r in 1..world {
            sum.add_assign(&values.narrow(0, r, 1)?)?;
        }
        let mean = sum.mul_scalar(1.0 / world as f64)?.reshape(&[per])?;
        Ok(match dtype {
            DType::F32 => mean,
            _ => mean.to_dtype(dtype)?,
        })
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blockwise_int8_is_within_half_a_blocks_scale_of_each_element() {
        let mut rng = Rng::new(7);
        // blocks of very different magnitudes, and a last block cut short
        let len = 3 * BLOCK + 17;
        let x: Vec<f32> = (0..len)
            .map(|i| rng.normal() as f32 * [1e-3, 5.0, 0.1, 30.0][i / BLOCK])
            .collect();
        let rows = Tensor::from_vec(x.clone(), &[1, len]).unwrap();
        let (q, s) = quantize_rows(&rows, None).unwrap();
        assert_eq!(q.shape(), &[1, 4 * BLOCK]);
        let back = dequantize_rows(&q, &s, len).unwrap().to_vec::<f32>().unwrap();
        let s = s.to_vec::<f32>().unwrap();
        for (i, (a, b)) in x.iter().zip(&back).enumerate() {
            let block_max = x[i / BLOCK * BLOCK..((i / BLOCK + 1) * BLOCK).min(len)]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            // the scale is the block's largest magnitude times 1/127 (to the last bit)
            assert!(
                (s[i / BLOCK] - block_max / 127.0).abs() <= block_max * 1e-7,
                "element {i}"
            );
            assert!(
                (a - b).abs() <= s[i / BLOCK] / 2.0 * (1.0 + 1e-6),
                "element {i}: {a} {b}"
            );
        }
    }

    #[test]
    fn stochastic_rounding_lands_on_a_neighbouring_step_and_is_unbiased() {
        // one block of 0.3 steps: floor(0.3 + u) is 1 for u >= 0.7
        let len = BLOCK;
        let mut x = vec![0.3f32 * 127.0 / 127.0; len];
        x[0] = 127.0;
        let rows = Tensor::from_vec(x, &[1, len]).unwrap();
        let mut rng = Rng::new(3);
        let mut mean = 0.0;
        let trials = 200;
        for _ in 0..trials {
            let u = Tensor::rand_uniform(&[1, len], 0.0, 1.0, DType::F32, &mut rng);
            let (q, _) = quantize_rows(&rows, Some(&u)).unwrap();
            let q = q.to_vec::<i8>().unwrap();
            assert_eq!(q[0], 127);
            assert!(q[1..].iter().all(|&v| v == 0 || v == 1), "{q:?}");
            mean += q[1..].iter().map(|&v| v as f64).sum::<f64>() / (len - 1) as f64;
        }
        let mean = mean / trials as f64;
        assert!((mean - 0.3).abs() < 0.01, "mean {mean}");
    }
}
