//! `brigade sweep --policy allreduce,fp16,bf16,powersgd:4,... [--precisions f32,bf16]`: reducer
//! policies (and precisions) side by side at one bucket cap — step time, exposed communication,
//! bytes sent per rank, final loss — written to `policies.csv` and one chart, `policies.svg`.
//!
//! Each row is a full training run with that policy. Exposed comm = the row's median step
//! minus a compute-only baseline (the same ranks and batches, no gradient communication, a
//! few steps, run right before the row because this machine's speed drifts); for a
//! compressing policy it includes the compression's own compute. Bytes are rank 0's, as
//! `brigade train` reports them (`sent.rs`): payload handed to DDP's collectives, and ring
//! wire bytes.

use crate::report::stdout::outln;
use std::path::Path;
use std::sync::Arc;

use brigade::observe::TrainObserver;
use brigade::policies::PolicySpec;
use brigade::tensorboard::TensorBoard;
use brigade::TrainConfig;

use plotters::prelude::*;
use serde::Serialize;

use crate::args::{flag_name, RunArgs};
use crate::commands::sweep_args::{finished, median_step, prepare_out, remove_stale, SweepArgs, POLICY_OUTPUTS};
use crate::error::{Error, Result};
use crate::outputs::write_atomic;
use crate::policy::resolve;
use crate::run::{run_config, train_config, LateHeldOut, RunOptions};
use crate::sent::{human_bytes, SentSummary};

/// Timed steps of each row's compute-only baseline (after `--warmup`).
pub const BASELINE_STEPS: usize = 5;
/// The final loss is also given as the mean of this many last steps (one step is noisy).
pub const LAST_LOSSES: usize = 10;

/// One policy's row, under one precision.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRow {
    /// The policy (`powersgd:4`).
    pub policy: String,
    /// The precision it trained in (`f32`, `bf16`, `fp16`).
    pub precision: String,
    /// Median step time, in ms (after `--warmup`).
    pub step_ms: f64,
    /// Median step of the compute-only baseline, in ms.
    pub compute_only_ms: f64,
    /// `step_ms - compute_only_ms`, at least 0.
    pub exposed_comm_ms: f64,
    /// Mean payload bytes rank 0 handed to DDP's collectives per step.
    pub sent_bytes_per_step: f64,
    /// Payload bytes of the last step (the policy's steady state).
    pub sent_bytes_last_step: u64,
    /// Payload bytes of the whole run.
    pub sent_bytes_total: u64,
    /// Mean ring wire bytes per step.
    pub wire_bytes_per_step: f64,
    /// The last step's loss (global mean over ranks, before its update).
    pub final_loss: f64,
    /// Mean loss of the last [`LAST_LOSSES`] steps.
    pub last10_loss: f64,
    /// What the policy says about the run, empty when nothing (e.g. that PowerSGD never
    /// compressed: the run ended before its start iteration).
    pub note: String,
}

/// What a row is named by: its policy, and its precision where the sweep compares several.
fn label(row: &PolicyRow, precisions: usize) -> String {
    if precisions > 1 {
        format!("{} {}", row.policy, row.precision)
    } else {
        row.policy.clone()
    }
}

/// Checks the policy and precision lists and the flags against them, and returns each row's
/// policy with the configuration it trains (the flags' configuration under that policy and
/// precision), each policy under every precision in turn.
fn plan(s: &SweepArgs, opts: &RunOptions, late: &Arc<LateHeldOut>) -> Result<Vec<(PolicySpec, TrainConfig)>> {
    let bad = |m: String| Err(Error::Usage(m));
    if let Some((first, again)) = brigade::study::repeated(&s.precisions) {
        return bad(format!(
            "--precisions lists {} twice (entries {first} and {again}): each precision is one row per policy",
            s.precisions[again - 1].name()
        ));
    }
    if s.policy.is_empty() {
        // --precisions alone: the run's own policy under each
        return rows(s, vec![s.run.hook_spec()], opts, late);
    }
    let specs: Vec<PolicySpec> = s
        .policy
        .iter()
        .map(|e| {
            let d = &s.run.distributed;
            resolve(e, d.powersgd_rank, d.powersgd_start_iter)
        })
        .collect::<Result<_>>()?;
    crate::args::listed_once("--policy", &specs, "each policy is one row")?;
    s.run.check_no_policy_alias()?;
    s.run.check_settings_flags(&specs, true)?;
    rows(s, specs, opts, late)
}

/// Every row of `specs` under every precision (the run's own without --precisions), each
/// checked before the first runs.
fn rows(
    s: &SweepArgs,
    specs: Vec<PolicySpec>,
    opts: &RunOptions,
    late: &Arc<LateHeldOut>,
) -> Result<Vec<(PolicySpec, TrainConfig)>> {
    if s.repeat != 1 {
        return Err(Error::Usage(match s.repeat {
            0 => "--repeat must be at least 1, got 0 (and a --policy sweep runs each policy once)".into(),
            n => format!("--repeat {n} is for sweeps of bucket caps; a --policy sweep runs each policy once"),
        }));
    }
    let caps = s.run.fixed_caps()?;
    if caps.len() != 1 {
        return Err(Error::Usage(format!(
            "--policy and --precisions compare at one bucket cap, got --bucket-mb {caps:?}: sweep the caps without them"
        )));
    }
    if s.run.recipe.steps < 2 {
        return Err(Error::Usage("a sweep needs --steps >= 2".into()));
    }
    let precisions = match &s.precisions[..] {
        [] => vec![s.run.recipe.precision],
        some => some.to_vec(),
    };
    let mut rows = vec![];
    for spec in specs {
        for &precision in &precisions {
            let mut run = s.run.clone();
            run.recipe.precision = precision;
            let at = if s.precisions.is_empty() {
                format!("--policy {spec}")
            } else {
                format!("--policy {spec} --precision {}", precision.name())
            };
            run.validate_for(&spec)
                .map_err(|e| Error::Usage(format!("{at}: {e}")))?;
            let mut cfg = train_config(&run, opts, late)?;
            if let Some(d) = cfg.distributed.as_mut() {
                d.policy = crate::policy::maker(spec.clone());
            }
            rows.push((spec.clone(), cfg));
        }
    }
    Ok(rows)
}

/// Runs `brigade sweep --policy`.
pub fn sweep_policies(s: &SweepArgs, stop_on_signal: Arc<dyn TrainObserver>) -> Result<()> {
    // a signal stops the run in progress at a step boundary; that run is dropped, and --out
    // gets the policies that finished
    let quiet = RunOptions {
        observer: Some(stop_on_signal),
        ..RunOptions::default()
    };
    let late = Arc::new(LateHeldOut::default());
    let plan = plan(s, &quiet, &late)?;
    // the directories made here are removed again when the sweep is refused or ends with
    // nothing written
    let made = s.made_dirs();
    prepare_out(&s.out, &POLICY_OUTPUTS, &s.run)?;
    if let Some(dir) = &s.tensorboard {
        crate::tensorboard::prepare(dir)?;
    }
    // --tensorboard: each row's run directory
    let mut boards = vec![];
    let mut rows = vec![];
    // a row that fails (diverged, refused by its policy) ends the sweep with its error, after
    // the rows that finished are written
    let mut failed = None;
    let mut interrupted = false;
    for (spec, cfg) in &plan {
        match run_row(s, &quiet, &late, (spec, cfg), &mut boards)? {
            RowRun::Done(row) => rows.push(row),
            RowRun::Interrupted => {
                interrupted = true;
                break;
            }
            RowRun::Failed(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    if interrupted && rows.is_empty() {
        return Err(Error::SweepInterrupted {
            runs: 0,
            of: plan.len(),
        });
    }
    // every row that finished (all of them, unless one failed)
    if !rows.is_empty() {
        write_atomic(&s.out.join(POLICY_OUTPUTS[0]), csv(&rows).as_bytes())?;
        draw_chart(&s.out.join(POLICY_OUTPUTS[1]), &rows, &s.run, s.precisions.len())?;
        remove_stale(&s.out, &POLICY_OUTPUTS.map(String::from))?;
        made.keep();
    }
    if let Some(e) = failed {
        return Err(e);
    }
    crate::tensorboard::with_failures(Ok(()), boards.iter().map(|tb| &**tb))?;
    print_rows(s, &rows)?;
    if interrupted {
        return Err(Error::SweepInterrupted {
            runs: rows.len(),
            of: plan.len(),
        });
    }
    Ok(())
}

/// How one row's runs ended.
enum RowRun {
    /// Both runs finished.
    Done(PolicyRow),
    /// A signal stopped one.
    Interrupted,
    /// One failed (diverged, refused by its policy): the sweep ends with this error.
    Failed(Error),
}

/// One row: the compute-only baseline (the same ranks and batches, no gradient communication, a
/// few steps), then the policy's run, observed by its --tensorboard directory (kept in `boards`).
fn run_row(
    s: &SweepArgs,
    quiet: &RunOptions,
    late: &Arc<LateHeldOut>,
    (spec, cfg): (&PolicySpec, &TrainConfig),
    boards: &mut Vec<Arc<TensorBoard>>,
) -> Result<RowRun> {
    let a = &s.run;
    let mut base = cfg.clone();
    base.recipe.steps = cfg.recipe.steps.min(a.runtime.untimed_steps + BASELINE_STEPS);
    base.distributed = None;
    let baseline = match run_config(a, quiet, &base, late).and_then(finished) {
        Ok(b) => b,
        Err(e) => return Ok(RowRun::Failed(e)),
    };
    if baseline.outcome.interrupted {
        return Ok(RowRun::Interrupted);
    }
    let compute_ms = median_step(a, &baseline.outcome.ms());
    let board = s.tensorboard.as_ref().map(|dir| {
        let name = match s.precisions.len() {
            0 | 1 => spec.to_string(),
            _ => format!("{spec}_{}", cfg.recipe.precision.name()),
        };
        Arc::new(TensorBoard::new(crate::tensorboard::run_dir(dir, &name)))
    });
    boards.extend(board.clone());
    let mut observed = cfg.clone();
    observed.runtime.instrument.observer = Some(Arc::new((quiet.observer.clone(), board)));
    let report = match run_config(a, quiet, &observed, late).and_then(finished) {
        Ok(r) => r.outcome,
        Err(e) => return Ok(RowRun::Failed(e)),
    };
    if report.interrupted {
        return Ok(RowRun::Interrupted);
    }
    Ok(RowRun::Done(policy_row(a, spec, cfg, &report, compute_ms)?))
}

/// A row's figures from its run's outcome and its baseline's median step.
fn policy_row(
    a: &RunArgs,
    spec: &PolicySpec,
    cfg: &TrainConfig,
    report: &brigade::outcome::TrainOutcome,
    compute_ms: f64,
) -> Result<PolicyRow> {
    let step_ms = median_step(a, &report.ms());
    let sent = SentSummary::of(&report.sent()).ok_or_else(|| Error::Usage("no step ran".into()))?;
    let losses = report.losses();
    let tail = &losses[losses.len().saturating_sub(LAST_LOSSES)..];
    Ok(PolicyRow {
        policy: spec.to_string(),
        precision: cfg.recipe.precision.name().to_string(),
        note: report
            .policy_diagnostics
            .iter()
            .map(|d| d.message.clone())
            .collect::<Vec<_>>()
            .join("; "),
        step_ms,
        compute_only_ms: compute_ms,
        exposed_comm_ms: (step_ms - compute_ms).max(0.0),
        sent_bytes_per_step: sent.payload_per_step,
        sent_bytes_last_step: sent.payload_last_step,
        sent_bytes_total: sent.payload_total,
        wire_bytes_per_step: sent.wire_per_step,
        final_loss: report.losses().last().copied().unwrap_or(f64::NAN),
        last10_loss: tail.iter().sum::<f64>() / tail.len() as f64,
    })
}

/// The rows on stdout: JSON, or a table, the policies' notes and where the CSV went.
fn print_rows(s: &SweepArgs, rows: &[PolicyRow]) -> Result<()> {
    if s.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(rows).map_err(|e| Error::json("the policy rows", e))?
        );
        return Ok(());
    }
    outln!(
        "{:>16} {:>9} {:>12} {:>11} {:>14} {:>14} {:>11} {:>11}",
        "policy",
        "step_ms",
        "compute_ms",
        "exposed_ms",
        "sent/step",
        "last step",
        "final_loss",
        "last10_loss"
    );
    for r in rows {
        outln!(
            "{:>16} {:>9.2} {:>12.2} {:>11.2} {:>14} {:>14} {:>11.4} {:>11.4}",
            label(r, s.precisions.len()),
            r.step_ms,
            r.compute_only_ms,
            r.exposed_comm_ms,
            human_bytes(r.sent_bytes_per_step),
            human_bytes(r.sent_bytes_last_step as f64),
            r.final_loss,
            r.last10_loss
        );
    }
    for r in rows.iter().filter(|r| !r.note.is_empty()) {
        outln!("note: {}: {}", label(r, s.precisions.len()), r.note);
    }
    outln!("wrote {}", s.out.join(POLICY_OUTPUTS[0]).display());
    Ok(())
}

/// The rows as CSV, one line per policy and precision.
fn csv(rows: &[PolicyRow]) -> String {
    let mut csv = String::from(
        "policy,step_ms,compute_only_ms,exposed_comm_ms,sent_bytes_per_step,sent_bytes_last_step,sent_bytes_total,wire_bytes_per_step,final_loss,last10_loss,precision,note\n",
    );
    for r in rows {
        csv.push_str(&format!(
            "{},{:.3},{:.3},{:.3},{:.1},{},{},{:.1},{:.6},{:.6},{},\"{}\"\n",
            r.policy,
            r.step_ms,
            r.compute_only_ms,
            r.exposed_comm_ms,
            r.sent_bytes_per_step,
            r.sent_bytes_last_step,
            r.sent_bytes_total,
            r.wire_bytes_per_step,
            r.final_loss,
            r.last10_loss,
            r.precision,
            r.note.replace('"', "'")
        ));
    }
    csv
}

/// Three panels side by side, one bar group per policy: step time and exposed comm (ms),
/// bytes sent per step (MiB: mean and last step), final loss. Written atomically.
fn draw_chart(path: &Path, rows: &[PolicyRow], a: &RunArgs, precisions: usize) -> Result<()> {
    let mut svg = String::new();
    render_chart(&mut svg, path, rows, a, precisions)?;
    write_atomic(path, svg.as_bytes())
}

type Metric = (&'static str, RGBColor, fn(&PolicyRow) -> f64);

fn render_chart(svg: &mut String, path: &Path, rows: &[PolicyRow], a: &RunArgs, precisions: usize) -> Result<()> {
    let err = |m: String| Error::Chart {
        path: path.display().to_string(),
        msg: m,
    };
    let root = SVGBackend::with_string(svg, (1260, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let root = root
        .titled(&caption(a), ("sans-serif", 18))
        .map_err(|e| err(e.to_string()))?;
    let panels = root.split_evenly((1, 3));
    let names: Vec<String> = rows.iter().map(|r| label(r, precisions)).collect();
    for (panel, (y_desc, metrics)) in panels.iter().zip(metric_groups()) {
        draw_panel(panel, rows, &names, y_desc, metrics).map_err(err)?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// The chart's title: the workload, its layout and the network.
fn caption(a: &RunArgs) -> String {
    format!(
        "{}, world size {}, {} rows/rank, {} steps, bucket {} MiB, net {}",
        flag_name(&a.model.model),
        a.distributed.world_size,
        a.rows_per_rank(),
        a.recipe.steps,
        a.distributed
            .bucket_mb
            .first()
            .map(|b| b.to_string())
            .unwrap_or_default(),
        a.distributed
            .net_gbps
            .map(|g| format!("{g} Gb/s"))
            .unwrap_or_else(|| "unlimited".into()),
    )
}

/// The three panels' axis names and bars: time, bytes sent, loss.
fn metric_groups() -> [(&'static str, Vec<Metric>); 3] {
    [
        (
            "ms per step",
            vec![
                ("step time", RGBColor(52, 152, 219), |r| r.step_ms),
                ("exposed comm", RGBColor(231, 76, 60), |r| r.exposed_comm_ms),
            ],
        ),
        (
            "MiB sent per step per rank",
            vec![
                ("mean", RGBColor(230, 126, 34), |r| {
                    r.sent_bytes_per_step / (1024.0 * 1024.0)
                }),
                ("last step", RGBColor(142, 68, 173), |r| {
                    r.sent_bytes_last_step as f64 / (1024.0 * 1024.0)
                }),
            ],
        ),
        (
            "loss",
            vec![
                ("final", RGBColor(39, 174, 96), |r| r.final_loss),
                ("last 10 steps", RGBColor(22, 160, 133), |r| r.last10_loss),
            ],
        ),
    ]
}

/// One panel: a group of bars per row (one bar per metric, labelled by `names`), with a legend;
/// the error in words.
fn draw_panel<DB: DrawingBackend>(
    panel: &DrawingArea<DB, plotters::coord::Shift>,
    rows: &[PolicyRow],
    names: &[String],
    y_desc: &str,
    metrics: Vec<Metric>,
) -> std::result::Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let ymax = rows
        .iter()
        .flat_map(|r| metrics.iter().map(move |(_, _, f)| f(r)))
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max)
        * 1.15
        + 1e-9;
    let n = rows.len() as f64;
    let mut chart = ChartBuilder::on(panel)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..ymax)
        .map_err(err)?;
    let labels = names.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len().max(1))
        .x_label_formatter(&move |x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    let width = 0.8 / metrics.len() as f64;
    for (k, (name, color, f)) in metrics.into_iter().enumerate() {
        let bars = rows.iter().enumerate().map(move |(i, r)| {
            let x0 = i as f64 - 0.4 + k as f64 * width;
            let v = f(r);
            Rectangle::new(
                [(x0, 0.0), (x0 + width * 0.9, if v.is_finite() { v } else { 0.0 })],
                color.filled(),
            )
        });
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(err)
}
