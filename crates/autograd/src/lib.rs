//! Brigade's autograd: define-by-run reverse mode over [`brigade_tensor::Tensor`].
//!
//! Every op on a [`Var`] computes its value and records, beside it, how to map its
//! output gradient back to its inputs. [`Var::backward`] walks that record newest-first
//! and, the moment a parameter has received its last contribution, announces it on the
//! **gradient-ready bus** ([`GradBus`]) of its [`ParamStore`]: a DDP reducer listening
//! there can start reducing that gradient while backward continues with earlier layers.
//! A subscriber may also give a parameter the storage its gradient accumulates into
//! ([`Var::set_grad_buffer`]), so that gradients can be views into one flat buffer.
//!
//! Beside the graph: optimizers ([`optim`]) and learning-rate schedules ([`schedule`]).

#![warn(missing_docs)]

mod backward;
mod checkpoint;
mod deferred;
mod error;
mod gradcheck;
mod indexing;
mod loss;
mod mixed;
mod ops;
pub mod optim;
mod params;
pub mod profile;
pub mod scaler;
pub mod schedule;
#[cfg(test)] // a test's path in the system temp dir, removed when it passes
#[path = "../../test-support/scratch.rs"]
mod scratch;
mod var;

pub use backward::{GradBus, GradReady, GradSubscriber, SubscriberError};
pub use checkpoint::{checkpoint_scope, RecomputeState};
pub use deferred::{defer_param_init, param_init_deferred, InitDraw, ParamInit, StateInFile, StoredState};
pub use error::{AutogradError, Result};
pub use gradcheck::{gradcheck, GradcheckReport};
pub use loss::Reduction;
pub use mixed::{MasterWeights, MixedPrecision};
pub use optim::{AdamW, Optimizer, Sgd};
pub use params::ParamStore;
pub use profile::{profile_ops, OpProfile, OpTime};
pub use scaler::GradScaler;
pub use schedule::{LrSchedule, ScheduleKind};
pub use var::{is_grad_enabled, no_grad, scope, scope_hooks, set_scope_hooks, ScopeHooks, Var};
