//! `brigade train`: run a training, print a summary, write the requested files.

use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use crate::args::RunArgs;
use crate::error::{write_atomic, CliError, Result};
use crate::run::{run, RunOptions, RunReport};
use crate::timeline::write_timeline;

/// Options of `brigade train`.
#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Write the final parameters here (safetensors, atomically).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Write `step,loss` for every step run (global mean loss before the step's update).
    #[arg(long)]
    pub losses: Option<PathBuf>,
    /// Write a Chrome trace of the last step (and FILE.svg beside it).
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Write parameters and optimizer state here at the end (and every --checkpoint-every steps).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Checkpoint period in steps.
    #[arg(long)]
    pub checkpoint_every: Option<usize>,
    /// Continue from a checkpoint written by --checkpoint (until --steps).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// End with the summary as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Median and minimum of a slice (NaN when empty).
pub fn median_min(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    (s[s.len() / 2], s[0])
}

/// The numbers a run ends with.
pub struct Summary {
    pub first_loss: f64,
    pub last_loss: f64,
    pub median_step_ms: f64,
    pub min_step_ms: f64,
    pub samples_per_s: f64,
}

/// Summarises a report, leaving the first `warmup` steps out of the timing.
pub fn summarize(args: &RunArgs, report: &RunReport) -> Summary {
    let timed = &report.step_ms[args.warmup.min(report.step_ms.len())..];
    let (median, min) = median_min(timed);
    // the report's world size: under MPI it comes from mpirun, not from --world-size
    let global_batch = (report.world_size * args.rows_per_rank()) as f64;
    Summary {
        first_loss: report.losses.first().copied().unwrap_or(f64::NAN),
        last_loss: report.losses.last().copied().unwrap_or(f64::NAN),
        median_step_ms: median,
        min_step_ms: min,
        samples_per_s: global_batch / (median / 1e3),
    }
}

/// Runs `brigade train`.
pub fn train(t: TrainArgs) -> Result<()> {
    let opts = RunOptions {
        compute_only: false,
        record: t.timeline.is_some(),
        progress: !t.quiet && !t.json,
        resume: t.resume.clone(),
        checkpoint: t.checkpoint.clone(),
        checkpoint_every: t.checkpoint_every,
        stop: Some(crate::signal::stop_on_signals()),
    };
    let report = run(&t.run, &opts)?;
    write_outputs(&t, &report)?;
    let s = summarize(&t.run, &report);
    let a = &t.run;
    if t.json {
        let flags = json!({
            "model": format!("{:?}", a.model.model).to_lowercase(),
            "steps": a.steps, "batch_size": a.batch_size, "accum": a.accum, "lr": a.lr,
            "optimizer": format!("{:?}", a.optimizer).to_lowercase(), "seed": a.seed,
            "backend": format!("{:?}", a.backend).to_lowercase(),
            "bucket_mb": a.bucket_cap()?, "first_bucket_mb": a.first_bucket_mb,
            "net_gbps": a.net_gbps, "net_latency_us": a.net_latency_us, "warmup": a.warmup,
            "threads_per_rank": a.threads_per_rank.unwrap_or_else(|| crate::run::default_threads(a.world_size)),
        });
        let out = json!({
            "first_loss": s.first_loss, "last_loss": s.last_loss,
            "median_step_ms": s.median_step_ms, "min_step_ms": s.min_step_ms,
            "samples_per_s": s.samples_per_s, "world_size": report.world_size,
            "first_step": report.first_step, "buckets": report.buckets.len(),
            "gradient_bytes": report.memory.map(|m| m.gradient_bytes),
            "gradient_and_bucket_bytes": report.memory.map(|m| m.total_bytes()),
            "flags": flags,
        });
        println!("{out}");
    } else {
        println!(
            "model {} | world size {} | {} rows/rank x accum {} | steps {}..{} | {:?} lr {}",
            format!("{:?}", a.model.model).to_lowercase(),
            report.world_size,
            a.batch_size,
            a.accum,
            report.first_step,
            a.steps,
            a.optimizer,
            a.lr
        );
        println!("loss: first {:.4}  last {:.4}", s.first_loss, s.last_loss);
        println!(
            "step time: median {:.2} ms  min {:.2} ms  (first {} steps excluded)",
            s.median_step_ms, s.min_step_ms, a.warmup
        );
        println!("throughput: {:.1} samples/s", s.samples_per_s);
        if let Some(m) = report.memory {
            let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
            println!(
                "gradient memory per rank: {:.2} MiB in {} buckets (gradients + buckets: {:.2} MiB, one copy)",
                mib(m.gradient_bytes),
                report.buckets.len(),
                mib(m.total_bytes())
            );
        }
    }
    if report.interrupted {
        let step = (report.first_step + report.losses.len()).saturating_sub(1);
        return Err(CliError::Interrupted { step, steps: a.steps });
    }
    Ok(())
}

/// `--save`, `--losses`, `--timeline`, written from rank 0's view of the run.
pub fn write_outputs(t: &TrainArgs, report: &RunReport) -> Result<()> {
    if let Some(path) = &t.save {
        brigade_models::save_safetensors(path, &report.params, None)?;
    }
    if let Some(path) = &t.losses {
        let mut csv = String::from("step,loss\n");
        for (i, l) in report.losses.iter().enumerate() {
            csv.push_str(&format!("{},{:.9}\n", report.first_step + i, l));
        }
        write_atomic(path, csv.as_bytes())?;
    }
    if let (Some(path), Some(tl)) = (&t.timeline, &report.timeline) {
        let title = format!(
            "step {}: {} ranks, bucket cap {} MiB",
            tl.step,
            report.world_size,
            t.run.bucket_cap()?
        );
        write_timeline(path, &tl.events, tl.origin, &title)?;
    }
    Ok(())
}
