//! brigade-ddp's integration tests: buckets, parity with one process, overlap, the policy contract, the stream contract, the overlap model, faults.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod autotune;
mod buckets;
mod common;
mod construction;
mod faults;
mod layers;
mod metered;
mod overlap;
mod overlap_model;
mod parity;
mod policy;
mod sparse_gather;
mod stream_events;
mod wire_price;
