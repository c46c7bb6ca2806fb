//! brigade-comm's integration tests: collectives, the comm stream, faults, metering, the simulated network, traces, MPI, NCCL bootstrap.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

// As the `brigade` binary: a `host_vec` can live in the shared heap (the MPI tests use it).
#[global_allocator]
static HEAP: brigade_comm::SharedHeap = brigade_comm::SharedHeap;

mod bench;
mod chain;
mod collectives;
mod common;
mod faults;
mod heap_lines;
mod meter;
#[cfg(feature = "mpi")]
mod mpi_collectives;
#[cfg(feature = "cuda")]
mod nccl_bootstrap;
mod sim;
mod sim_link;
mod stream;
mod trace;
