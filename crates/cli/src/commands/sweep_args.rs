//! `brigade sweep`'s flags, and what both of its sweeps (bucket caps in `sweep.rs`, reducer
//! policies in `policy_sweep.rs`) take from a finished run.

use std::path::{Path, PathBuf};

use clap::Args;

use crate::args::RunArgs;
use crate::error::{Error, Result};
use crate::outputs::MadeDirs;
use crate::policy::parse_entry;
use crate::report::summary::median_min;
use crate::run::RunReport;

/// Options of `brigade sweep`.
#[derive(Args, Clone, Debug)]
pub struct SweepArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Directory for sweep.csv, sweep.svg and one timeline per bucket size
    /// (timeline_{B}MiB.json and .svg), or a policy sweep's policies.csv and policies.svg.
    /// Created if missing; what an earlier sweep of either kind wrote there (those names) is
    /// removed once this sweep's files are written, so the directory holds this sweep alone;
    /// other files are left alone. SIGINT or SIGTERM stops the sweep after a step: the run
    /// in progress is dropped, the runs that finished are written here, and it exits 130.
    #[arg(long)]
    pub out: PathBuf,
    /// Print the table as JSON.
    #[arg(long)]
    pub json: bool,
    /// Run every cap this many times, round-robin (all caps once, then again), so that the
    /// machine's drift touches every cap alike; the table holds each cap's median and spread.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// The reducer policies, as a comma-separated list of the specs of `train --policy`. Several: they
    /// are compared at one bucket cap, and policies.csv and policies.svg are written in --out
    /// (see `policy_sweep.rs`). One, with several --bucket-mb caps: the caps are swept under
    /// that policy (one with one cap is a comparison of one row).
    #[arg(long, value_delimiter = ',', value_parser = parse_entry)]
    pub policy: Vec<String>,
    /// Precisions compared side by side, a comma-separated list of `train --precision`'s
    /// (f32, bf16, fp16): every policy of --policy (or the run's own policy, without it) runs
    /// once under each, at one bucket cap, and policies.csv gains their `precision` column.
    #[arg(long, value_delimiter = ',', value_parser = brigade::MixedPrecision::parse)]
    pub precisions: Vec<brigade::MixedPrecision>,
    /// Write TensorBoard event files of every measured run (as `train --tensorboard` does),
    /// one directory each in DIR, so that `tensorboard --logdir DIR` draws one curve per run:
    /// a cap's `bucket_{B}MiB` (`bucket_{B}MiB/round_{R}` with --repeat), which also holds
    /// the overlap model's predicted/step_ms for the cap at the last step; a policy's spec
    /// (`{policy}_{precision}` with several --precisions). The compute-only baselines are not
    /// written. A directory an earlier sweep wrote and this one does not stays.
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
}

impl SweepArgs {
    /// The output directories the sweep is about to make (`--out`, `--tensorboard`), removed
    /// again when it is refused or ends with nothing written.
    pub fn made_dirs(&self) -> MadeDirs {
        MadeDirs::missing(std::iter::once(self.out.as_path()).chain(self.tensorboard.as_deref()))
    }
}

/// Makes `--out` a directory that takes files, creating it (and its parents) when missing;
/// `files` are those `command` (`sweep`, `study`) will write there, each checked as an output
/// before any run. A path that is a file, or lies under one, is one usage error.
pub fn make_out_dir(out: &Path, files: &[&str], command: &str) -> Result<()> {
    if let Some(file) = out.ancestors().find(|p| p.is_file()) {
        return Err(Error::Usage(format!(
            "--out {}: {} is a file; --out names a directory (created if missing) for the {command}'s files",
            out.display(),
            file.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(|source| Error::Io {
        path: format!("--out {}", out.display()),
        source,
    })?;
    let outputs: Vec<crate::outputs::Output> = files
        .iter()
        .map(|f| crate::outputs::Output::new("--out", &out.join(f)))
        .collect();
    crate::outputs::check_outputs(&outputs)
}

/// The files a policy sweep (`brigade sweep --policy`) writes into `--out`.
pub const POLICY_OUTPUTS: [&str; 2] = ["policies.csv", "policies.svg"];

/// Whether `name` is a file that `brigade sweep` writes into its `--out` directory: a bucket
/// sweep's table, chart and timelines, or a policy sweep's table and chart.
pub fn written_by_a_sweep(name: &str) -> bool {
    let timeline = |ext: &str| {
        name.strip_prefix("timeline_")
            .and_then(|n| n.strip_suffix(ext))
            .and_then(|n| n.strip_suffix("MiB"))
            .is_some_and(|b| b.parse::<f64>().is_ok())
    };
    name == "sweep.csv"
        || name == "sweep.svg"
        || timeline(".json")
        || timeline(".svg")
        || POLICY_OUTPUTS.contains(&name)
}

/// Makes `--out` ready before any run: created and takes `files`; no input
/// of the run (`--data`, `--init`) lies there under a name a sweep of either kind writes. Nothing is removed yet: an earlier sweep's
/// files stay until this one has all of its own ([`remove_stale`]).
pub fn prepare_out(out: &Path, files: &[&str], run: &RunArgs) -> Result<()> {
    let io = |source| Error::Io {
        path: format!("--out {}", out.display()),
        source,
    };
    make_out_dir(out, files, "sweep")?;
    let out_dir = std::fs::canonicalize(out).map_err(io)?;
    for (flag, input) in [("--data", &run.data.data), ("--init", &run.model.init)] {
        let Some(path) = input.as_deref() else { continue };
        let Some(at) = crate::outputs::resolved(flag, path) else {
            continue;
        };
        if at.file_name().and_then(|n| n.to_str()).is_some_and(written_by_a_sweep) && at.parent() == Some(&*out_dir) {
            return Err(Error::Usage(format!(
                "{flag} {} lies in --out {} under a name a sweep writes: move it or pick another --out",
                path.display(),
                out.display()
            )));
        }
    }
    Ok(())
}

/// Removes from `out` what an earlier sweep (of either kind) wrote there and this one did not
/// (`written`): a stale timeline or table must not pass for this sweep's. Regular files only:
/// a symbolic link stays.
pub fn remove_stale(out: &Path, written: &[String]) -> Result<()> {
    let io = |source| Error::Io {
        path: format!("--out {}", out.display()),
        source,
    };
    for entry in std::fs::read_dir(out).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if written_by_a_sweep(name) && !written.iter().any(|w| w == name) && entry.file_type().map_err(io)?.is_file() {
            std::fs::remove_file(entry.path()).map_err(|source| Error::Io {
                path: entry.path().display().to_string(),
                source,
            })?;
        }
    }
    Ok(())
}

/// The median step of a run, after `--warmup`.
pub fn median_step(args: &RunArgs, step_ms: &[f64]) -> f64 {
    median_min(&step_ms[args.runtime.untimed_steps.min(step_ms.len())..]).0
}

/// A run that went to its end, or the error that stopped it (a diverged row fails the sweep).
pub fn finished(mut report: RunReport) -> Result<RunReport> {
    match report.outcome.stopped.take() {
        Some(e) => Err(e.into()),
        None => Ok(report),
    }
}
