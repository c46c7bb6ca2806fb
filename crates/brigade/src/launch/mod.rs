//! Starting ranks: N threads of this process, or this process's rank of an MPI job.
//!
//! [`run_ranks`] is what `torch.multiprocessing.spawn` + `init_process_group` give PyTorch
//! users: it prepares what the ranks share (its `setup`), hands each rank a [`RankContext`]
//! (its rank, the world size and its communicator stack, built by [`comm_stack`]) and returns
//! every result of this process's ranks, or the root-cause error naming its rank
//! ([`root_cause`]). The rank function is the same for every [`CommBackend`].
//!
//! The files, each importing only those below it: `context.rs` (the types), `comm_stack.rs`,
//! `root_cause.rs`, `binding.rs` (cores the launcher left a rank); then one file per backend: `threads.rs`, `mpi.rs`, `nccl.rs`; this file
//! dispatches.

mod binding;
mod comm_stack;
mod context;
mod mpi;
pub mod nccl;
mod root_cause;
mod threads;

pub use binding::binding_note;
pub use comm_stack::{comm_stack, net_model, SimLink};
pub use context::{default_threads, CommBackend, LaunchConfig, Launched, OnFatal, RankContext};
pub use root_cause::root_cause;

use crate::error::Result;

/// Starts the ranks `cfg` describes. `setup(world_size)` prepares what the ranks share (once
/// per process; under MPI every process's setup must succeed, or all fail with the first
/// failing rank's error); then `rank_fn` runs on every rank of this process.
///
/// Threads: a failing rank makes the others fail ("rank r is gone") instead of hanging; the
/// root cause is returned, naming its rank. MPI: an error in one rank ends the whole job
/// ([`LaunchConfig::on_fatal`] is told it first).
pub fn run_ranks<S: Sync, T: Send>(
    cfg: &LaunchConfig,
    setup: impl FnOnce(usize) -> Result<S>,
    rank_fn: impl Fn(&RankContext, &S) -> Result<T> + Sync,
) -> Result<Launched<T>> {
    match cfg.backend {
        CommBackend::Thread => threads::run_ranks(cfg, setup, rank_fn),
        CommBackend::Mpi => mpi::run_ranks(cfg, setup, rank_fn),
        CommBackend::Nccl if nccl::under_mpi() => mpi::run_ranks(cfg, setup, rank_fn),
        CommBackend::Nccl => threads::run_ranks(cfg, setup, rank_fn),
    }
}
