//! The MPI backend: one rank per process under `mpirun`, over the `mpi` crate (rsmpi) and the
//! system's MPI library (tested with Open MPI 4.1). Built only with the `mpi` feature.
//!
//! - [`MpiWorld`]: MPI's lifetime in the process (init once, rank and size from the launcher,
//!   [`MpiWorld::abort`], finalize on drop).
//! - [`MpiTransport`]: the [`crate::Transport`] that runs each collective on the comm stream's
//!   thread: agreed on first, then through the node's shared segment, MPI's blocking
//!   collectives under a watchdog, or both (hierarchical across nodes); [`MpiComm`] is it
//!   behind a [`crate::CommStream`], so it has the thread backend's semantics: issue order,
//!   async [`crate::Work`] handles, mismatch detection, f32 accumulation for f16/bf16, timeouts.
//! - [`MpiOptions`]: the timeout, whether to use shared memory, and the node size
//!   (`BRIGADE_MPI_SHM`, `BRIGADE_NODE_SIZE`).
//!
//! Across machines nothing beyond MPI's host list is needed:
//! `mpirun --host a,b -np 2 brigade train --backend mpi ...`.

mod bench;
mod node;
mod raw;
mod transport;
mod watchdog;
mod world;

pub use transport::{MpiPath, MpiTransport};
pub use world::{MpiComm, MpiOptions, MpiWorld};
