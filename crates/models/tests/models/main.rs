//! brigade-models' integration tests: layers, models, attention, data, checkpoints, learning.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod activation_checkpointing;
mod attention;
mod batch;
mod checkpoint;
mod common;
mod data;
mod deferred_init;
mod eval;
mod grads_to_none;
mod layers;
mod layers_parity;
mod learn;
mod models;
mod npy;
mod sample;
mod sampler;
mod text;
mod tokens;
