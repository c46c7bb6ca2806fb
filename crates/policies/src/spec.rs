//! [`PolicySpec`]: a reducer policy by name, as a command line, a sweep, step profiles,
//! checkpoints and reports all spell it. Its names and forms are the entries of the policy
//! registry, which reads, writes, names and builds specs; the ZeRO module says how a spec shards.

use crate::error::PolicyError;

/// A reducer policy by name: `allreduce`, `fp16`, `bf16`, `int8`, `powersgd:R[@START]`, `topk:RATIO`, `efsign`, `zero1`,
/// `zero2`, `zero3[:qwz][:qgz]`, `diloco:H[:OUTER_LR[:MOMENTUM]]`,
/// `streaming-diloco:H:FRAGMENTS[:DELAY[:OUTER_LR[:MOMENTUM]]][:bf16|:int8]`, or a user policy registered by name (`NAME` or `NAME:ARGS`). [`std::fmt::Display`] writes
/// the canonical form [`std::str::FromStr`] reads back (`powersgd:4` for rank 4 from the default start
/// iteration 10; `powersgd:4@2` otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicySpec {
    /// One averaging all-reduce per bucket (`AllReduce`).
    AllReduce,
    /// fp16 compression (`Compress`).
    Fp16,
    /// bf16 compression (`Compress`).
    Bf16,
    /// int8 quantization with error feedback (`Int8`).
    Int8,
    /// PowerSGD (`PowerSgd`) of rank `rank`, compressing from iteration `start_iter`.
    PowerSgd {
        /// The approximation's rank.
        rank: usize,
        /// Iterations reduced plainly first.
        start_iter: usize,
    },
    /// Top-k with error feedback (`TopK`), sending the fraction `ratio` of each bucket.
    TopK {
        /// The fraction of each bucket's entries sent, in `(0, 1]`.
        ratio: Ratio,
    },
    /// EF-SignSGD (`EfSign`): one bit per element and a scale per bucket, with error feedback.
    EfSign,
    /// ZeRO stage 1 (`Zero`).
    Zero1,
    /// ZeRO stage 2 (`Zero`).
    Zero2,
    /// ZeRO stage 3 (`Zero3`): parameters sharded too, gathered per unit.
    Zero3,
    /// ZeRO-3 with ZeRO++'s quantized gathers and/or reductions (`zero3:qwz`, `zero3:qgz`,
    /// `zero3:qwz:qgz`; at least one on).
    Zero3Quantized(crate::ZeroPlusPlus),
    /// DiLoCo (`Diloco`): H inner steps, then the averaged pseudo-gradient through an outer
    /// Nesterov SGD (`diloco:H[:OUTER_LR[:MOMENTUM]]`).
    Diloco(crate::DilocoConfig),
    /// Streaming DiLoCo (`StreamingDiloco`): DiLoCo in fragments synced on a staggered
    /// schedule, each sync overlapping the next inner steps
    /// (`streaming-diloco:H:FRAGMENTS[:DELAY[:OUTER_LR[:MOMENTUM]]][:bf16|:int8]`).
    StreamingDiloco(crate::StreamingConfig),
    /// A policy registered by name in a `Registry`, with its argument (after `:`).
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
    /// Whether this names a built-in policy.
    pub fn is_built_in(&self) -> bool {
        !matches!(self, PolicySpec::User { .. })
    }

    /// The ring collectives this policy's bytes go by and what a rank sends of their payload on
    /// `n` ranks, in words for a summary (`all-gather: (4-1) x payload`: an all-gather's
    /// payload is each rank's piece); `None` for a user policy, whose collectives are its own.
    pub fn wire_formula(&self, n: usize) -> Option<String> {
        use PolicySpec::*;
        Some(match self {
            AllReduce | Fp16 | Bf16 | PowerSgd { .. } | Diloco(_) | StreamingDiloco(_) => {
                format!("all-reduce: 2({n}-1)/{n} x payload")
            }
            // an all-gather's payload is each rank's piece: the ring sends it to every other rank
            Int8 | TopK { .. } | EfSign | Zero3Quantized(_) => format!("all-gather: ({n}-1) x payload"),
            Zero1 | Zero2 | Zero3 => {
                format!("reduce-scatter: ({n}-1)/{n} x its buffer, all-gather: ({n}-1) x its shard")
            }
            User { .. } => return None,
        })
    }
}

pub(crate) fn spec_error(spec: &str, reason: impl Into<String>) -> PolicyError {
    PolicyError::Spec {
        spec: spec.to_string(),
        reason: reason.into(),
    }
}

/// A number as a spec writes it: Rust's shortest round-trip form where that is short, else its
/// exponent form where that is shorter (`1e-30`, not 32 characters); both read back as the same
/// number, so a written spec parses to the same policy.
pub(crate) fn compact(v: f64) -> String {
    let plain = v.to_string();
    let exponent = format!("{v:e}");
    if plain.len() > 10 && exponent.len() < plain.len() {
        exponent
    } else {
        plain
    }
}

/// A ratio in a [`PolicySpec`]: an f64 compared, ordered and hashed by its bits (specs are
/// keys), read from and written as the number.
#[derive(Debug, Clone, Copy)]
pub struct Ratio(pub f64);

impl PartialEq for Ratio {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}
impl Eq for Ratio {}
impl std::hash::Hash for Ratio {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.to_bits().hash(h)
    }
}
impl PartialOrd for Ratio {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Ratio {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}
