//! `brigade sweep`: how much communication the backward pass hides, per bucket size.
//!
//! For each bucket cap: the DDP step time; the compute-only time (the same ranks and
//! per-rank batch at once, with communication switched off, so that core and memory
//! contention is in both figures); the comm time of the recorded step (sum of the
//! buckets' all-reduce durations on rank 0's comm stream); the last bucket's all-reduce
//! alone (what has nothing left to overlap with); exposed comm = step - compute-only;
//! share hidden = 1 - exposed / comm. With `--repeat R` every cap runs R times, round-robin,
//! and each row holds medians and spreads, the overlap model's prediction for the cap and the
//! cap's lower bound (`crate::report::sweep_stats`).

use std::sync::Arc;

use crate::report::stdout::{out, outln};
use brigade::observe::TrainObserver;
use brigade::tensorboard::{TensorBoard, PREDICTED_STEP_MS};
use brigade_ddp::overlap::{LaunchOverhead, StepProfile};
use plotters::prelude::*;

use crate::args::{compact, flag_name, BucketCap, RunArgs};
use crate::commands::sweep_args::{finished, median_step, prepare_out, remove_stale, SweepArgs};
use crate::error::{Error, Result};
use crate::outputs::write_atomic;
use crate::report::sweep_stats::{run_rounds, summarize, to_csv, Sample, SweepRow};
use crate::report::timeline_svg::write_timeline;
use crate::run::{run, RunOptions};
use crate::signal::StopOnSignal;

/// Each DDP bucket's all-reduce time in the recorded step, in launch order: from the moment
/// the last rank started it on its comm stream (before that, the early ranks only wait
/// for the late ones) until it finished on rank 0.
fn bucket_times(events: &[brigade_comm::TraceEvent]) -> Vec<(usize, f64)> {
    let mut buckets: Vec<usize> = events
        .iter()
        .filter(|e| e.rank == 0)
        .filter_map(|e| brigade::ddp::bucket_of(&e.kind))
        .collect();
    buckets.sort_unstable();
    buckets.dedup();
    buckets
        .into_iter()
        .filter_map(|b| {
            let same = || {
                events
                    .iter()
                    .filter(move |e| brigade::ddp::bucket_of(&e.kind) == Some(b))
            };
            let joined = same().filter_map(|e| e.start).map(|s| s.at).max()?;
            let end = same().find(|e| e.rank == 0)?.end?.at;
            Some((b, end.saturating_duration_since(joined).as_secs_f64() * 1e3))
        })
        .collect()
}

/// Most runs of each cap a sweep takes (`--repeat`).
const MAX_REPEAT: usize = 1000;

/// Runs `brigade sweep`.
pub fn sweep(mut s: SweepArgs) -> Result<()> {
    // first: a signal from here on stops the sweep (at once while its first run starts)
    let stop_on_signal: Arc<dyn TrainObserver> = Arc::new(StopOnSignal::install());
    if sweeps_policies(&mut s)? {
        return crate::commands::policy_sweep::sweep_policies(&s, stop_on_signal);
    }
    let caps = s.run.fixed_caps()?;
    check_caps_sweep(&s, &caps)?;
    // the directories made here are removed again when the sweep is refused or ends with
    // nothing written
    let made = s.made_dirs();
    prepare_out(&s.out, &["sweep.csv", "sweep.svg"], &s.run)?;
    if let Some(dir) = &s.tensorboard {
        crate::tensorboard::prepare(dir)?;
    }
    // a signal stops the run in progress at a step boundary; that run is dropped, and --out
    // gets the runs that finished (during the first run's start-up: an exit at once)
    let mut runs = CapRuns {
        quiet: RunOptions {
            observer: Some(stop_on_signal),
            ..RunOptions::default()
        },
        interrupted: false,
        timelines: vec![],
        boards: vec![],
    };
    let samples = run_rounds(&caps, s.repeat, |round, b| runs.run_cap(&s, round, b))?;
    write_sweep(&s, &caps, &samples, runs)?;
    made.keep();
    Ok(())
}

/// Whether this sweep is one of policies (or precisions) rather than of bucket caps; one policy
/// with several caps is the caps' sweep under that policy, which becomes the run's.
fn sweeps_policies(s: &mut SweepArgs) -> Result<bool> {
    if s.policy.is_empty() {
        s.run.resolve_policy(None)?;
    }
    if let [entry] = &s.policy[..] {
        if s.run.fixed_caps()?.len() > 1 {
            let entry = entry.clone();
            s.run.resolve_policy(Some(&entry))?;
            s.policy.clear();
        }
    }
    Ok(!s.policy.is_empty() || !s.precisions.is_empty())
}

/// The options a sweep of bucket caps needs, each checked before any run.
fn check_caps_sweep(s: &SweepArgs, caps: &[f64]) -> Result<()> {
    s.run.validate()?;
    if s.run.recipe.steps < 2 {
        return Err(Error::Usage(
            "a sweep needs --steps >= 2 (the last step is the one recorded)".into(),
        ));
    }
    if s.repeat == 0 || s.repeat > MAX_REPEAT {
        return Err(Error::Usage(format!(
            "--repeat must be between 1 and {MAX_REPEAT} (runs of each cap), got {}",
            s.repeat
        )));
    }
    if let Some(b) = crate::args::listed_twice(caps) {
        return Err(Error::Usage(format!(
            "--bucket-mb lists {b} twice: each bucket cap is one row and one timeline"
        )));
    }
    Ok(())
}

/// What the runs of a caps' sweep leave beside their samples.
struct CapRuns {
    /// The options of every run: the observer that stops on a signal, nothing printed.
    quiet: RunOptions,
    /// Whether a signal stopped a run.
    interrupted: bool,
    /// The last round's timelines (file name, timeline, title), written once every run has
    /// succeeded.
    timelines: Vec<(String, brigade::fit::StepTimeline, String)>,
    /// --tensorboard: each measured run's directory, by cap.
    boards: Vec<(f64, Arc<TensorBoard>)>,
}

impl CapRuns {
    /// One round of cap `b`: the compute-only baseline right before the recorded DDP run (this
    /// machine's speed drifts over minutes, and the comparison must not); `None` when a signal
    /// stopped either.
    fn run_cap(&mut self, s: &SweepArgs, round: usize, b: f64) -> Result<Option<Sample>> {
        let mut a = s.run.clone();
        a.distributed.bucket_mb = vec![BucketCap::Mib(b)];
        a.distributed.first_bucket_mb = a.first_bucket_cap(b);
        let compute_only = finished(run(
            &a,
            &RunOptions {
                compute_only: true,
                ..self.quiet.clone()
            },
        )?)?;
        if compute_only.outcome.interrupted {
            self.interrupted = true;
            return Ok(None);
        }
        let compute_ms = median_step(&a, &compute_only.outcome.ms());
        let board = self.board(s, round, b);
        let observer: Arc<dyn TrainObserver> = Arc::new((self.quiet.observer.clone(), board));
        let mut report = finished(run(
            &a,
            &RunOptions {
                record: true,
                profile: true,
                observer: Some(observer),
                ..self.quiet.clone()
            },
        )?)?;
        if report.outcome.interrupted {
            self.interrupted = true;
            return Ok(None);
        }
        let tl = report.timeline.take().expect("recording was on and steps ran");
        let buckets = bucket_times(&tl.events);
        let sample = Sample {
            buckets: report.outcome.buckets.len(),
            step_ms: median_step(&a, &report.outcome.ms()),
            compute_only_ms: compute_ms,
            // a fold from +0: an empty sum of floats is -0, printed `-0.00`
            comm_ms: buckets.iter().fold(0.0, |sum, (_, d)| sum + d),
            last_bucket_ms: buckets.last().map(|(_, d)| *d).unwrap_or(0.0),
            profile: report.outcome.profile.clone(),
        };
        if round + 1 == s.repeat {
            let title = format!(
                "{} world {} bucket {b} MiB: step {:.1} ms, compute-only {:.1} ms",
                flag_name(&a.model.model),
                a.distributed.world_size,
                sample.step_ms,
                compute_ms
            );
            self.timelines.push((format!("timeline_{b}MiB.json"), tl, title));
        }
        Ok(Some(sample))
    }

    /// --tensorboard: the directory of cap `b`'s measured run in this round (kept in `boards`).
    fn board(&mut self, s: &SweepArgs, round: usize, b: f64) -> Option<Arc<TensorBoard>> {
        let dir = s.tensorboard.as_ref()?;
        let cap = crate::tensorboard::run_dir(dir, &format!("bucket_{b}MiB"));
        let at = match s.repeat {
            1 => cap,
            _ => cap.join(format!("round_{}", round + 1)),
        };
        let tb = Arc::new(TensorBoard::new(at));
        self.boards.push((b, tb.clone()));
        Some(tb)
    }
}

/// The sweep's rows from its samples, written to --out (CSV, chart, timelines) and stdout;
/// an error when a signal stopped it (after what finished is written).
fn write_sweep(s: &SweepArgs, caps: &[f64], samples: &[Vec<Sample>], mut runs: CapRuns) -> Result<()> {
    let finished_runs: usize = samples.iter().map(Vec::len).sum();
    let stopped = || Error::SweepInterrupted {
        runs: finished_runs,
        of: caps.len() * s.repeat,
    };
    if runs.interrupted && finished_runs == 0 {
        return Err(stopped());
    }
    let rows = sweep_rows(s, caps, samples);
    if let Some(dir) = &s.tensorboard {
        predictions(dir, &rows, &mut runs.boards, s.repeat, s.run.recipe.steps);
    }
    let mut written = vec!["sweep.csv".to_string(), "sweep.svg".to_string()];
    for (name, tl, title) in &runs.timelines {
        write_timeline(&s.out.join(name), &tl.events, tl.origin, title)?;
        written.push(name.clone());
        written.push(name.replace(".json", ".svg"));
    }
    let csv = to_csv(&rows);
    write_atomic(&s.out.join("sweep.csv"), csv.as_bytes())?;
    draw_chart(&s.out.join("sweep.svg"), &rows, &s.run)?;
    remove_stale(&s.out, &written)?;
    if s.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| Error::json("the sweep's rows", e))?
        );
    } else {
        print_table(&rows);
        outln!("wrote {}", s.out.join("sweep.csv").display());
    }
    crate::tensorboard::with_failures(Ok(()), runs.boards.iter().map(|(_, tb)| &**tb))?;
    if runs.interrupted {
        return Err(stopped());
    }
    Ok(())
}

/// One row per cap that finished a run (an interrupted sweep's others have none), with the
/// overlap model's figures.
fn sweep_rows(s: &SweepArgs, caps: &[f64], samples: &[Vec<Sample>]) -> Vec<SweepRow> {
    let link = s.run.distributed.link();
    let profiles: Vec<&StepProfile> = samples.iter().flatten().filter_map(|x| x.profile.as_ref()).collect();
    // the backend's launch overhead is the machine's, not a cap's: fitted once from every
    // profile (small caps measure it during backward, large ones after)
    let overhead = LaunchOverhead::fit(&profiles);
    caps.iter()
        .zip(samples)
        .filter(|(_, runs)| !runs.is_empty())
        .map(|(&b, runs)| summarize(b, s.run.distributed.first_bucket_mb, runs, &profiles, overhead, link))
        .collect()
}

/// The overlap model's predicted step of each cap, as `predicted/step_ms` at the runs' last
/// step, in the cap's directory of `dir` (the run's own without --repeat; with it, the
/// directory above its rounds, added to `boards`).
fn predictions(
    dir: &std::path::Path,
    rows: &[SweepRow],
    boards: &mut Vec<(f64, Arc<TensorBoard>)>,
    repeat: usize,
    steps: usize,
) {
    for r in rows {
        let Some(ms) = r.predicted_step_ms else { continue };
        let tb = match boards.iter().find(|(b, _)| *b == r.bucket_mb) {
            Some((_, tb)) if repeat == 1 => tb.clone(),
            _ => {
                let tb = Arc::new(TensorBoard::new(crate::tensorboard::run_dir(
                    dir,
                    &format!("bucket_{}MiB", r.bucket_mb),
                )));
                boards.push((r.bucket_mb, tb.clone()));
                tb
            }
        };
        tb.add_scalars(steps.saturating_sub(1) as u64, &[(PREDICTED_STEP_MS, ms as f32)]);
    }
}

/// The table on stdout: measured medians (± spread over the rounds) beside the model's
/// prediction and the cap's lower bound, then the best cap measured and predicted.
fn print_table(rows: &[SweepRow]) {
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
    outln!(
        "{:>10} {:>4} {:>7} {:>16} {:>10} {:>8} {:>16} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6}  verdict",
        "bucket_MiB",
        "runs",
        "buckets",
        "step_ms(spread)",
        "compute",
        "comm",
        "exposed(spread)",
        "waited",
        "pred_wait",
        "pred_step",
        "pred_exp",
        "bound",
        "hidden"
    );
    for r in rows {
        outln!(
            "{:>10} {:>4} {:>7} {:>16} {:>10.2} {:>8.2} {:>16} {:>9} {:>9} {:>9} {:>9} {:>9} {:>5.0}%  {}",
            r.bucket_mb,
            r.runs,
            r.buckets,
            format!("{:.2} ({:.2})", r.step_ms, r.step_spread_ms),
            r.compute_only_ms,
            r.comm_ms,
            format!("{:.2} ({:.2})", r.exposed_comm_ms, r.exposed_spread_ms),
            opt(r.waited_ms),
            opt(r.predicted_wait_ms),
            opt(r.predicted_step_ms),
            opt(r.predicted_exposed_ms),
            opt(r.lower_bound_ms),
            100.0 * r.hidden_share,
            r.verdict
        );
    }
    let best = |f: fn(&SweepRow) -> Option<f64>| {
        rows.iter()
            .filter_map(|r| Some((r.bucket_mb, f(r)?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    };
    if let Some((cap, ms)) = best(|r| Some(r.step_ms)) {
        out!("fastest measured: {cap} MiB ({ms:.2} ms median)");
        if let Some((pcap, pms)) = best(|r| r.predicted_step_ms) {
            out!("; fastest predicted: {pcap} MiB ({pms:.2} ms)");
        }
        outln!();
    }
}

/// A measured curve: its legend, colour and value per row.
type MeasuredCurve = (&'static str, RGBColor, fn(&SweepRow) -> f64);

/// A curve of the model's: its legend, colour and value per row.
type PredictedCurve = (&'static str, RGBColor, fn(&SweepRow) -> Option<f64>);

/// Step time, compute-only time and exposed comm against bucket size (log x axis, one
/// label at every bucket cap), written atomically.
fn draw_chart(path: &std::path::Path, rows: &[SweepRow], a: &RunArgs) -> Result<()> {
    let mut svg = String::new();
    render_chart(&mut svg, path, rows, a)?;
    write_atomic(path, svg.as_bytes())
}

/// The top of the chart's y axis: the tallest measured or predicted point, with headroom.
fn y_top(rows: &[SweepRow]) -> f64 {
    rows.iter()
        .map(|r| r.step_ms.max(r.comm_ms).max(r.predicted_step_ms.unwrap_or(0.0)))
        .fold(0.0, f64::max)
        * 1.15
        + 1e-3
}

/// The chart's caption: the model and the simulated world it ran in.
fn chart_caption(a: &RunArgs) -> String {
    format!(
        "{}, world size {}, {} rows/rank, net {} Gb/s, {} us",
        flag_name(&a.model.model),
        a.distributed.world_size,
        a.rows_per_rank(),
        a.distributed
            .net_gbps
            .map(|g| g.to_string())
            .unwrap_or_else(|| "unlimited".into()),
        a.distributed.net_latency_us
    )
}

fn render_chart(svg: &mut String, path: &std::path::Path, rows: &[SweepRow], a: &RunArgs) -> Result<()> {
    let err = |m: String| Error::Chart {
        path: path.display().to_string(),
        msg: m,
    };
    let xs: Vec<f64> = rows.iter().map(|r| r.bucket_mb).collect();
    let (xmin, xmax) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(0.0, f64::max),
    );
    let ymax = y_top(rows);
    let root = SVGBackend::with_string(svg, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(chart_caption(a), ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (xmin / 1.5..xmax * 1.5).log_scale().with_key_points(xs.clone()),
            0.0..ymax,
        )
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("bucket cap (MiB, log scale)")
        .x_label_formatter(&|x| compact(*x))
        .y_desc("ms per step")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    let series: [MeasuredCurve; 4] = [
        ("step time", RGBColor(52, 152, 219), |r| r.step_ms),
        ("compute only", RGBColor(39, 174, 96), |r| r.compute_only_ms),
        ("exposed comm", RGBColor(231, 76, 60), |r| r.exposed_comm_ms),
        ("total comm", RGBColor(230, 126, 34), |r| r.comm_ms),
    ];
    for (name, color, f) in series {
        let pts: Vec<(f64, f64)> = rows.iter().map(|r| (r.bucket_mb, f(r))).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(e.to_string()))?;
    }
    // the model's curves beside the measured ones (thin, in the colours of their measured kin)
    let predicted: [PredictedCurve; 3] = [
        ("predicted step", RGBColor(52, 152, 219), |r| r.predicted_step_ms),
        ("predicted exposed", RGBColor(231, 76, 60), |r| r.predicted_exposed_ms),
        ("lower bound (exposed)", RGBColor(120, 120, 120), |r| r.lower_bound_ms),
    ];
    for (name, color, f) in predicted {
        let pts: Vec<(f64, f64)> = rows.iter().filter_map(|r| Some((r.bucket_mb, f(r)?))).collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(DashedLineSeries::new(pts.clone(), 6, 4, color.stroke_width(1)))
            .map_err(|e| err(e.to_string()))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1)));
        chart
            .draw_series(pts.into_iter().map(|p| Cross::new(p, 4, color.stroke_width(1))))
            .map_err(|e| err(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use brigade_comm::{EventKind, Recorder, TraceEvent};

    use super::bucket_times;

    #[test]
    fn bucket_times_take_the_reducers_buckets_by_kind_not_by_tag() {
        let rec = Recorder::new();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let comm = |rank: usize, tag: &str, bucket: Option<usize>, start: u64, end: u64| {
            let id = rec.comm_issued(rank, "all_reduce", tag, 64, bucket);
            rec.comm_started(id, ms(start));
            rec.comm_finished(id, ms(end), None);
        };
        // Bucket 1 launches after bucket 0 and is tagged unlike "bucketN"; rank 1 joins bucket 0 late.
        comm(0, "grads/1", Some(1), 10, 14);
        comm(1, "grads/1", Some(1), 10, 14);
        comm(0, "bucket0", Some(0), 0, 5);
        comm(1, "bucket0", Some(0), 2, 5);
        // Tagged like a bucket but no bucket: not counted.
        comm(0, "bucket7", None, 20, 40);
        comm(1, "bucket7", None, 20, 40);
        rec.compute_span(0, EventKind::span("bucket3"), ms(0), ms(50));
        let events: Vec<TraceEvent> = rec.events();
        let times = bucket_times(&events);
        assert_eq!(times.iter().map(|(b, _)| *b).collect::<Vec<_>>(), [0, 1]);
        assert!(
            (times[0].1 - 3.0).abs() < 1e-6,
            "from the last rank's start (2 ms) to rank 0's end (5 ms): {times:?}"
        );
        assert!((times[1].1 - 4.0).abs() < 1e-6, "{times:?}");
    }
}
