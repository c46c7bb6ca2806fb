//! The brigade library's integration tests: launching ranks (threads, MPI) and fit over a user's model.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod accum_into_shard;
mod activation_checkpointing;
mod checkpoints;
mod common;
mod composition;
mod diloco_resume;
mod dropout_resume;
mod fake_device;
mod fake_policies;
mod join;
mod launch;
mod library;
mod mixed_policies;
mod mixed_precision;
#[cfg(feature = "mpi")]
mod mpi_launch;
mod plan;
mod policy_state;
mod recipes;
mod replicas;
mod sampled;
mod study_tensorboard;
mod zero3;
mod zero3_mixed;
mod zero3_resume_shards;
mod zero3_start;
mod zero3_start_file;
mod zero_peaks;
