//! Brigade as a library: the one dependency for people who build their own models and reducer
//! policies (`brigade = { path = "crates/cli" }`). It re-exports every crate and adds what
//! `brigade train` itself is made of:
//!
//! - [`launch`]: start N ranks as threads (or join the MPI job with the `mpi` feature), hand
//!   each a [`launch::RankContext`] (rank, world size, communicator stack) and get every rank's
//!   result back, or the root-cause error naming its rank — what `torch.multiprocessing.spawn`
//!   plus `init_process_group` give a PyTorch user;
//! - [`trainer`]: one rank's training loop over any [`models::Model`] (sharding, `no_sync`
//!   accumulation, agreed non-finite and signal stops, checkpoints, step profiles);
//! - [`checkpoint`], [`device`], [`error`], [`nccl`] (`--backend nccl`).
//!
//! Layers to build models from are in [`models::nn`]; reducer policies plug in through
//! [`ddp::hooks::CommHook`]. See the examples in `crates/cli/examples/`.

pub use brigade_autograd as autograd;
pub use brigade_comm as comm;
pub use brigade_ddp as ddp;
pub use brigade_models as models;
pub use brigade_tensor as tensor;

pub mod checkpoint;
pub mod device;
pub mod error;
pub mod launch;
pub mod nccl;
pub mod trainer;
