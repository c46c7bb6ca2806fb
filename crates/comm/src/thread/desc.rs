//! What each rank says it is doing in a slot, and the checks that all ranks agree.

use std::fmt;

use crate::{CommError, DType, ReduceOp};

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    AllReduce(ReduceOp),
    Broadcast { root: usize },
    AllGather,
    ReduceScatter(ReduceOp),
    Barrier,
}

/// Address of a rank's buffer, shared with the peers for the duration of one collective.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedPtr(pub(crate) *mut u8);

// SAFETY: the pointer is only dereferenced between the two rendezvous of one collective, while
// the owning rank's stream is blocked in that collective and does not touch its buffer except
// through the same protocol (see `transport.rs`).
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

/// One rank's description of the collective in the current slot.
#[derive(Debug, Clone)]
pub(crate) struct OpDesc {
    pub(crate) slot: u64,
    pub(crate) kind: OpKind,
    pub(crate) dtype: Option<DType>,
    /// Input length in elements.
    pub(crate) len: usize,
    pub(crate) tag: String,
    pub(crate) ptr: SharedPtr,
}

impl OpDesc {
    fn same_collective(&self, other: &OpDesc) -> bool {
        self.kind == other.kind
            && self.dtype == other.dtype
            && self.len == other.len
            && self.tag == other.tag
    }
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut args = Vec::new();
        let name = match self.kind {
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
        if let Some(dtype) = self.dtype {
            args.push(format!("{} x {dtype}", self.len));
        }
        args.push(format!("tag `{}`", self.tag));
        write!(f, "{name}({})", args.join(", "))
    }
}

/// Checks that every rank issued the same collective and that it can run. Every rank calls this
/// on the same descriptors, so every rank reaches the same verdict.
#[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
pub(crate) fn validate(descs: &[OpDesc]) -> Result<(), CommError> {
    let reference = &descs[0];
    if let Some((found_rank, found)) =
        descs.iter().enumerate().find(|(_, d)| !d.same_collective(reference))
    {
        return Err(CommError::Mismatch {
            tag: reference.tag.clone(),
            slot: reference.slot,
            expected_rank: 0,
            expected: reference.to_string(),
            found_rank,
            found: found.to_string(),
        });
    }
    let world = descs.len();
    match reference.kind {
        OpKind::AllReduce(_) | OpKind::ReduceScatter(_) if reference.dtype == Some(DType::U8) => {
            Err(CommError::Unsupported(format!("reduction on u8 buffers: {reference}")))
        }
        OpKind::ReduceScatter(_) if reference.len % world != 0 => {
            Err(CommError::InvalidArgument(format!(
                "{reference}: input length {} is not a multiple of the world size {world}",
                reference.len
            )))
        }
        OpKind::Broadcast { root } if root >= world => Err(CommError::InvalidArgument(format!(
            "{reference}: root {root} is not a rank of a group of {world}"
        ))),
        _ => Ok(()),
    }
}
