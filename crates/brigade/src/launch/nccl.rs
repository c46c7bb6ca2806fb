//! The NCCL backend ([`CommBackend::Nccl`]): gradient buckets reduced by the run's reducer
//! policy (any of them: its compute and its collectives) on a CUDA comm stream of each rank's
//! GPU, NCCL moving the bytes, ordered by events (`ddp::group::NcclGroup`). The ranks are
//! started as threads or, under `mpirun`, one per process; the launcher's own communicator
//! still carries the control messages (model check, parameter broadcast, bucket rebuild,
//! losses) and bootstraps NCCL: rank 0 creates the unique id, the others receive its 128 bytes
//! (in memory between threads, by one `MPI_Bcast` between processes).

use brigade_comm::NetModel;
use brigade_ddp::Group;
use brigade_tensor::cuda::probe;
use brigade_tensor::Device;

use crate::error::{Error, Result};
use crate::launch::context::{CommBackend, RankContext};

/// Whether NCCL can be loaded: one typed error naming the missing library otherwise (or the
/// build's missing CUDA backend). With rank threads, also whether there is a GPU per rank (NCCL
/// refuses two ranks on one GPU).
pub fn require(world_size: usize) -> Result<()> {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = world_size;
        Err(probe::Unavailable::NotBuilt.on(Device::Cuda(0)).into())
    }
    #[cfg(feature = "cuda")]
    require_gpus(world_size)
}

#[cfg(feature = "cuda")]
fn require_gpus(world_size: usize) -> Result<()> {
    brigade_comm::nccl::require_nccl().map_err(Error::from)?;
    if under_mpi() {
        return Ok(());
    }
    let count = probe::device_count().map_err(|u| u.on(Device::Cuda(0)))?;
    if world_size > count {
        return Err(Error::Config(format!(
            "NCCL runs one rank per GPU and refuses two ranks on one GPU: {world_size} ranks need {world_size} \
             GPUs, this machine has {count} (several ranks on one GPU train over the thread backend, host-staged)"
        )));
    }
    Ok(())
}

/// Whether this process runs under `mpirun` (Open MPI, MPICH or Slurm's PMI set these).
pub fn under_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// The rank whose GPU this rank takes among this node's: its node-local rank under MPI
/// (`OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`, `SLURM_LOCALID`), its rank with threads.
pub fn gpu_rank(ctx: &RankContext) -> usize {
    if ctx.launcher != CommBackend::Mpi {
        return ctx.rank;
    }
    local_rank_from(|v| std::env::var(v).ok()).unwrap_or(ctx.rank)
}

/// The node-local rank from the launcher's environment, read through `var`.
fn local_rank_from(var: impl Fn(&str) -> Option<String>) -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"]
        .iter()
        .find_map(|v| var(v).and_then(|s| s.trim().parse().ok()))
}

/// The process group of this rank when the run asked for NCCL: NCCL on a comm stream of
/// `device`'s GPU (the id exchanged over the launcher's control communicator), with `link`
/// simulated on the comm stream by a delay kernel per collective. `None`: the host group that
/// [`brigade_ddp::DistributedDataParallel::new`] builds over the rank's communicator stack.
pub fn device_group(ctx: &RankContext, device: Device, link: Option<NetModel>) -> Result<Option<Group>> {
    if !ctx.nccl {
        return Ok(None);
    }
    if !matches!(device, Device::Cuda(_)) {
        return Err(Error::Config(
            "the NCCL backend reduces gradients in GPU memory: place the ranks on CUDA devices".into(),
        ));
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = link;
        Err(probe::Unavailable::NotBuilt.on(device).into())
    }
    #[cfg(feature = "cuda")]
    {
        use brigade_comm::nccl::{exchange_id, require_nccl};
        use brigade_ddp::group::NcclGroup;
        require_nccl()?;
        let id = exchange_id(ctx.control.as_ref())?;
        let timeout = ctx.control.timeout();
        let group = NcclGroup::join(device, ctx.rank, ctx.world_size, id, timeout)?
            .with_recorder(ctx.recorder.clone())
            .with_compute_timing(true)
            .with_simulated_link(link);
        Ok(Some(std::sync::Arc::new(group)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_of_an_mpi_rank_is_its_node_local_rank() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |v: &str| pairs.iter().find(|(k, _)| *k == v).map(|(_, x)| x.to_string())
        };
        assert_eq!(local_rank_from(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "3")])), Some(3));
        assert_eq!(local_rank_from(env(&[("SLURM_LOCALID", "1")])), Some(1));
        assert_eq!(local_rank_from(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "x")])), None);
        assert_eq!(local_rank_from(env(&[])), None);
    }
}
