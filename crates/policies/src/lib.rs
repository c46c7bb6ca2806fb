//! brigade-policies: Brigade's built-in reducer policies — [`AllReduce`], [`Compress`] (fp16,
//! bf16), [`PowerSgd`], [`TopK`], [`EfSign`], [`Zero`] (stages 1 and 2), [`Diloco`] and
//! [`StreamingDiloco`] — written only against `brigade-ddp`'s
//! public policy contract ([`brigade_ddp::policy`]), so the compiler checks that a user can
//! write each of them; and [`PolicySpec`], the one way every part of Brigade names a policy,
//! with a [`Registry`] for user policies.

#![warn(missing_docs)]

mod allreduce;
mod compress;
mod diloco;
mod efsign;
mod error;
mod int8;
mod powersgd;
mod profiled;
pub mod registry;
mod residual;
mod spec;
mod streaming_diloco;
mod topk;
pub mod zero;

pub use allreduce::AllReduce;
pub use compress::{Compress, HalfType};
pub use diloco::{Diloco, DilocoConfig, OuterSgd, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM};
pub use efsign::EfSign;
pub use error::{PolicyError, Result};
pub use int8::Int8;
pub use powersgd::{PowerSgd, PowerSgdConfig, NEVER_COMPRESSED, POWERSGD_SETTINGS};
pub use profiled::{name_default_policy, profile_policy};
pub use registry::{MakeUserPolicy, Registry};
pub use spec::{PolicySpec, Ratio, DEFAULT_POWERSGD_START};
pub use streaming_diloco::{OuterPrecision, StreamingConfig, StreamingDiloco, DEFAULT_DELAY};
pub use topk::TopK;
pub use zero::{StateLayout, Zero, Zero3, ZeroOptimizer, ZeroPlusPlus, ZeroStage, DEFAULT_PREFETCH_CAP_BYTES};
