//! What a collective is, as every backend states it: the reduction operators, which
//! collective, how it reads in an error message, whether it can run at all, and each rank's
//! descriptor of the collective in a slot with the checks that all ranks agree on it. The
//! thread backend compares the descriptors in memory (beside each the tag's text and the
//! rank's buffer); the MPI backend and the shared-memory path compare them as fixed-size
//! records before any data moves. Shared so that every backend reaches the same verdicts with
//! the same words.

use std::fmt;

use crate::{CommError, DType};

/// How a reduction combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks, accumulated in f32 in rank order (rank 0 first).
    Sum,
    /// Sum (as above) divided by the world size.
    Avg,
    /// Element-wise maximum; a NaN on any rank makes the result NaN, as `torch.max` and
    /// `torch.distributed`'s `MAX` do (see `nan_max`), so a diverged rank is never hidden.
    Max,
}

/// The maximum of `a` and `b`, NaN when either is NaN (unlike `f32::max`, which drops it).
/// Both backends reduce `Max` with this, so they agree whatever the order of the ranks.
pub(crate) fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        })
    }
}

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    AllReduce(ReduceOp),
    Broadcast { root: usize },
    AllGather,
    ReduceScatter(ReduceOp),
    Barrier,
}

/// `all_reduce(sum, 1024 x f32, tag `bucket0`)`.
pub(crate) fn describe(kind: OpKind, dtype: Option<DType>, len: u64, tag: &str) -> String {
    let mut args = Vec::new();
    let name = match kind {
        OpKind::AllReduce(op) => {
            args.push(op.to_string());
            "all_reduce"
        }
        OpKind::Broadcast { root } => {
            args.push(format!("root {root}"));
            "broadcast"
        }
        OpKind::AllGather => "all_gather",
        OpKind::ReduceScatter(op) => {
            args.push(op.to_string());
            "reduce_scatter"
        }
        OpKind::Barrier => "barrier",
    };
    if let Some(dtype) = dtype {
        args.push(format!("{len} x {dtype}"));
    }
    args.push(format!("tag `{tag}`"));
    format!("{name}({})", args.join(", "))
}

/// [`check_runnable`] for the host transports (threads, MPI), whose kernels reduce f32, f16 and
/// bf16 (with f32 accumulation) but not f64.
pub(crate) fn check_runnable_on_host(
    kind: OpKind,
    dtype: Option<DType>,
    len: u64,
    world: usize,
    tag: &str,
) -> Result<(), CommError> {
    if matches!(kind, OpKind::AllReduce(_) | OpKind::ReduceScatter(_)) && dtype == Some(DType::F64) {
        return Err(CommError::Unsupported(format!(
            "reduction on f64 buffers: {}; the host collectives reduce f32, f16 and bf16",
            describe(kind, dtype, len, tag)
        )));
    }
    check_runnable(kind, dtype, len, world, tag)
}

/// Checks that a collective all ranks agreed on can run in a group of `world` ranks.
#[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
pub(crate) fn check_runnable(
    kind: OpKind,
    dtype: Option<DType>,
    len: u64,
    world: usize,
    tag: &str,
) -> Result<(), CommError> {
    let described = || describe(kind, dtype, len, tag);
    match kind {
        OpKind::AllReduce(_) | OpKind::ReduceScatter(_)
            if matches!(dtype, Some(DType::U8 | DType::I8 | DType::I64)) =>
        {
            Err(CommError::Unsupported(format!(
                "reduction on {} buffers: {}; integer payloads are not summed in their own type: all-gather \
                 the payloads with their scales (all_gather_with_side) and sum in f32",
                dtype.map_or("", DType::name),
                described()
            )))
        }
        OpKind::ReduceScatter(_) if len % world as u64 != 0 => Err(CommError::InvalidArgument(format!(
            "{}: input length {len} is not a multiple of the world size {world}",
            described()
        ))),
        OpKind::Broadcast { root } if root >= world => Err(CommError::InvalidArgument(format!(
            "{}: root {root} is not a rank of a group of {world}",
            described()
        ))),
        _ => Ok(()),
    }
}

/// Bytes of one encoded descriptor.
pub(crate) const DESC_BYTES: usize = 40;

/// One rank's description of the collective in the current slot. The tag travels as a hash
/// and a length; the text is fetched only to report a mismatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub(crate) slot: u64,
    pub(crate) kind: OpKind,
    pub(crate) dtype: Option<DType>,
    /// Input length in elements.
    pub(crate) len: u64,
    pub(crate) tag_hash: u64,
    pub(crate) tag_len: u32,
}

/// 64-bit FNV-1a: stable across processes and builds (unlike `DefaultHasher`'s promise).
pub(crate) fn tag_hash(tag: &str) -> u64 {
    tag.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
    }
}

fn op_from(code: u8) -> Option<ReduceOp> {
    [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
        .get(code as usize)
        .copied()
}

fn dtype_code(dtype: Option<DType>) -> u8 {
    match dtype {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::F16) => 2,
        Some(DType::BF16) => 3,
        Some(DType::U8) => 4,
        Some(DType::F64) => 5,
        Some(DType::I64) => 6,
        Some(DType::I8) => 7,
    }
}

fn dtype_from(code: u8) -> Option<Option<DType>> {
    [
        None,
        Some(DType::F32),
        Some(DType::F16),
        Some(DType::BF16),
        Some(DType::U8),
        Some(DType::F64),
        Some(DType::I64),
        Some(DType::I8),
    ]
    .get(code as usize)
    .copied()
}

impl OpDesc {
    pub(crate) fn new(slot: u64, kind: OpKind, dtype: Option<DType>, len: usize, tag: &str) -> Self {
        OpDesc {
            slot,
            kind,
            dtype,
            len: len as u64,
            tag_hash: tag_hash(tag),
            tag_len: tag.len().min(u32::MAX as usize) as u32,
        }
    }

    /// Layout: slot u64, len u64, tag hash u64, root u64, tag length u32, kind u8, op u8,
    /// dtype u8, one zero byte; little-endian.
    pub(crate) fn encode(&self) -> [u8; DESC_BYTES] {
        let (kind, op, root) = match self.kind {
            OpKind::AllReduce(op) => (0u8, op_code(op), 0u64),
            OpKind::Broadcast { root } => (1, 0, root as u64),
            OpKind::AllGather => (2, 0, 0),
            OpKind::ReduceScatter(op) => (3, op_code(op), 0),
            OpKind::Barrier => (4, 0, 0),
        };
        let mut out = [0u8; DESC_BYTES];
        out[0..8].copy_from_slice(&self.slot.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.tag_hash.to_le_bytes());
        out[24..32].copy_from_slice(&root.to_le_bytes());
        out[32..36].copy_from_slice(&self.tag_len.to_le_bytes());
        out[36] = kind;
        out[37] = op;
        out[38] = dtype_code(self.dtype);
        out
    }

    /// Inverse of [`OpDesc::encode`]; `None` for bytes no rank of this build would send.
    pub(crate) fn decode(b: &[u8]) -> Option<OpDesc> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let op = op_from(b[37]);
        let kind = match b[36] {
            0 => OpKind::AllReduce(op?),
            1 => OpKind::Broadcast {
                root: usize::try_from(u64_at(24)).ok()?,
            },
            2 => OpKind::AllGather,
            3 => OpKind::ReduceScatter(op?),
            4 => OpKind::Barrier,
            _ => return None,
        };
        Some(OpDesc {
            slot: u64_at(0),
            kind,
            dtype: dtype_from(b[38])?,
            len: u64_at(8),
            tag_hash: u64_at(16),
            tag_len: u32::from_le_bytes(b[32..36].try_into().unwrap()),
        })
    }

    /// The fields two ranks must agree on (everything but the slot), as words whose
    /// bitwise AND over all ranks equals the NOT of the AND of their complements exactly when
    /// every rank sent the same words: one small `MPI_BAND` all-reduce of
    /// [`AGREE_WORDS`]` * 2` words decides agreement, whatever the number of ranks.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // the MPI backend agrees by these words
    pub(crate) fn agreement_words(&self) -> [u64; 2 * AGREE_WORDS] {
        let e = self.encode();
        let u64_at = |i: usize| u64::from_le_bytes(e[i..i + 8].try_into().unwrap());
        let w = [u64_at(8), u64_at(16), u64_at(24), u64_at(32)];
        [w[0], w[1], w[2], w[3], !w[0], !w[1], !w[2], !w[3]]
    }

    pub(crate) fn same_collective(&self, other: &OpDesc) -> bool {
        self.kind == other.kind
            && self.dtype == other.dtype
            && self.len == other.len
            && self.tag_hash == other.tag_hash
            && self.tag_len == other.tag_len
    }

    /// `all_reduce(sum, 1024 x f32, tag `b0`)`, with this rank's tag.
    pub(crate) fn describe(&self, tag: &str) -> String {
        describe(self.kind, self.dtype, self.len, tag)
    }
}

/// Words of [`OpDesc::agreement_words`] before their complements: length, tag hash, root, and
/// tag length with kind, op and dtype.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) const AGREE_WORDS: usize = 4;

/// Whether the bitwise AND over all ranks of their [`OpDesc::agreement_words`] says that they
/// all sent the same words (a bit set on some ranks only is 0 in the AND of the words and 0 in
/// the AND of the complements).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn all_agree(and: &[u64; 2 * AGREE_WORDS]) -> bool {
    (0..AGREE_WORDS).all(|i| and[i] == !and[AGREE_WORDS + i])
}

/// The first rank whose descriptor differs from rank 0's, if any. Every rank calls this on the
/// same all-gathered descriptors, so every rank reaches the same verdict.
pub(crate) fn first_mismatch(descs: &[OpDesc]) -> Option<usize> {
    descs.iter().position(|d| !d.same_collective(&descs[0]))
}

/// Checks that the agreed collective can run (`tag` is this rank's, equal to everyone's).
pub(crate) fn validate(reference: &OpDesc, world: usize, tag: &str) -> Result<(), CommError> {
    check_runnable_on_host(reference.kind, reference.dtype, reference.len, world, tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_through_bytes() {
        let kinds = [
            OpKind::AllReduce(ReduceOp::Avg),
            OpKind::Broadcast { root: 3 },
            OpKind::AllGather,
            OpKind::ReduceScatter(ReduceOp::Max),
            OpKind::Barrier,
        ];
        for (i, kind) in kinds.into_iter().enumerate() {
            let d = OpDesc::new(i as u64 + 7, kind, Some(DType::BF16), 1 << 33, "grad 3");
            assert_eq!(OpDesc::decode(&d.encode()), Some(d));
        }
        let barrier = OpDesc::new(0, OpKind::Barrier, None, 0, "");
        assert_eq!(OpDesc::decode(&barrier.encode()), Some(barrier));
    }

    #[test]
    fn the_and_of_agreement_words_detects_any_difference() {
        let and = |ds: &[OpDesc]| {
            ds.iter()
                .map(OpDesc::agreement_words)
                .fold([!0u64; 2 * AGREE_WORDS], |mut acc, w| {
                    acc.iter_mut().zip(w).for_each(|(a, w)| *a &= w);
                    acc
                })
        };
        let a = OpDesc::new(0, OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 8, "b0");
        // The slot is not compared (it is the same on every rank by construction).
        let later = OpDesc::new(5, OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 8, "b0");
        assert!(all_agree(&and(&[a.clone(), a.clone(), later])));
        let others = [
            OpDesc::new(0, OpKind::AllReduce(ReduceOp::Avg), Some(DType::F32), 8, "b0"),
            OpDesc::new(0, OpKind::AllReduce(ReduceOp::Sum), Some(DType::BF16), 8, "b0"),
            OpDesc::new(0, OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 9, "b0"),
            OpDesc::new(0, OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 8, "b1"),
            OpDesc::new(0, OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 8, "b0 "),
            OpDesc::new(0, OpKind::Broadcast { root: 0 }, Some(DType::F32), 8, "b0"),
            OpDesc::new(0, OpKind::ReduceScatter(ReduceOp::Sum), Some(DType::F32), 8, "b0"),
        ];
        for other in others {
            for pos in 0..3 {
                let mut ds = vec![a.clone(); 3];
                ds[pos] = other.clone();
                assert!(!all_agree(&and(&ds)), "{other:?} at rank {pos}");
                assert!(first_mismatch(&ds).is_some());
            }
        }
        let b = |root| OpDesc::new(0, OpKind::Broadcast { root }, Some(DType::U8), 8, "b");
        assert!(!all_agree(&and(&[b(0), b(1)])));
        assert!(all_agree(&and(&[b(1), b(1)])));
    }

    #[test]
    fn a_different_tag_or_length_is_a_mismatch() {
        let a = OpDesc::new(0, OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 8, "b0");
        let tag = OpDesc::new(0, OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 8, "b1");
        let len = OpDesc::new(0, OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 9, "b0");
        assert_eq!(first_mismatch(&[a.clone(), a.clone()]), None);
        assert_eq!(first_mismatch(&[a.clone(), a.clone(), tag]), Some(2));
        assert_eq!(first_mismatch(&[a, len]), Some(1));
    }
}
