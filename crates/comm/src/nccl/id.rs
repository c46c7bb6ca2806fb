//! The NCCL unique id: rank 0 creates it, every other rank must receive its 128 bytes before
//! joining the communicator.

use cudarc::nccl::{result, sys};

use crate::{Buffer, CommError, Communicator};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// An NCCL unique id (`ncclUniqueId`), what every rank passes to join one communicator.
#[derive(Clone, Copy)]
pub struct NcclId(pub(crate) sys::ncclUniqueId);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId(..)")
    }
}

impl NcclId {
    /// A fresh id (rank 0 only). NCCL must be present ([`super::require_nccl`]).
    pub fn new() -> Result<Self, CommError> {
        super::require_nccl()?;
        result::get_uniqueid().map(NcclId).map_err(|e| CommError::Nccl {
            rank: 0,
            tag: "ncclGetUniqueId".into(),
            detail: format!("{:?}", e.0),
        })
    }

    /// The id's 128 bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; ID_BYTES] {
        self.0.internal.map(|c| c as u8)
    }

    /// The id from its 128 bytes.
    pub fn from_bytes(bytes: &[u8; ID_BYTES]) -> Self {
        NcclId(sys::ncclUniqueId {
            internal: bytes.map(|b| b as ::core::ffi::c_char),
        })
    }
}

/// Rank 0 creates the id and broadcasts its 128 bytes (plus one status byte) over `control`:
/// with the thread backend the bytes move in memory, under MPI by one `MPI_Bcast`. When rank 0
/// cannot create it (no libnccl), every rank gets the error instead of waiting for an id.
pub fn exchange_id(control: &dyn Communicator) -> Result<NcclId, CommError> {
    let mut bytes = vec![0u8; ID_BYTES + 1];
    let mut failure = None;
    if control.rank() == 0 {
        match NcclId::new() {
            Ok(id) => {
                bytes[0] = 1;
                bytes[1..].copy_from_slice(&id.to_bytes());
            }
            Err(e) => failure = Some(e),
        }
    }
    let got = control.broadcast(Buffer::U8(bytes), 0, "nccl.unique_id").wait()?;
    if let Some(e) = failure {
        return Err(e);
    }
    let got = got
        .into_u8()
        .map_err(|b| CommError::Internal(format!("broadcast of u8 returned {}", b.dtype())))?;
    match got.split_first() {
        Some((1, id)) if id.len() == ID_BYTES => Ok(NcclId::from_bytes(id.try_into().expect("128 bytes"))),
        _ => Err(CommError::Unavailable(
            "rank 0 could not create the NCCL unique id (see rank 0's error)".into(),
        )),
    }
}
