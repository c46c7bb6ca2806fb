//! What each rank says it is doing in a slot, and the checks that all ranks agree.

use std::fmt;

pub(crate) use crate::collective::OpKind;
use crate::collective::{check_runnable_on_host, describe};
use crate::{CommError, DType};

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
        self.kind == other.kind && self.dtype == other.dtype && self.len == other.len && self.tag == other.tag
    }
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&describe(self.kind, self.dtype, self.len as u64, &self.tag))
    }
}

/// Checks that every rank issued the same collective and that it can run. Every rank calls this
/// on the same descriptors, so every rank reaches the same verdict.
pub(crate) fn validate(descs: &[OpDesc]) -> Result<(), CommError> {
    let reference = &descs[0];
    if let Some((found_rank, found)) = descs.iter().enumerate().find(|(_, d)| !d.same_collective(reference)) {
        return Err(CommError::Mismatch {
            tag: reference.tag.clone(),
            slot: reference.slot,
            expected_rank: 0,
            expected: reference.to_string(),
            found_rank,
            found: found.to_string(),
        });
    }
    check_runnable_on_host(
        reference.kind,
        reference.dtype,
        reference.len as u64,
        descs.len(),
        &reference.tag,
    )
}
