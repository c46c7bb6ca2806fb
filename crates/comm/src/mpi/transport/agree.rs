//! Step 1 of a slot: agreement, and after a disagreement the descriptors and tags every rank
//! gathers so that all fail naming both ranks (see the parent module).

use std::ffi::c_int;
use std::time::Instant;

use ::mpi::ffi;

use super::MpiTransport;
use crate::collective::{all_agree, first_mismatch, validate, OpDesc, DESC_BYTES};
use crate::mpi::raw::{self, mpi_check};
use crate::CommError;

/// Longest tag text shown in a mismatch error.
const MAX_TAG_BYTES: usize = 256;

impl MpiTransport {
    /// Step 1: every rank learns whether all issued the same collective, and whether it can
    /// run.
    pub(super) fn agree(&mut self, desc: &OpDesc, tag: &str, deadline: Instant) -> Result<(), CommError> {
        if let Some(node) = self.node.as_mut().filter(|n| n.single_node()) {
            return node.shm.agree(desc, tag, self.world, deadline);
        }
        let mut words = desc.agreement_words();
        let comm = self.comm.as_ref().expect("communicator present until drop");
        self.guarded(desc, tag, "MPI_Allreduce(descriptor)", deadline, || {
            comm.all_reduce_u64(self.rank, &mut words, raw::band_op(), "MPI_Allreduce(descriptor)")
        })?;
        if all_agree(&words) {
            return validate(desc, self.world, tag);
        }
        let descs = self.gather_descriptors(desc, tag, deadline)?;
        let found_rank = first_mismatch(&descs).ok_or_else(|| {
            CommError::Internal(format!(
                "rank {}: the descriptor words of collective `{tag}` differ but the descriptors do not",
                self.rank
            ))
        })?;
        let tags = self.gather_tags(desc, &descs, tag, deadline)?;
        Err(CommError::Mismatch {
            tag: tags[0].clone(),
            slot: descs[0].slot,
            expected_rank: 0,
            expected: descs[0].describe(&tags[0]),
            found_rank,
            found: descs[found_rank].describe(&tags[found_rank]),
        })
    }

    /// After a disagreement (every rank saw it): all-gathers every rank's `width` bytes.
    fn all_gather_bytes(
        &mut self,
        desc: &OpDesc,
        mine: &[u8],
        tag: &str,
        what: &'static str,
        deadline: Instant,
    ) -> Result<Vec<u8>, CommError> {
        let width = mine.len();
        let mut all = vec![0u8; self.world * width];
        let (send, recv, comm, rank) = (mine.as_ptr(), all.as_mut_ptr(), self.comm(), self.rank);
        self.guarded(desc, tag, what, deadline, || {
            mpi_check!(rank, what, unsafe {
                ffi::MPI_Allgather(
                    send.cast(),
                    width as c_int,
                    ffi::RSMPI_UINT8_T,
                    recv.cast(),
                    width as c_int,
                    ffi::RSMPI_UINT8_T,
                    comm,
                )
            })
        })?;
        Ok(all)
    }

    fn gather_descriptors(&mut self, desc: &OpDesc, tag: &str, deadline: Instant) -> Result<Vec<OpDesc>, CommError> {
        let all = self.all_gather_bytes(desc, &desc.encode(), tag, "MPI_Allgather(descriptors)", deadline)?;
        all.chunks(DESC_BYTES)
            .enumerate()
            .map(|(r, b)| {
                OpDesc::decode(b).ok_or_else(|| {
                    CommError::Internal(format!(
                        "rank {}: rank {r} sent an unreadable descriptor in collective `{tag}` \
                         (a different Brigade build?)",
                        self.rank
                    ))
                })
            })
            .collect()
    }

    /// Every rank's tag text, padded to the longest (at most [`MAX_TAG_BYTES`]).
    fn gather_tags(
        &mut self,
        desc: &OpDesc,
        descs: &[OpDesc],
        tag: &str,
        deadline: Instant,
    ) -> Result<Vec<String>, CommError> {
        let width = descs
            .iter()
            .map(|d| d.tag_len as usize)
            .max()
            .unwrap_or(0)
            .min(MAX_TAG_BYTES);
        if width == 0 {
            return Ok(vec![String::new(); self.world]);
        }
        let mut mine = tag.as_bytes()[..tag.len().min(width)].to_vec();
        mine.resize(width, 0);
        let all = self.all_gather_bytes(desc, &mine, tag, "MPI_Allgather(tags)", deadline)?;
        Ok((0..self.world)
            .map(|r| {
                let raw = &all[r * width..(r + 1) * width];
                let n = (descs[r].tag_len as usize).min(width);
                String::from_utf8_lossy(&raw[..n]).into_owned()
            })
            .collect())
    }
}
