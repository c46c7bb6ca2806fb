//! Brigade as a library: the one dependency for people who build their own models and reducer
//! policies (`brigade = { path = "crates/brigade" }`). It re-exports every crate of the
//! workspace, documented here in full ([`tensor`], [`autograd`], [`comm`], [`ddp`],
//! [`models`]), and adds what `brigade train` itself is made of:
//!
//! - [`fit()`]: the training loop as one call over a user's [`Model`](models::Model) (each rank
//!   builds its own) and [`DataSource`](source::DataSource) (each rank asks for its own
//!   microbatches), with the sharding, `no_sync` accumulation, checkpoint/resume, timeline and
//!   step profile of `brigade train`, which is a thin shell over it;
//! - [`config`]: what a run is asked to do ([`TrainConfig`]: the model, the data, the recipe, the
//!   distributed part, the runtime with its checkpoint and
//!   instrumentation parts), and [`observe`]: who watches it ([`observe::TrainObserver`]: progress,
//!   per-step records, a stop request; the library itself prints nothing), and
//!   [`tensorboard`]: an observer that writes every step's scalars as TensorBoard event files;
//! - [`launch`]: start N ranks as threads (or join the MPI job with the `mpi` feature), hand
//!   each a [`launch::RankContext`] (rank, world size, communicator stack) and get every rank's
//!   result back, or the root-cause error naming its rank — what `torch.multiprocessing.spawn`
//!   plus `init_process_group` give a PyTorch user; [`launch::nccl`] for the NCCL backend;
//! - [`trainer`]: one rank's loop ([`trainer::Trainer`]), for callers that launch ranks
//!   themselves; [`policy`]: a reducer policy per rank (a [`policies::PolicySpec`] or a
//!   user's own);
//! - [`recipe`]: the learning-rate schedule, clipping and evaluation; [`resume`]: what a
//!   checkpoint records of them and what a resume may change;
//! - [`join`]: uneven inputs (PyTorch's `Join`): ranks whose data ends early join the others'
//!   collectives with zeros until every rank's data has ended;
//! - [`plan`]: the fastest configuration (policy, bucket cap, activation checkpointing) that
//!   fits a memory budget, from a few profiled steps, and [`plan::memory`], the memory model;
//! - [`outcome`]: what a step and a run produced; [`checkpoint`], [`source`], [`placement`], and
//!   [`Error`], the one error type.
//!
//! Layers to build models from are in [`models::nn`] (parameters are [`autograd::Var`]s over
//! [`tensor::Tensor`]s); reducer policies implement [`ddp::ReducerPolicy`] (the built-in ones
//! are in [`policies`]). See the examples in `crates/brigade/examples/`.

#![warn(missing_docs)]

#[doc(inline)]
pub use brigade_autograd as autograd;
#[doc(inline)]
pub use brigade_comm as comm;
#[doc(inline)]
pub use brigade_ddp as ddp;
#[doc(inline)]
pub use brigade_models as models;
#[doc(inline)]
pub use brigade_policies as policies;
#[doc(inline)]
pub use brigade_tensor as tensor;

pub mod checkpoint;
pub mod checkpoint_files;
pub mod config;
pub mod error;
pub mod field;
pub mod fit;
pub mod join;
pub mod launch;
pub mod observe;
pub mod outcome;
pub mod placement;
pub mod plan;
pub mod policy;
pub mod recipe;
pub mod resume;
#[cfg(test)] // a test's path in the system temp dir, removed when it passes
#[path = "../../test-support/scratch.rs"]
mod scratch;
pub mod source;
pub mod study;
pub mod tensorboard;
mod trace_gather;
pub mod trainer;

pub use brigade_autograd::MixedPrecision;
pub use config::{OptimizerConfig, TrainConfig};
pub use error::{Error, Result};
pub use fit::{fit, RunReport};
pub use recipe::{ScheduleConfig, ScheduleName};
