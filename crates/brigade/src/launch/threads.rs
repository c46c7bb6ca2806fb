//! The thread backend: N ranks as threads of this process over one shared-memory group.

use std::sync::Arc;

use brigade_comm::{run_on_threads_with_timeout, Communicator, SharedLink};

use crate::error::Result;
use crate::launch::comm_stack::{comm_stack, SimLink};
use crate::launch::context::{CommBackend, LaunchConfig, Launched, RankContext};
use crate::launch::root_cause::root_cause;

/// Runs `setup` once, then `rank_fn` on `cfg.world_size` threads (see
/// [`crate::launch::run_ranks`]).
pub fn run_ranks<S: Sync, T: Send>(
    cfg: &LaunchConfig,
    setup: impl FnOnce(usize) -> Result<S>,
    rank_fn: impl Fn(&RankContext, &S) -> Result<T> + Sync,
) -> Result<Launched<T>> {
    let world = cfg.world_size;
    let shared = setup(world)?;
    let link = cfg.net.map(SharedLink::new);
    let results = run_on_threads_with_timeout(world, cfg.timeout, |comm| {
        let rank = comm.rank();
        let control: Arc<dyn Communicator> = Arc::new(comm.plain());
        let (comm, group) = comm_stack(comm, link.as_ref().map(SimLink::Shared), cfg.recorder.as_ref());
        let ctx = RankContext {
            rank,
            world_size: world,
            local_ranks: world,
            comm,
            group,
            control,
            recorder: cfg.recorder.clone(),
            launcher: CommBackend::Thread,
            nccl: cfg.backend == CommBackend::Nccl,
            net: cfg.net,
        };
        rank_fn(&ctx, &shared)
    });
    let mut outs = vec![];
    let mut errors = vec![];
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(out)) => outs.push((rank, out)),
            Ok(Err(e)) => errors.push((rank, e)),
            Err(e) => errors.push((rank, e.into())),
        }
    }
    if errors.is_empty() {
        return Ok(Launched {
            world_size: world,
            results: outs,
        });
    }
    let (rank, e) = root_cause(errors);
    Err(e.on_rank(rank, world))
}
