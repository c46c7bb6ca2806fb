//! `brigade bench comm --backend mpi`: the all-reduce benchmark over MPI processes, measured as
//! the thread backend's (same sizes, iterations, table), with the MPI library's own all-reduce
//! timed in the same run, in turns with Brigade's: the blocking `MPI_Allreduce` in place (the
//! yardstick), the non-blocking `MPI_Iallreduce` in place completed by `MPI_Wait` (what a
//! polling design would build on), and Brigade through MPI alone when its default path is
//! another.

use std::ffi::{c_int, c_void};
use std::time::Duration;

use ::mpi::ffi;

use super::raw::{self, mpi_check, RawComm};
use super::{MpiOptions, MpiPath, MpiWorld};
use crate::bench::{memcpy_bandwidth, time_contenders, CommBenchConfig, CommBenchReport, Contender, ReferenceRows};
use crate::{CommError, CommStream};

/// The timeout of the benchmark's communicators.
const TIMEOUT: Duration = Duration::from_secs(120);

/// What each path is called in the table.
fn path_name(path: MpiPath) -> &'static str {
    match path {
        MpiPath::SharedMemory => "shared memory",
        MpiPath::Hierarchical => "hierarchical",
        MpiPath::Mpi => "MPI",
    }
}

/// An in-place f32 sum all-reduce straight through the MPI library on `comm`.
fn raw_contender(comm: &RawComm, rank: usize, blocking: bool) -> Contender<'_> {
    let name = if blocking {
        "MPI_Allreduce"
    } else {
        "MPI_Iallreduce+Wait"
    };
    Contender {
        name: name.to_string(),
        run: Box::new(move |mut v: Vec<f32>| {
            let n = v.len() as c_int;
            let copy;
            let send: *const c_void = match raw::in_place() {
                Some(in_place) => in_place,
                None => {
                    copy = v.clone();
                    copy.as_ptr().cast()
                }
            };
            let (out, dt, op) = (v.as_mut_ptr().cast(), raw::f32_datatype(), raw::sum_op());
            if n == 0 {
                return Ok(v);
            }
            if blocking {
                mpi_check!(rank, "MPI_Allreduce", unsafe {
                    ffi::MPI_Allreduce(send, out, n, dt, op, comm.0)
                })?;
            } else {
                // SAFETY: reading a constant handle; overwritten by the call.
                let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
                mpi_check!(rank, "MPI_Iallreduce", unsafe {
                    ffi::MPI_Iallreduce(send, out, n, dt, op, comm.0, &mut req)
                })?;
                mpi_check!(rank, "MPI_Wait", unsafe {
                    ffi::MPI_Wait(&mut req, ffi::RSMPI_STATUS_IGNORE)
                })?;
            }
            Ok(v)
        }),
    }
}

impl MpiWorld {
    /// Times f32 sum all-reduces of each size of `cfg` over all MPI processes
    /// (`cfg.world_size` is ignored: the job's size is used): Brigade's communicator with the
    /// options of the environment ([`MpiOptions::from_env`]), and in the same run, in turns,
    /// the library's blocking and non-blocking all-reduce and Brigade through MPI alone (when
    /// that is not already its path). Collective; rank 0 gets the report, the other ranks
    /// `None`.
    pub fn bench_all_reduce(&self, cfg: &CommBenchConfig) -> Result<Option<CommBenchReport>, CommError> {
        let opts = MpiOptions::from_env(TIMEOUT)?;
        let transport = self.transport_with(&opts)?;
        let path = transport.path();
        // The bench's buffers are `host_vec`s: with the heaps mapped they are reduced in place
        // inside the node (the whole all-reduce on one node; the node's steps of the hierarchy).
        let in_place = if transport.has_shared_heaps() { ", in place" } else { "" };
        let comm = CommStream::new(transport, TIMEOUT);
        let mpi_only = match path {
            MpiPath::Mpi => None,
            _ => Some(self.communicator_with(&MpiOptions {
                shared_memory: false,
                ..opts.clone()
            })?),
        };
        let (rank, world) = (self.rank(), self.world_size());
        let raw_comm = RawComm::dup_world(rank)?;
        let memcpy_bw = if rank == 0 {
            memcpy_bandwidth(cfg.memcpy_bytes, 5)
        } else {
            0.0
        };
        let mut contenders = vec![
            raw_contender(&raw_comm, rank, true),
            raw_contender(&raw_comm, rank, false),
        ];
        if let Some(mpi_only) = &mpi_only {
            contenders.push(Contender::communicator("brigade (MPI)", mpi_only));
        }
        let brigade = format!("brigade ({}{in_place})", path_name(path));
        contenders.push(Contender::communicator(&brigade, &comm));
        let timed = time_contenders(&comm, cfg, &mut contenders);
        let names: Vec<String> = contenders.iter().map(|c| c.name.clone()).collect();
        drop(contenders);
        raw_comm.free();
        let mut timed = timed?;
        let rows = timed.pop().expect("brigade's rows come last");
        Ok((rank == 0).then(|| CommBenchReport {
            backend: "mpi".to_string(),
            path: format!("{}{in_place}", path_name(path)),
            world_size: world,
            memcpy_bw,
            memcpy_bytes: cfg.memcpy_bytes,
            rows,
            references: names
                .into_iter()
                .zip(timed)
                .map(|(name, rows)| ReferenceRows { name, rows })
                .collect(),
        }))
    }
}
