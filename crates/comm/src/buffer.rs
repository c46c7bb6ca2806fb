//! The flat buffers collectives move.

use half::{bf16, f16};

/// Element type of a [`Buffer`]: Brigade's one [`DType`] (a tensor's storage names its
/// elements with the same type). Buffers hold `F32`, `F16`, `BF16` (reduced with f32
/// accumulation), and the integer payloads `U8` (raw bytes) and `I8` (quantized values).
///
/// **Integer payloads are never reduced in their own type**: a sum of `k` int8 values needs
/// more than 8 bits, and each rank's values mean something only with that rank's scale. They
/// move with broadcast and all-gather; an all-reduce or reduce-scatter of one returns
/// [`crate::CommError::Unsupported`]. The rule for a quantizing policy is PyTorch's
/// (`quantization_pertensor_hook`): all-gather every rank's payload **and** its scales (one
/// collective: [`crate::all_gather_with_side`]), then dequantize each rank's piece with its own
/// scales and sum in f32 on every rank, in rank order.
pub use brigade_dtype::DType;

/// A flat typed buffer handed to a collective by value and handed back by
/// [`crate::Work::wait`]: the same `Vec`, never a copy, so the caller regains its allocation.
/// It is the host buffer of `brigade-dtype`, the one a CPU tensor's storage is, so a tensor's
/// memory is lent to a collective as it is. Reductions take `F32`, `F16` and `BF16` (and `F64`
/// on NCCL); integer payloads only move (see [`DType`]).
pub use brigade_dtype::Buffer;

/// A buffer of `dtype` from little-endian bytes (a whole number of elements), or `None` for a
/// length that is not a multiple of the element size (how a
/// side buffer travels packed beside its payload in [`crate::all_gather_with_side`]).
#[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
pub fn buffer_from_le_bytes(dtype: DType, bytes: &[u8]) -> Option<Buffer> {
    let size = dtype.size_in_bytes();
    if bytes.len() % size != 0 {
        return None;
    }
    Some(match dtype {
        DType::F32 => Buffer::F32(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        DType::F16 => Buffer::F16(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        DType::BF16 => Buffer::BF16(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        DType::U8 => Buffer::U8(bytes.to_vec()),
        DType::I8 => Buffer::I8(bytes.iter().map(|&b| b as i8).collect()),
        DType::F64 => Buffer::F64(
            bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        ),
        DType::I64 => Buffer::I64(
            bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        ),
    })
}

#[cfg(test)]
mod tests {
    use crate::{run_on_threads, Buffer, CommError, ReduceOp};

    #[test]
    fn host_collectives_move_f64_and_i64_buffers_and_refuse_to_reduce_them() {
        let got = run_on_threads(2, |c| {
            let f = c.all_reduce(Buffer::F64(vec![1.0]), ReduceOp::Sum, "f64").wait();
            let i = c.all_reduce(Buffer::I64(vec![1]), ReduceOp::Sum, "i64").wait();
            let moved = c.broadcast(Buffer::I64(vec![c.rank() as i64 + 5]), 0, "b").wait();
            let gathered = c.all_gather(Buffer::F64(vec![c.rank() as f64 - 0.5]), "g").wait();
            (f, i, moved, gathered)
        });
        for r in got {
            let (f, i, moved, gathered) = r.unwrap();
            assert!(
                matches!(&f, Err(CommError::Unsupported(m)) if m.contains("f64")),
                "{f:?}"
            );
            assert!(
                matches!(&i, Err(CommError::Unsupported(m)) if m.contains("i64")),
                "{i:?}"
            );
            assert_eq!(moved.unwrap(), Buffer::I64(vec![5]));
            assert_eq!(gathered.unwrap(), Buffer::F64(vec![-0.5, 0.5]));
        }
    }
}
