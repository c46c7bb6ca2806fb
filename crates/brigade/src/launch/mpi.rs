//! The MPI backend: this process is one rank of an `mpirun` job; rank and world size come from
//! MPI.
//!
//! Setup errors (a missing file, too little data) are agreed on by all ranks before the rank
//! function runs, so every rank reports the same error, then the job exits 1. An error in the
//! rank function ends the whole job at once (`MPI_Abort`), so that no rank waits for a dead
//! peer until its timeout, except an error every rank reaches together
//! ([`Error::is_agreed`], e.g. a non-finite loss): rank 0 reports it and every rank exits 1.
//! Each report goes to [`LaunchConfig::on_fatal`] before the job ends. A killed process is
//! noticed by `mpirun`, which ends the others. MPI is finalized before [`run_ranks`] returns
//! this rank's result.

#[cfg(not(feature = "mpi"))]
pub use disabled::run_ranks;
#[cfg(feature = "mpi")]
pub use enabled::run_ranks;

#[cfg(not(feature = "mpi"))]
mod disabled {
    use crate::error::{Error, Result};
    use crate::launch::context::{LaunchConfig, Launched, RankContext};

    /// [`Error::MpiNotBuilt`]: how to get a build with MPI.
    pub fn run_ranks<S: Sync, T: Send>(
        _cfg: &LaunchConfig,
        _setup: impl FnOnce(usize) -> Result<S>,
        _rank_fn: impl Fn(&RankContext, &S) -> Result<T> + Sync,
    ) -> Result<Launched<T>> {
        Err(Error::MpiNotBuilt)
    }
}

#[cfg(feature = "mpi")]
mod enabled {
    use std::sync::Arc;

    use brigade_comm::{Buffer, Communicator, MpiComm, MpiWorld};

    use crate::error::{Error, Result};
    use crate::launch::comm_stack::{comm_stack, SimLink};
    use crate::launch::context::{CommBackend, LaunchConfig, Launched, RankContext};

    /// Bytes of a setup error message exchanged between ranks.
    const MESSAGE_BYTES: usize = 1024;

    /// Runs `setup` and `rank_fn` on this process's rank of the MPI job (see the module docs).
    pub fn run_ranks<S: Sync, T: Send>(
        cfg: &LaunchConfig,
        setup: impl FnOnce(usize) -> Result<S>,
        rank_fn: impl Fn(&RankContext, &S) -> Result<T> + Sync,
    ) -> Result<Launched<T>> {
        let world = MpiWorld::init()?;
        let (rank, size) = (world.rank(), world.world_size());
        // the training stream (simulated, traced) and a plain handle on it for control messages
        let stream = world.communicator(cfg.timeout)?;
        let base = Arc::new(stream.plain());
        let report = |e: &Error| {
            if let Some(on_fatal) = &cfg.on_fatal {
                on_fatal(e);
            }
        };
        let shared = setup(size);
        if let Err(e) = agree(&base, rank, shared.as_ref().err().map(|e| e.to_string())) {
            // Every rank reports before any exits: mpirun ends the job at the first non-zero exit.
            report(&e);
            drop(stream);
            exit_together(base, world, 1);
        }
        let shared = shared.expect("agreed: every rank's setup succeeded");
        let control: Arc<dyn Communicator> = base.clone();
        let (comm, group) = comm_stack(stream, cfg.net.map(SimLink::Own), cfg.recorder.as_ref());
        let ctx = RankContext {
            rank,
            world_size: size,
            local_ranks: local_ranks(size),
            comm,
            group,
            control,
            recorder: cfg.recorder.clone(),
            launcher: CommBackend::Mpi,
            nccl: cfg.backend == CommBackend::Nccl,
            net: cfg.net,
        };
        let out = match rank_fn(&ctx, &shared) {
            Ok(out) => out,
            Err(e) if e.is_agreed() => {
                if rank == 0 {
                    report(&e);
                }
                drop(ctx);
                exit_together(base, world, 1);
            }
            Err(e) => {
                // The peers may be blocked in a collective this rank will never join.
                report(&e.on_rank(rank, size));
                world.abort(1);
            }
        };
        drop(ctx);
        drop(base);
        drop(world); // waits for the comm stream to end, then MPI_Finalize
        Ok(Launched {
            world_size: size,
            results: vec![(rank, out)],
        })
    }

    /// Waits until every rank got here (so every rank reported), finalizes MPI and exits.
    fn exit_together(comm: Arc<MpiComm>, world: MpiWorld, code: i32) -> ! {
        let _ = comm.barrier("exit").wait();
        drop(comm);
        drop(world);
        std::process::exit(code);
    }

    /// Ranks of this job on this host (OpenMPI tells each process).
    fn local_ranks(size: usize) -> usize {
        std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(size)
    }

    /// Every rank learns whether any rank failed its setup; then all fail with the first failing
    /// rank's message, or all go on.
    fn agree(comm: &MpiComm, rank: usize, error: Option<String>) -> Result<()> {
        let mut msg = error.map(|e| format!("!{e}")).unwrap_or_default().into_bytes();
        msg.truncate(MESSAGE_BYTES);
        msg.resize(MESSAGE_BYTES, 0);
        let all = comm.all_gather(Buffer::U8(msg), "setup status").wait()?;
        let all = all
            .as_u8()
            .ok_or_else(|| Error::Protocol("the setup status came back as another dtype".into()))?;
        let failed: Vec<(usize, String)> = all
            .chunks(MESSAGE_BYTES)
            .enumerate()
            .filter(|(_, m)| m[0] == b'!')
            .map(|(r, m)| (r, String::from_utf8_lossy(&m[1..]).trim_end_matches('\0').to_string()))
            .collect();
        let Some((first, message)) = failed.first() else {
            return Ok(());
        };
        let others: Vec<usize> = failed.iter().skip(1).map(|(r, _)| *r).collect();
        let also = if others.is_empty() {
            String::new()
        } else {
            format!(" (ranks {others:?} failed too)")
        };
        let whose = if *first == rank {
            "this rank".to_string()
        } else {
            format!("rank {first}")
        };
        Err(Error::Launch(format!(
            "setup failed on {whose} of {}: {message}{also}",
            all.len() / MESSAGE_BYTES
        )))
    }
}
