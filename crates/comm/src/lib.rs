//! brigade-comm: collectives for data-parallel training.
//!
//! - [`Communicator`]: one rank's asynchronous collectives (all-reduce, broadcast, all-gather,
//!   reduce-scatter, barrier) on typed flat [`Buffer`]s, each returning a [`Work`] handle;
//!   [`all_gather_with_side`] carries a small side buffer (scales, indices) beside a payload, and
//!   [`DType`]'s docs say how integer payloads are reduced (gathered, summed in f32).
//! - [`CommStream`]: the per-rank comm stream that runs collectives in issue order on a worker
//!   thread over a synchronous [`Transport`]; a backend implements only the transport. Its
//!   collectives are its own methods (the [`Communicator`] face forwards to them); tracing and a
//!   simulated link are options of it.
//! - [`ThreadGroup`] / [`run_on_threads`]: the thread backend, `n` ranks as threads of one process.
//! - [`CommStream::simulated`], [`SharedLink`]: a comm stream as slow as a network of latency
//!   `alpha` and bandwidth `B` (ring model), to study overlap and bucket sizes on one machine.
//! - [`cost`](mod@cost): the ring collectives' wire-cost model ([`RingOp`], [`NetModel`]), which
//!   the simulated network, the meter, the benchmark and ddp's overlap model share.
//! - [`CommMeter`]: bytes a rank hands to its collectives and sends on the wire (ddp's process
//!   group counts into it, once per collective).
//! - [`Recorder`] / [`CommStream::traced`]: per-rank timelines of compute and communication, exported as
//!   Chrome trace JSON.
//! - [`bench`](mod@bench): the all-reduce bandwidth benchmark behind `brigade bench comm`.
//! - [`nccl`] (the `cuda` feature, on by default): NCCL on GPU memory ([`nccl::NcclComm`]:
//!   all-reduce, reduce-scatter and all-gather on device memory given as raw handles
//!   ([`DeviceSpan`], [`RawStream`], [`RawEvent`]), each behind a ready event and recording a done
//!   event; id bootstrap; a watchdog that aborts); compile-checked only.

#![warn(missing_docs)]

pub mod bench;
mod buffer;
mod collective;
mod communicator;
pub mod cost;
mod device;
mod error;
// Its peer mapping is used by the MPI backend only.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
mod heap;
mod kernels;
mod meter;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(test)] // a test's path in the system temp dir, removed when it passes
#[path = "../../test-support/scratch.rs"]
mod scratch;
// Used by the MPI backend (and by its own tests, threads standing in for processes).
#[cfg_attr(not(feature = "mpi"), allow(dead_code, unused_imports))]
mod shm;
mod sim;
mod stream;
mod thread;
mod trace;
mod work;

// The comm tests run with the shared heap's allocator, as the `brigade` binary does.
#[cfg(test)]
#[global_allocator]
static TEST_HEAP: SharedHeap = SharedHeap;

pub use buffer::{buffer_from_le_bytes, Buffer, DType};
pub use collective::ReduceOp;
pub use communicator::{
    all_gather_bytes, all_gather_with_side, pack_with_side, unpack_with_side, Communicator, SideLayout,
};
pub use cost::{NetModel, RingOp};
pub use device::{DeviceSpan, RawEvent, RawStream};
pub use error::CommError;
pub use heap::{host_vec, in_shared_heap, SharedHeap, HEAP_BYTES, HEAP_VAR, LINE_FROM_BYTES};
pub use meter::{CommBytes, CommMeter};
#[cfg(feature = "mpi")]
pub use mpi::{MpiComm, MpiOptions, MpiPath, MpiTransport, MpiWorld};
pub use sim::SharedLink;
pub use stream::{CommStream, Transport};
pub use thread::{
    run_on_threads, run_on_threads_with_timeout, ThreadComm, ThreadGroup, ThreadTransport, DEFAULT_TIMEOUT,
};
pub use trace::{chrome_trace, tagging_collectives, EventKind, Recorder, SpanGuard, SpanId, Stamp, TraceEvent, Track};
pub use work::{OpTiming, Promise, Work, WorkEvent};
