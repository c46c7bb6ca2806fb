//! Brigade as a library: the one dependency for people who build their own models and reducer
//! policies (`brigade = { path = "crates/brigade" }`). It re-exports every crate and adds what
//! `brigade train` itself is made of:
//!
//! - [`fit()`]: the training loop as one call over a user's [`models::Model`] (each rank builds
//!   its own) and [`data::DataSource`] (each rank asks for its own microbatches), with the
//!   sharding, `no_sync` accumulation, checkpoint/resume, timeline, step profile and progress bar
//!   of `brigade train`, which is a thin shell over it;
//! - [`launch`]: start N ranks as threads (or join the MPI job with the `mpi` feature), hand
//!   each a [`launch::RankContext`] (rank, world size, communicator stack) and get every rank's
//!   result back, or the root-cause error naming its rank — what `torch.multiprocessing.spawn`
//!   plus `init_process_group` give a PyTorch user;
//! - [`trainer`]: one rank's loop ([`trainer::Trainer`]), for callers that launch ranks
//!   themselves; [`comm_hook`]: a reducer policy per rank (a [`policies::PolicySpec`] or a
//!   user's own);
//! - [`checkpoint`], [`data`], [`device`], [`launch::nccl`] (`--backend nccl`), and [`Error`], the one
//!   error type.
//!
//! Layers to build models from are in [`models::nn`]; reducer policies implement
//! [`ddp::ReducerPolicy`] (the built-in ones are in [`policies`]). See the examples in
//! `crates/brigade/examples/`.

#![warn(missing_docs)]

pub use brigade_autograd as autograd;
pub use brigade_comm as comm;
pub use brigade_ddp as ddp;
pub use brigade_models as models;
pub use brigade_policies as policies;
pub use brigade_tensor as tensor;

pub mod checkpoint;
pub mod comm_hook;
pub mod data;
pub mod device;
pub mod error;
pub mod fit;
pub mod launch;
mod trace_gather;
pub mod trainer;

pub use error::{Error, Result};
pub use fit::{fit, RunReport};
