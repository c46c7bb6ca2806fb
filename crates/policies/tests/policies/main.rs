//! brigade-policies' integration tests: each built-in policy against pinned results and
//! references, and user policies written only against ddp's public contract.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod common;
mod device_stream;
mod diloco;
mod direct;
mod gradient_way;
mod pinned;
mod powersgd;
mod registry;
mod resume;
mod sparse;
mod user;
mod zero;
mod zero3;
mod zero3_quantized;
mod zero3_start;
