//! [`PolicySpec`]: a reducer policy by name, as a command line, a sweep, step profiles,
//! checkpoints and reports all spell it; its names and forms are the entries of
//! [`crate::registry`].

use std::fmt;
use std::str::FromStr;

use brigade_ddp::ReducerPolicy;

use crate::error::{PolicyError, Result};
use crate::registry::{self, Registry};
use crate::ZeroStage;

/// A reducer policy by name: `allreduce`, `fp16`, `bf16`, `int8`, `powersgd:R[@START]`, `zero1`,
/// `zero2`, `zero3`, or a user policy registered by name (`NAME` or `NAME:ARGS`). [`fmt::Display`] writes
/// the canonical form [`FromStr`] reads back (`powersgd:4` for rank 4 from the default start
/// iteration 10; `powersgd:4@2` otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicySpec {
    /// One averaging all-reduce per bucket ([`AllReduce`](crate::AllReduce)).
    AllReduce,
    /// fp16 compression ([`Compress`](crate::Compress)).
    Fp16,
    /// bf16 compression ([`Compress`](crate::Compress)).
    Bf16,
    /// int8 quantization with error feedback ([`Int8`](crate::Int8)).
    Int8,
    /// PowerSGD ([`PowerSgd`](crate::PowerSgd)) of rank `rank`, compressing from iteration `start_iter`.
    PowerSgd {
        /// The approximation's rank.
        rank: usize,
        /// Iterations reduced plainly first.
        start_iter: usize,
    },
    /// ZeRO stage 1 ([`Zero`](crate::Zero)).
    Zero1,
    /// ZeRO stage 2 ([`Zero`](crate::Zero)).
    Zero2,
    /// ZeRO stage 3 ([`Zero3`](crate::Zero3)): parameters sharded too, gathered per unit.
    Zero3,
    /// A policy registered by name in a [`Registry`], with its argument (after `:`).
    User {
        /// The registered name.
        name: String,
        /// What followed `NAME:`, for the policy's maker.
        arg: Option<String>,
    },
}

/// PowerSGD's start iteration when a spec does not give one.
pub const DEFAULT_POWERSGD_START: usize = 10;

impl PolicySpec {
    /// The ZeRO stage this spec shards at (`Off` for every other policy).
    pub fn zero_stage(&self) -> ZeroStage {
        match self {
            PolicySpec::Zero1 => ZeroStage::One,
            PolicySpec::Zero2 => ZeroStage::Two,
            PolicySpec::Zero3 => ZeroStage::Three,
            _ => ZeroStage::Off,
        }
    }

    /// The ZeRO policy of `stage` (`None` for `Off`).
    pub fn zero(stage: ZeroStage) -> Option<PolicySpec> {
        match stage {
            ZeroStage::Off => None,
            ZeroStage::One => Some(PolicySpec::Zero1),
            ZeroStage::Two => Some(PolicySpec::Zero2),
            ZeroStage::Three => Some(PolicySpec::Zero3),
        }
    }

    /// Whether this names a built-in policy.
    pub fn is_built_in(&self) -> bool {
        !matches!(self, PolicySpec::User { .. })
    }

    /// The policy's name: the spec without its argument.
    pub fn name(&self) -> &str {
        match self {
            PolicySpec::User { name, .. } => name,
            _ => registry::entry_of(self).map_or("", |(e, _)| e.name),
        }
    }

    /// The spec a plan groups this one's profiles under (the settings that change what a step
    /// measures, PowerSGD's rank but not its start); `None` for a policy a plan does not weigh.
    pub fn plan_family(&self) -> Option<PolicySpec> {
        registry::plan_family(self)
    }

    /// A new policy of this kind for one rank (a policy holds one rank's state); user policies
    /// are made by `registry`.
    pub fn build(&self, registry: &Registry) -> Result<Box<dyn ReducerPolicy>> {
        match self {
            PolicySpec::User { name, arg } => registry.make(name, arg.as_deref()),
            _ => registry::build_built_in(self).expect("every built-in spec has its entry"),
        }
    }
}

impl fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, arg) = match self {
            PolicySpec::User { name, arg } => (name.as_str(), arg.clone()),
            _ => registry::entry_of(self)
                .map(|(e, a)| (e.name, a))
                .expect("every built-in spec has its entry"),
        };
        match arg {
            None => f.write_str(name),
            Some(a) => write!(f, "{name}:{a}"),
        }
    }
}

pub(crate) fn spec_error(spec: &str, reason: impl Into<String>) -> PolicyError {
    PolicyError::Spec {
        spec: spec.to_string(),
        reason: reason.into(),
    }
}

impl FromStr for PolicySpec {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        match registry::read_built_in(s, name, arg) {
            Some(spec) => spec,
            None if registry::valid_name(name) => Ok(PolicySpec::User {
                name: name.to_string(),
                arg: arg.map(str::to_string),
            }),
            None => Err(spec_error(
                s,
                format!("not a policy name (the forms: {})", registry::forms()),
            )),
        }
    }
}
