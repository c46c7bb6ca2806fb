//! Helpers shared by the comm tests: deterministic inputs, a serial reference, a scratch
//! directory.
#![allow(dead_code)]

use brigade_comm::{Buffer, DType, ReduceOp};
use half::{bf16, f16};

#[path = "../../../../test-support/scratch.rs"]
mod scratch;
pub use scratch::Scratch;

pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
pub const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// Deterministic value of element `i` on `rank`: a multiple of 1/64 in [-15.6, 15.6], varying
/// with both arguments (so a wrong chunk or rank shows up).
pub fn value(rank: usize, i: usize, salt: usize) -> f32 {
    let mut h = (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (salt as u64).wrapping_mul(0x1656_67B1_9E37_79F9);
    h ^= h >> 29;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 32;
    ((h % 2001) as f32 - 1000.0) / 64.0
}

/// Rank `rank`'s input of `len` elements.
pub fn input(dtype: DType, rank: usize, len: usize, salt: usize) -> Buffer {
    let xs = (0..len).map(|i| value(rank, i, salt));
    match dtype {
        DType::F32 => Buffer::F32(xs.collect()),
        DType::F16 => Buffer::F16(xs.map(f16::from_f32).collect()),
        DType::BF16 => Buffer::BF16(xs.map(bf16::from_f32).collect()),
        DType::U8 => Buffer::U8(xs.map(|x| x as i8 as u8).collect()),
        DType::I8 => Buffer::I8(xs.map(|x| x as i8).collect()),
        other => panic!("buffers hold no {other}"),
    }
}

/// The buffer as f32 values (exact for every dtype).
pub fn to_f32(buf: &Buffer) -> Vec<f32> {
    match buf {
        Buffer::F32(v) => v.clone(),
        Buffer::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        Buffer::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        Buffer::U8(v) => v.iter().map(|&x| x as f32).collect(),
        Buffer::I8(v) => v.iter().map(|&x| x as f32).collect(),
        other => panic!("collectives move no {}", other.dtype()),
    }
}

/// Rounds f32 values to `dtype`.
pub fn from_f32(dtype: DType, xs: Vec<f32>) -> Buffer {
    match dtype {
        DType::F32 => Buffer::F32(xs),
        DType::F16 => Buffer::F16(xs.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => Buffer::BF16(xs.into_iter().map(bf16::from_f32).collect()),
        DType::U8 => Buffer::U8(xs.into_iter().map(|x| x as u8).collect()),
        DType::I8 => Buffer::I8(xs.into_iter().map(|x| x as i8).collect()),
        other => panic!("buffers hold no {other}"),
    }
}

/// Serial reference reduction: f32 accumulation in rank order, then rounding to the dtype.
pub fn reference_reduce(inputs: &[Buffer], op: ReduceOp) -> Buffer {
    let dtype = inputs[0].dtype();
    let vals: Vec<Vec<f32>> = inputs.iter().map(to_f32).collect();
    let len = vals[0].len();
    let mut out = vals[0].clone();
    for v in &vals[1..] {
        for i in 0..len {
            out[i] = match op {
                ReduceOp::Sum | ReduceOp::Avg => out[i] + v[i],
                // NaN-propagating, as torch.max: a NaN on any rank wins
                ReduceOp::Max if out[i].is_nan() || v[i].is_nan() => f32::NAN,
                ReduceOp::Max => out[i].max(v[i]),
            };
        }
    }
    if op == ReduceOp::Avg {
        out.iter_mut().for_each(|x| *x /= inputs.len() as f32);
    }
    from_f32(dtype, out)
}

/// Asserts equality, printing the first differing element.
pub fn assert_same(got: &Buffer, want: &Buffer, what: &str) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.len(), want.len(), "{what}: length");
    if got != want {
        let (g, w) = (to_f32(got), to_f32(want));
        let i = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()).unwrap();
        panic!("{what}: element {i} is {} but the reference says {}", g[i], w[i]);
    }
}

impl Scratch {
    /// The directory `brigade-{name}-{pid}` in the system temp dir, made empty.
    pub fn dir(name: &str) -> Scratch {
        Scratch::empty_dir(std::env::temp_dir().join(format!("brigade-{name}-{}", std::process::id())))
    }
}
