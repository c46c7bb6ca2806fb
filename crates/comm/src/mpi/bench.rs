//! `brigade bench comm --backend mpi`: the all-reduce benchmark over MPI processes, measured
//! exactly as the thread backend's (same sizes, iterations, table).

use std::time::{Duration, Instant};

use super::MpiWorld;
use crate::bench::{memcpy_bandwidth, AllReduceRow, CommBenchConfig, CommBenchReport};
use crate::{Buffer, CommError, Communicator, ReduceOp};

impl MpiWorld {
    /// Times f32 sum all-reduces of each size of `cfg` over all MPI processes
    /// (`cfg.world_size` is ignored: the job's size is used). Collective; rank 0 gets the
    /// report, the other ranks `None`.
    pub fn bench_all_reduce(&self, cfg: &CommBenchConfig) -> Result<Option<CommBenchReport>, CommError> {
        let comm = self.communicator(Duration::from_secs(120))?;
        let world = comm.world_size();
        let rank = comm.rank();
        let memcpy_bw = if rank == 0 { memcpy_bandwidth(cfg.memcpy_bytes, 5) } else { 0.0 };
        let mut rows = Vec::new();
        for &bytes in &cfg.sizes {
            let len = bytes / 4;
            let iters = cfg.iters.unwrap_or_else(|| ((512usize << 20) / bytes.max(1)).clamp(5, 1000));
            let mut buf = Buffer::F32(vec![0.5; len]);
            for _ in 0..2 {
                buf = comm.all_reduce(buf, ReduceOp::Sum, "warmup").wait()?;
            }
            let memcpy_bw = if rank == 0 { memcpy_bandwidth(cfg.memcpy_bytes, 3) } else { 0.0 };
            comm.barrier("start").wait()?;
            let mut best_s = f64::INFINITY;
            let t = Instant::now();
            for _ in 0..iters {
                let t1 = Instant::now();
                buf = comm.all_reduce(buf, ReduceOp::Sum, "bench").wait()?;
                best_s = best_s.min(t1.elapsed().as_secs_f64());
            }
            let time_s = t.elapsed().as_secs_f64() / iters as f64;
            let algbw = (len * 4) as f64 / time_s;
            let busbw = algbw * 2.0 * (world - 1) as f64 / world as f64;
            rows.push(AllReduceRow { bytes: len * 4, iters, time_s, algbw, busbw, best_s, memcpy_bw });
        }
        Ok((rank == 0).then(|| CommBenchReport {
            backend: "mpi".to_string(),
            world_size: world,
            memcpy_bw,
            memcpy_bytes: cfg.memcpy_bytes,
            rows,
        }))
    }
}
