//! brigade-autograd's integration tests: the gradient-ready bus, accumulation, gradient checks, losses, optimizers, op profiles.
//!
//! One test binary for the crate (integration tests as modules: one link, not one per file).

mod bus;
mod checkpoint;
mod grad_accumulation;
mod gradcheck;
mod half_grads;
mod losses;
mod optim;
mod profile;
mod schedule;
mod scope_hooks;
