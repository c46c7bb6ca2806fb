//! A reducer policy by name (`allreduce`, `fp16`, `bf16`, `powersgd:4`, `zero1`, `zero2`):
//! the axis of `brigade sweep --policy`. Each name becomes the training flags that choose it.

use std::fmt;

use brigade::policies::PowerSgdConfig;

use crate::args::{CommHookName, RunArgs};
use crate::error::{Error, Result};

/// Every name `--policy` takes, for error messages.
pub const POLICY_NAMES: &str = "allreduce, fp16, bf16, powersgd, powersgd:R (R >= 1), zero1, zero2";

/// One reducer policy: a communication hook, or a ZeRO stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// One f32 all-reduce per bucket (`--comm-hook allreduce`).
    AllReduce,
    /// fp16 compression (`--comm-hook fp16`).
    Fp16,
    /// bf16 compression (`--comm-hook bf16`).
    Bf16,
    /// PowerSGD of this rank (`powersgd:R`), or of `--powersgd-rank` (`powersgd`).
    PowerSgd(Option<usize>),
    /// ZeRO stage 1 or 2 (`--zero 1|2`): optimizer state (and gradients) sharded.
    Zero(u8),
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::AllReduce => f.write_str("allreduce"),
            Policy::Fp16 => f.write_str("fp16"),
            Policy::Bf16 => f.write_str("bf16"),
            Policy::PowerSgd(None) => f.write_str("powersgd"),
            Policy::PowerSgd(Some(r)) => write!(f, "powersgd:{r}"),
            Policy::Zero(stage) => write!(f, "zero{stage}"),
        }
    }
}

/// Parses one `--policy` name (clap's value parser; the message is the rest of clap's line).
pub fn parse_policy(s: &str) -> std::result::Result<Policy, String> {
    Ok(match s {
        "allreduce" => Policy::AllReduce,
        "fp16" => Policy::Fp16,
        "bf16" => Policy::Bf16,
        "powersgd" => Policy::PowerSgd(None),
        "zero1" => Policy::Zero(1),
        "zero2" => Policy::Zero(2),
        _ => match s.strip_prefix("powersgd:") {
            Some(r) => match r.parse::<usize>() {
                Ok(0) => return Err(format!("{s}: the PowerSGD rank must be at least 1")),
                Ok(r) => Policy::PowerSgd(Some(r)),
                Err(_) => return Err(format!("{s}: expected powersgd:R with R a whole number >= 1")),
            },
            None => return Err(format!("unknown policy '{s}': expected one of {POLICY_NAMES}")),
        },
    })
}

impl Policy {
    /// The policy's name with its rank filled in from `base` (`powersgd` becomes `powersgd:1`).
    pub fn label(&self, base: &RunArgs) -> String {
        match self {
            Policy::PowerSgd(None) => Policy::PowerSgd(Some(base.powersgd_rank)).to_string(),
            p => p.to_string(),
        }
    }

    /// `base` with the flags that choose this policy, checked. Other policies' settings are
    /// reset (`--powersgd-*` belong to the powersgd rows only).
    pub fn apply(&self, base: &RunArgs) -> Result<RunArgs> {
        let mut a = base.clone();
        let (rank, start) = (a.powersgd_rank, a.powersgd_start_iter);
        // the flags' defaults, which are PowerSGD's
        let d = PowerSgdConfig::default();
        (a.powersgd_rank, a.powersgd_start_iter) = (d.rank, d.start_iter);
        a.zero = 0;
        a.comm_hook = match *self {
            Policy::AllReduce => CommHookName::Allreduce,
            Policy::Fp16 => CommHookName::Fp16,
            Policy::Bf16 => CommHookName::Bf16,
            Policy::PowerSgd(r) => {
                (a.powersgd_rank, a.powersgd_start_iter) = (r.unwrap_or(rank), start);
                CommHookName::Powersgd
            }
            Policy::Zero(stage) => {
                a.zero = stage;
                CommHookName::Allreduce
            }
        };
        a.validate()
            .map_err(|e| Error::Usage(format!("--policy {}: {e}", self.label(base))))?;
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_to_its_policy_and_back() {
        for name in ["allreduce", "fp16", "bf16", "powersgd", "powersgd:4", "zero1", "zero2"] {
            assert_eq!(parse_policy(name).unwrap().to_string(), name);
        }
        assert_eq!(parse_policy("powersgd:16"), Ok(Policy::PowerSgd(Some(16))));
    }

    #[test]
    fn bad_names_say_what_is_expected() {
        let e = parse_policy("foo").unwrap_err();
        assert!(e.contains("'foo'") && e.contains("powersgd:R"), "{e}");
        assert!(parse_policy("powersgd:0").unwrap_err().contains("at least 1"));
        assert!(parse_policy("powersgd:x").unwrap_err().contains("powersgd:R"));
        assert!(parse_policy("zero3").unwrap_err().contains("unknown policy"));
        assert!(parse_policy("").is_err());
    }
}
