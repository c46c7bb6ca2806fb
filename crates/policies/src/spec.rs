//! [`PolicySpec`]: a reducer policy by name — what `train --policy` (or `--zero`), `sweep --policy`,
//! step profiles, checkpoints and `--json` all spell the same way — and the [`Registry`] where a
//! library user's own policies get a name.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use brigade_ddp::ReducerPolicy;

use crate::error::{PolicyError, Result};
use crate::{AllReduce, Compress, HalfType, Int8, PowerSgd, PowerSgdConfig, Zero, Zero3, ZeroStage};

/// A reducer policy by name: `allreduce`, `fp16`, `bf16`, `int8`, `powersgd:R[@START]`, `zero1`,
/// `zero2`, `zero3`, or a user policy registered by name (`NAME` or `NAME:ARGS`). [`fmt::Display`] writes
/// the canonical form [`FromStr`] reads back (`powersgd:4` for rank 4 from the default start
/// iteration 10; `powersgd:4@2` otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PolicySpec {
    /// One averaging all-reduce per bucket ([`AllReduce`]).
    AllReduce,
    /// fp16 compression ([`Compress`]).
    Fp16,
    /// bf16 compression ([`Compress`]).
    Bf16,
    /// int8 quantization with error feedback ([`Int8`]).
    Int8,
    /// PowerSGD ([`PowerSgd`]) of rank `rank`, compressing from iteration `start_iter`.
    PowerSgd {
        /// The approximation's rank.
        rank: usize,
        /// Iterations reduced plainly first.
        start_iter: usize,
    },
    /// ZeRO stage 1 ([`Zero`]).
    Zero1,
    /// ZeRO stage 2 ([`Zero`]).
    Zero2,
    /// ZeRO stage 3 ([`Zero3`]): parameters sharded too, gathered per unit.
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

const FORMS: &str = "allreduce, fp16, bf16, int8, powersgd:R[@START], zero1, zero2, zero3, or a registered NAME[:ARGS]";

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

    /// Whether this names a built-in policy.
    pub fn is_built_in(&self) -> bool {
        !matches!(self, PolicySpec::User { .. })
    }

    /// A new policy of this kind for one rank (a policy holds one rank's state); user policies
    /// are made by `registry`.
    pub fn build(&self, registry: &Registry) -> Result<Box<dyn ReducerPolicy>> {
        Ok(match self {
            PolicySpec::AllReduce => Box::new(AllReduce),
            PolicySpec::Fp16 => Box::new(Compress::new(HalfType::F16)),
            PolicySpec::Bf16 => Box::new(Compress::new(HalfType::BF16)),
            PolicySpec::Int8 => Box::new(Int8::default()),
            PolicySpec::PowerSgd { rank, start_iter } => Box::new(PowerSgd::new(PowerSgdConfig {
                rank: *rank,
                start_iter: *start_iter,
                ..PowerSgdConfig::default()
            })?),
            PolicySpec::Zero1 => Box::new(Zero::new(ZeroStage::One)?),
            PolicySpec::Zero2 => Box::new(Zero::new(ZeroStage::Two)?),
            PolicySpec::Zero3 => Box::new(Zero3::new()),
            PolicySpec::User { name, arg } => registry.make(name, arg.as_deref())?,
        })
    }
}

impl fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicySpec::AllReduce => f.write_str("allreduce"),
            PolicySpec::Fp16 => f.write_str("fp16"),
            PolicySpec::Bf16 => f.write_str("bf16"),
            PolicySpec::Int8 => f.write_str("int8"),
            PolicySpec::PowerSgd { rank, start_iter } if *start_iter == DEFAULT_POWERSGD_START => {
                write!(f, "powersgd:{rank}")
            }
            PolicySpec::PowerSgd { rank, start_iter } => write!(f, "powersgd:{rank}@{start_iter}"),
            PolicySpec::Zero1 => f.write_str("zero1"),
            PolicySpec::Zero2 => f.write_str("zero2"),
            PolicySpec::Zero3 => f.write_str("zero3"),
            PolicySpec::User { name, arg: None } => f.write_str(name),
            PolicySpec::User { name, arg: Some(a) } => write!(f, "{name}:{a}"),
        }
    }
}

fn spec_error(spec: &str, reason: impl Into<String>) -> PolicyError {
    PolicyError::Spec {
        spec: spec.to_string(),
        reason: reason.into(),
    }
}

/// Names a user policy may take: a letter, then letters, digits, `_` or `-`.
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

const BUILT_IN: [&str; 8] = [
    "allreduce",
    "fp16",
    "bf16",
    "int8",
    "powersgd",
    "zero1",
    "zero2",
    "zero3",
];

impl FromStr for PolicySpec {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let no_arg = |spec: PolicySpec| match arg {
            None => Ok(spec),
            Some(_) => Err(spec_error(
                s,
                format!("'{name}' takes no argument (the forms: {FORMS})"),
            )),
        };
        match name {
            "allreduce" => no_arg(PolicySpec::AllReduce),
            "fp16" => no_arg(PolicySpec::Fp16),
            "bf16" => no_arg(PolicySpec::Bf16),
            "int8" => no_arg(PolicySpec::Int8),
            "zero1" => no_arg(PolicySpec::Zero1),
            "zero2" => no_arg(PolicySpec::Zero2),
            "zero3" => no_arg(PolicySpec::Zero3),
            "powersgd" => {
                let arg =
                    arg.ok_or_else(|| spec_error(s, "PowerSGD needs its rank: powersgd:R or powersgd:R@START"))?;
                let (rank, start) = match arg.split_once('@') {
                    Some((r, st)) => (r, Some(st)),
                    None => (arg, None),
                };
                let rank: usize = rank.parse().ok().filter(|&r| r > 0).ok_or_else(|| {
                    spec_error(s, format!("PowerSGD's rank must be a whole number >= 1, got '{rank}'"))
                })?;
                let start_iter = match start {
                    None => DEFAULT_POWERSGD_START,
                    Some(st) => st.parse().map_err(|_| {
                        spec_error(
                            s,
                            format!("PowerSGD's start iteration must be a whole number, got '{st}'"),
                        )
                    })?,
                };
                Ok(PolicySpec::PowerSgd { rank, start_iter })
            }
            _ if valid_name(name) => Ok(PolicySpec::User {
                name: name.to_string(),
                arg: arg.map(str::to_string),
            }),
            _ => Err(spec_error(s, format!("not a policy name (the forms: {FORMS})"))),
        }
    }
}

/// Makes one rank's instance of a registered user policy from the spec's argument.
pub type MakeUserPolicy = Arc<dyn Fn(Option<&str>) -> Result<Box<dyn ReducerPolicy>> + Send + Sync>;

/// User policies by name, so that a [`PolicySpec`] (from a command line, a sweep, a checkpoint)
/// can name them like the built-in ones. Cheap to clone.
#[derive(Clone, Default)]
pub struct Registry {
    makers: BTreeMap<String, MakeUserPolicy>,
}

impl Registry {
    /// No user policies.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `make` under `name` (a letter, then letters, digits, `_`, `-`; not a built-in
    /// name, not taken).
    pub fn register(
        &mut self,
        name: &str,
        make: impl Fn(Option<&str>) -> Result<Box<dyn ReducerPolicy>> + Send + Sync + 'static,
    ) -> Result<()> {
        if !valid_name(name) {
            return Err(spec_error(
                name,
                "a policy name is a letter, then letters, digits, '_' or '-'",
            ));
        }
        if BUILT_IN.contains(&name) || self.makers.contains_key(name) {
            return Err(PolicyError::Taken(name.to_string()));
        }
        self.makers.insert(name.to_string(), Arc::new(make));
        Ok(())
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.makers.keys().cloned().collect()
    }

    fn make(&self, name: &str, arg: Option<&str>) -> Result<Box<dyn ReducerPolicy>> {
        match self.makers.get(name) {
            Some(make) => make(arg),
            None => Err(PolicyError::Unknown {
                name: name.to_string(),
                registered: if self.makers.is_empty() {
                    String::new()
                } else {
                    format!("; registered: {}", self.names().join(", "))
                },
            }),
        }
    }
}
