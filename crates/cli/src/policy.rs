//! `brigade sweep --policy`'s entries: each is a [`PolicySpec`] as [`FromStr`] reads it
//! (`allreduce`, `fp16`, `bf16`, `int8`, `powersgd:R[@START]`, `zero1`, `zero2`, `zero3`), with what an entry
//! leaves out taken from the sweep's flags: a bare `powersgd` is of `--powersgd-rank`, and a
//! PowerSGD entry without `@START` starts at `--powersgd-start-iter`.

use std::str::FromStr;

use brigade::policies::{PolicySpec, DEFAULT_POWERSGD_START};

use crate::error::{Error, Result};

/// Every form `--policy` takes, for error messages.
pub const POLICY_NAMES: &str =
    "allreduce, fp16, bf16, int8, powersgd, powersgd:R[@START] (R >= 1), zero1, zero2, zero3";

/// Checks one `--policy` entry (clap's value parser; the message is the rest of clap's line).
pub fn parse_entry(s: &str) -> std::result::Result<String, String> {
    if s == "powersgd" {
        return Ok(s.to_string());
    }
    match PolicySpec::from_str(s) {
        Ok(spec) if spec.is_built_in() => Ok(s.to_string()),
        Ok(_) => Err(format!("unknown policy '{s}': expected one of {POLICY_NAMES}")),
        Err(e) => Err(format!("{e} (expected one of {POLICY_NAMES})")),
    }
}

/// The policy an entry names, its left-out parts from the flags `--powersgd-rank` and
/// `--powersgd-start-iter` (`powersgd_rank`, `powersgd_start_iter`).
pub fn resolve(entry: &str, powersgd_rank: usize, powersgd_start_iter: usize) -> Result<PolicySpec> {
    let spec = match entry {
        "powersgd" => PolicySpec::PowerSgd {
            rank: powersgd_rank,
            start_iter: DEFAULT_POWERSGD_START,
        },
        _ => PolicySpec::from_str(entry).map_err(|e| Error::Usage(format!("--policy {entry}: {e}")))?,
    };
    Ok(match spec {
        PolicySpec::PowerSgd { rank, .. } if !entry.contains('@') => PolicySpec::PowerSgd {
            rank,
            start_iter: powersgd_start_iter,
        },
        spec => spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_policy_specs() {
        for name in [
            "allreduce",
            "fp16",
            "bf16",
            "int8",
            "powersgd",
            "powersgd:4",
            "powersgd:4@2",
            "zero1",
            "zero2",
            "zero3",
        ] {
            assert_eq!(parse_entry(name).as_deref(), Ok(name));
        }
    }

    #[test]
    fn bad_entries_say_what_is_expected() {
        let e = parse_entry("foo").unwrap_err();
        assert!(e.contains("'foo'") && e.contains("powersgd:R"), "{e}");
        assert!(parse_entry("powersgd:0").unwrap_err().contains(">= 1"));
        assert!(parse_entry("powersgd:x").unwrap_err().contains("powersgd:R"));
        assert!(parse_entry("powersgd:2@x").unwrap_err().contains("start iteration"));
        assert!(parse_entry("zero4").unwrap_err().contains("unknown policy"));
        assert!(parse_entry("").is_err());
    }
}
