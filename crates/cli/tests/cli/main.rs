//! The brigade binary's tests: every subcommand run as a user runs it.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod activation_checkpointing;
mod bad_input;
mod bench_fit;
mod bench_gemm;
mod checkpoint_paths;
mod common;
mod data_formats;
mod device;
mod faults;
mod finished_work;
mod join;
mod lifecycle;
mod memory_model;
#[cfg(feature = "mpi")]
mod mpi_train;
mod nccl;
mod outputs;
mod overlap;
mod overlap_tuning;
mod plan;
mod plan_auto;
mod policies;
mod policy_bytes;
mod policy_flag;
mod policy_resume;
mod precision;
mod recipes;
mod resume_drift;
mod signals;
mod stdout;
mod study;
mod tensorboard;
mod text;
mod tokens;
mod train;
mod user_main;
mod zero;
mod zero3;
