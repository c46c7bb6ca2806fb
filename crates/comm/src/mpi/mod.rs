//! The MPI backend: one rank per process under `mpirun`, over the `mpi` crate (rsmpi) and the
//! system's MPI library (tested with Open MPI 4.1). Built only with the `mpi` feature.
//!
//! - [`MpiWorld`]: MPI's lifetime in the process (init once, rank and size from the launcher,
//!   [`MpiWorld::abort`], finalize on drop).
//! - [`MpiTransport`]: the [`crate::Transport`] whose non-blocking collectives the comm stream's
//!   thread polls; [`MpiComm`] is it behind a [`crate::CommStream`], so it has the thread
//!   backend's semantics: issue order, async [`crate::Work`] handles, mismatch detection, f32
//!   accumulation for f16/bf16, timeouts.
//!
//! Across machines nothing beyond MPI's host list is needed:
//! `mpirun --host a,b -np 2 brigade train --backend mpi ...`.

mod bench;
mod desc;
mod raw;
mod transport;
mod world;

pub use transport::MpiTransport;
pub use world::{MpiComm, MpiWorld};
