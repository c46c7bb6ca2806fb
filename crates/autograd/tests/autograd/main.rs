//! brigade-autograd's integration tests: the gradient-ready bus, accumulation, gradient checks, optimizers, op profiles.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod bus;
mod grad_accumulation;
mod gradcheck;
mod half_grads;
mod optim;
mod profile;
mod schedule;
