//! `--bucket-mb` values (a cap in MiB, or `auto`) and the autotuner's flags.

use crate::report::stdout::outln;
use brigade_ddp::overlap::{AutotuneConfig, AutotuneReport, AUTOTUNE_CAPS_MB, AUTOTUNE_START_CAP_MB, DEFAULT_MIN_GAIN};
use clap::Args;

use crate::args::{compact, RunArgs};
use crate::error::{Error, Result};

/// One `--bucket-mb` value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BucketCap {
    /// A fixed cap, in MiB.
    Mib(f64),
    /// Chosen by the overlap model as training runs (`brigade_ddp::overlap::Autotuner`).
    Auto,
}

impl BucketCap {
    /// The fixed cap, if this is one.
    pub fn mib(self) -> Option<f64> {
        match self {
            BucketCap::Mib(m) => Some(m),
            BucketCap::Auto => None,
        }
    }
}

impl std::fmt::Display for BucketCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BucketCap::Mib(m) => write!(f, "{}", compact(*m)),
            BucketCap::Auto => write!(f, "auto"),
        }
    }
}

/// Parses one `--bucket-mb` value: `auto` or a number of MiB (range-checked by `validate`).
pub fn parse_bucket_cap(s: &str) -> std::result::Result<BucketCap, String> {
    if s == "auto" {
        return Ok(BucketCap::Auto);
    }
    s.parse::<f64>()
        .map(BucketCap::Mib)
        .map_err(|_| format!("'{s}' is neither a number of MiB nor `auto`"))
}

/// The autotuner's flags (with `--bucket-mb auto`).
#[derive(Args, Clone, Debug, Default)]
pub struct AutotuneArgs {
    /// With --bucket-mb auto: re-check the cap every K steps after the first decision (which
    /// follows the first step); default: decide once.
    #[arg(long)]
    pub autotune_every: Option<usize>,
    /// With --bucket-mb auto: the caps to choose from, in MiB (default 0.25,0.5,1,2,5,10,25,50,100).
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    pub autotune_caps: Option<Vec<f64>>,
    /// With --bucket-mb auto: change the cap only when the best candidate's predicted step is
    /// shorter than the current cap's by more than this fraction of it (default 0.02); a negative
    /// -F also adopts a best candidate predicted slower by less than F (-1e9: whatever it predicts).
    #[arg(long, allow_negative_numbers = true)]
    pub autotune_min_gain: Option<f64>,
}

impl RunArgs {
    /// True with `--bucket-mb auto`.
    pub fn bucket_auto(&self) -> bool {
        self.distributed.bucket_mb.contains(&BucketCap::Auto)
    }

    /// The fixed caps of a sweep; `auto` is a training run's.
    pub fn fixed_caps(&self) -> Result<Vec<f64>> {
        self.distributed
            .bucket_mb
            .iter()
            .map(|b| {
                b.mib().ok_or_else(|| {
                    Error::Usage(
                        "--bucket-mb auto is for `brigade train` (a sweep measures fixed caps; list numbers)".into(),
                    )
                })
            })
            .collect()
    }

    /// The autotuner's configuration with `--bucket-mb auto` (`None` for a fixed cap); the
    /// simulated link when there is one, else the link fitted to the recorded buckets.
    pub fn autotune_config(&self) -> Option<AutotuneConfig> {
        let a = &self.distributed.autotune;
        self.bucket_auto().then(|| AutotuneConfig {
            every: a.autotune_every,
            candidates_mb: a.autotune_caps.clone().unwrap_or_else(|| AUTOTUNE_CAPS_MB.to_vec()),
            first_bucket_cap_mb: self.distributed.first_bucket_mb,
            min_gain: a.autotune_min_gain.unwrap_or(DEFAULT_MIN_GAIN),
            link: self
                .distributed
                .net_gbps
                .map(|g| brigade::launch::net_model(g, self.distributed.net_latency_us)),
        })
    }

    /// The first bucket's cap under a bucket cap of `cap` MiB: `--first-bucket-mb`, never above
    /// the cap (as the autotuner, the sweep and `brigade predict` take it).
    pub fn first_bucket_cap(&self, cap: f64) -> f64 {
        self.distributed.first_bucket_mb.min(cap)
    }

    /// The cap DDP starts with: the fixed one, or `auto`'s starting point.
    pub(crate) fn start_cap(&self) -> Option<f64> {
        match self.distributed.bucket_mb.as_slice() {
            [BucketCap::Mib(b)] => Some(*b),
            [BucketCap::Auto] => Some(AUTOTUNE_START_CAP_MB),
            _ => None,
        }
    }

    /// Checks `--bucket-mb auto` and the autotuner's flags.
    pub(crate) fn validate_autotune(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        let a = &self.distributed.autotune;
        let given = a.autotune_every.is_some() || a.autotune_caps.is_some() || a.autotune_min_gain.is_some();
        if !self.bucket_auto() {
            return if given {
                bad("--autotune-every, --autotune-caps and --autotune-min-gain are for --bucket-mb auto".into())
            } else {
                Ok(())
            };
        }
        if self.distributed.bucket_mb.len() > 1 {
            return bad(format!(
                "--bucket-mb auto stands alone, got {}",
                self.distributed
                    .bucket_mb
                    .iter()
                    .map(|b| b.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ));
        }
        if self.distributed.policy.keeps_state_per_bucket() {
            return bad(format!(
                "--bucket-mb auto regroups the buckets mid-run, and {} keeps state per bucket: give a fixed --bucket-mb",
                self.policy_flag()
            ));
        }
        if a.autotune_every == Some(0) {
            return bad("--autotune-every must be at least 1 (steps between checks)".into());
        }
        if let Some(c) = a
            .autotune_caps
            .iter()
            .flatten()
            .find(|&&c| !crate::args::cap_in_range(c))
        {
            return bad(format!(
                "--autotune-caps must be finite numbers of MiB, at least one byte ({:e}) and at most {}, got {}",
                crate::args::MIN_BUCKET_MB,
                crate::args::MAX_BUCKET_MB,
                compact(*c)
            ));
        }
        if let Some(c) = a.autotune_caps.as_deref().and_then(crate::args::listed_twice) {
            return bad(format!("--autotune-caps lists {c} twice"));
        }
        if a.autotune_caps.as_ref().is_some_and(|c| c.is_empty()) {
            return bad("--autotune-caps needs at least one cap".into());
        }
        if a.autotune_min_gain.is_some_and(|g| !g.is_finite()) {
            return bad("--autotune-min-gain must be a finite fraction (e.g. 0.02)".into());
        }
        Ok(())
    }
}

/// The summary line of `--bucket-mb auto`: the cap chosen, and the predicted against the
/// measured step time at it, with the steps each covers ([`autotune_steps`]).
pub fn print_autotune(t: &AutotuneReport) {
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2} ms"));
    let changes = t.decisions.iter().filter(|d| d.changed).count();
    outln!(
        "bucket cap (auto): {} MiB after {} {} ({changes} {}); step at that cap: predicted {}, measured {} {}",
        compact(t.cap_mb),
        t.decisions.len(),
        if t.decisions.len() == 1 { "check" } else { "checks" },
        if changes == 1 { "change" } else { "changes" },
        ms(t.predicted_step_ms),
        ms(t.measured_step_ms),
        autotune_steps(t)
    );
}

/// Which steps the autotuner's predicted and measured step at its final cap cover, in
/// parentheses: one range when they are the same steps; each its own when the prediction came
/// from steps run before the cap was set.
pub fn autotune_steps(t: &AutotuneReport) -> String {
    let steps = |r: &std::ops::Range<usize>| match r.len() {
        1 => format!("step {}", r.start),
        _ => format!("steps {}..{}", r.start, r.end),
    };
    match (&t.predicted_steps, &t.measured_steps) {
        (Some(p), Some(m)) if p == m => format!("(medians over {})", steps(m)),
        (Some(p), Some(m)) => format!(
            "(predicted from {} at the cap before, replayed at this one; measured over {} at this one)",
            steps(p),
            steps(m)
        ),
        (None, Some(m)) => format!("(measured over {})", steps(m)),
        (Some(p), None) => format!("(predicted from {})", steps(p)),
        (None, None) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(predicted: Option<std::ops::Range<usize>>, measured: Option<std::ops::Range<usize>>) -> AutotuneReport {
        AutotuneReport {
            cap_mb: 1.0,
            first_bucket_cap_mb: 1.0,
            predicted_step_ms: predicted.as_ref().map(|_| 1.0),
            predicted_steps: predicted,
            measured_step_ms: measured.as_ref().map(|_| 1.0),
            measured_steps: measured,
            decisions: vec![],
        }
    }

    #[test]
    fn the_summary_says_which_steps_the_predicted_and_the_measured_step_cover() {
        assert_eq!(autotune_steps(&report(Some(0..1), Some(0..1))), "(medians over step 0)");
        assert_eq!(
            autotune_steps(&report(Some(0..5), Some(0..5))),
            "(medians over steps 0..5)"
        );
        let apart = autotune_steps(&report(Some(0..1), Some(1..3)));
        assert!(
            apart.contains("predicted from step 0 at the cap before") && apart.contains("measured over steps 1..3"),
            "{apart}"
        );
        assert_eq!(autotune_steps(&report(None, Some(2..4))), "(measured over steps 2..4)");
    }
}
