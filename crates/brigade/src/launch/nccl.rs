//! `--backend nccl`: gradient buckets averaged by NCCL on a CUDA comm stream of each rank's
//! GPU, ordered by events (`ddp::stream::NcclStream`). The ranks are started as threads
//! (`--world-size N`) or, under `mpirun`, one per process; the launcher's own communicator
//! still carries the control messages (model check, parameter broadcast, bucket rebuild,
//! losses) and bootstraps NCCL: rank 0 creates the unique id, the others receive its 128 bytes
//! (in memory between threads, by one `MPI_Bcast` between processes).

use std::sync::Arc;

use brigade_comm::nccl::{exchange_id, require_nccl, NcclComm};
use brigade_ddp::stream::{BucketStream, NcclStream};
use brigade_policies::PolicySpec;
use brigade_tensor::cuda::{probe, CudaDevice};
use brigade_tensor::Device;

use crate::device::DeviceArg;
use crate::error::{Error, Result};
use crate::launch::{Backend, RankContext};

/// Flags that cannot work with `--backend nccl`, as one usage error; and, with it, whether
/// NCCL can be loaded on this machine (after the device itself was found usable).
pub fn check_flags(backend: Backend, device: DeviceArg, hook: &PolicySpec) -> Result<()> {
    if backend != Backend::Nccl {
        return Ok(());
    }
    if device == DeviceArg::Cpu {
        return Err(Error::Usage(
            "--backend nccl reduces gradients in GPU memory: pass --device cuda (or cuda:N); \
             on the CPU use --backend thread or mpi"
                .into(),
        ));
    }
    if *hook != PolicySpec::AllReduce {
        return Err(Error::Usage(
            "--backend nccl averages each bucket with one NCCL all-reduce: --comm-hook must be allreduce \
             (the other hooks run with --backend thread or mpi, host-staged)"
                .into(),
        ));
    }
    Ok(())
}

/// Whether NCCL can be loaded: one typed error naming the missing library otherwise. With rank
/// threads, also whether there is a GPU per rank (NCCL refuses two ranks on one GPU).
pub fn require(world_size: usize) -> Result<()> {
    require_nccl().map_err(Error::from)?;
    if under_mpi() {
        return Ok(());
    }
    let count = probe::device_count().map_err(|u| u.on(Device::Cuda(0)))?;
    if world_size > count {
        return Err(Error::Usage(format!(
            "--backend nccl runs one rank per GPU and NCCL refuses two ranks on one GPU: --world-size {world_size} \
             needs {world_size} GPUs, this machine has {count} (several ranks on one GPU train with --backend thread, \
             host-staged)"
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
    if ctx.backend != Backend::Mpi {
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

/// The bucket stream of this rank when the run asked for NCCL: NCCL on `device`'s GPU (the id
/// exchanged over the launcher's control communicator). `None`: the host comm stream that
/// [`brigade_ddp::DistributedDataParallel::new`] builds over the rank's communicator stack.
pub fn bucket_stream(ctx: &RankContext, device: Device) -> Result<Option<Arc<dyn BucketStream>>> {
    if !ctx.nccl {
        return Ok(None);
    }
    let Device::Cuda(ordinal) = device else {
        return Err(Error::Usage("--backend nccl needs --device cuda".into()));
    };
    require_nccl()?;
    let gpu = CudaDevice::get(ordinal)?;
    let id = exchange_id(ctx.control.as_ref())?;
    let timeout = ctx.control.timeout();
    let comm = NcclComm::new(gpu.stream().context(), ctx.rank, ctx.world_size, id, timeout)?;
    Ok(Some(Arc::new(
        NcclStream::new(Arc::new(comm))
            .with_recorder(ctx.recorder.clone())
            .with_compute_device(gpu),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_needs_a_cuda_device_and_the_plain_all_reduce() {
        let cuda = DeviceArg::Cuda(None);
        assert!(check_flags(Backend::Nccl, cuda, &PolicySpec::AllReduce).is_ok());
        assert!(check_flags(Backend::Thread, DeviceArg::Cpu, &PolicySpec::AllReduce).is_ok());
        let e = check_flags(Backend::Nccl, DeviceArg::Cpu, &PolicySpec::AllReduce).unwrap_err();
        assert!(e.to_string().contains("--device cuda"), "{e}");
        let fp16 = PolicySpec::Fp16;
        let e = check_flags(Backend::Nccl, cuda, &fp16).unwrap_err();
        assert!(e.to_string().contains("--comm-hook"), "{e}");
    }

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
