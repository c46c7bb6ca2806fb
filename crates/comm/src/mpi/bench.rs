//! `brigade bench comm --backend mpi`: the all-reduce benchmark over MPI processes, measured
//! exactly as the thread backend's (same sizes, iterations, table).

use std::time::Duration;

use super::MpiWorld;
use crate::bench::{memcpy_bandwidth, time_all_reduce, CommBenchConfig, CommBenchReport};
use crate::{CommError, Communicator};

impl MpiWorld {
    /// Times f32 sum all-reduces of each size of `cfg` over all MPI processes
    /// (`cfg.world_size` is ignored: the job's size is used). Collective; rank 0 gets the
    /// report, the other ranks `None`.
    pub fn bench_all_reduce(&self, cfg: &CommBenchConfig) -> Result<Option<CommBenchReport>, CommError> {
        let comm = self.communicator(Duration::from_secs(120))?;
        let world = comm.world_size();
        let rank = comm.rank();
        let memcpy_bw = if rank == 0 {
            memcpy_bandwidth(cfg.memcpy_bytes, 5)
        } else {
            0.0
        };
        let rows = time_all_reduce(&comm, cfg)?;
        Ok((rank == 0).then(|| CommBenchReport {
            backend: "mpi".to_string(),
            world_size: world,
            memcpy_bw,
            memcpy_bytes: cfg.memcpy_bytes,
            rows,
        }))
    }
}
