//! `brigade study --policy allreduce,fp16,powersgd:4 --world-size 8 --net-gbps 1 --target-loss
//! 0.5,0.3 --out DIR`: which reducer policy reaches a target loss soonest at a target scale.
//! Every policy trains at --world-size on thread ranks (the same data, seed and initial
//! weights; real losses), its steps after the first two are profiled, and the overlap model
//! predicts its step on each link (the run's --net-gbps, and --predict-gbps at
//! --predict-latency-us; without --net-gbps the runs train on the machine's own link) and at
//! --predict-world-sizes ([`brigade::study`]). Prints, per policy and link, the steps and
//! predicted seconds to each target (steps measured at --world-size, which the table names; at
//! the other world sizes the step alone), the bytes sent per step and the prediction's error
//! band on its own profiles; writes `study.csv` (loss against predicted wall-clock time, one row per
//! policy, link and step), `study_summary.csv` (the table) and `study.svg` (the loss curves);
//! with --tensorboard, each policy's run as TensorBoard event files. Every output is checked
//! before the first policy trains.
//!
//! A policy whose loss or update stops being finite keeps its row, marked diverged at that step
//! (it reaches no target), and gets a note on stderr; the study exits 0 while one policy ran
//! every step, and with one error line when every policy diverged. SIGINT or SIGTERM stops the
//! policy in progress at a step boundary: --out gets the policies that finished before it, and
//! the study exits 130 ([`crate::signal`]). A policy that fails while it trains (a collective
//! that times out) stops the study there: --out gets the policies that finished before it, the
//! later ones do not run, and the error names the policy (exit 1). Every policy is built for no
//! step before the first trains, so one that cannot run on the model fails before any trained.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use brigade::launch::net_model;
use brigade::policies::PolicySpec;
use brigade::study::{PolicyStudy, StudyConfig};
use clap::Args;
use plotters::prelude::*;

use crate::args::{listed_once, RunArgs};
use crate::commands::predict::MAX_WORLD;
use crate::commands::sweep_args::make_out_dir;
use crate::error::{Error, Result};
use crate::outputs::{check_outputs, write_atomic, MadeDirs, Output};
use crate::policy::{parse_entry, registry, resolve};
use crate::report::stdout::outln;
use crate::run::{into_library, launch_config, setup, train_config, LateHeldOut, RunOptions};
use crate::signal::StopOnSignal;

/// The files a study writes in --out.
pub const STUDY_OUTPUTS: [&str; 3] = ["study.csv", "study_summary.csv", "study.svg"];

/// `brigade study`'s flags: the run's (as `train`'s), the policies, the targets and where to
/// predict.
#[derive(Args)]
pub struct StudyArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// The reducer policies to compare, as a comma-separated list of the specs of `train
    /// --policy` (user policies registered with the program included).
    #[arg(long, value_delimiter = ',', value_parser = parse_entry, required = true)]
    pub policy: Vec<String>,
    /// The target losses, comma-separated: the steps and predicted seconds until each policy's
    /// loss first is at most each. Each is 0 or more: the command line's models train on
    /// cross-entropy, which is never negative (the library's `brigade::study` takes any finite
    /// target, for a model whose loss can be).
    #[arg(long, value_delimiter = ',', required = true, value_parser = target_loss)]
    pub target_loss: Vec<f64>,
    /// More links to predict for, in Gb/s (comma-separated; the latency of --predict-latency-us,
    /// else --net-latency-us), beside the run's --net-gbps. Without --net-gbps the policies
    /// train on the machine's own link and are predicted on these alone.
    #[arg(long, value_delimiter = ',')]
    pub predict_gbps: Vec<f64>,
    /// The latency per message of each --predict-gbps link, in µs (comma-separated: one for
    /// all, or one per link; default --net-latency-us).
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    pub predict_latency_us: Vec<f64>,
    /// World sizes to predict each policy's step at beside --world-size (comma-separated,
    /// each once, --world-size itself refused: it is predicted already), from the same profiles.
    #[arg(long, value_delimiter = ',')]
    pub predict_world_sizes: Vec<usize>,
    /// Directory for study.csv, study_summary.csv and study.svg (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write TensorBoard event files of every policy's run (as `train --tensorboard` does),
    /// one directory each in DIR named by the policy's spec, so that `tensorboard --logdir
    /// DIR` draws one curve per policy: every step's train/ scalars, and at every step the
    /// predicted step on each link at --world-size (`predicted/step_ms_{G}gbps_{L}us`).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
}

/// Runs `brigade study`.
pub fn study(s: StudyArgs) -> Result<()> {
    // first: a signal from here on stops the study (at once while its first policy starts)
    let stop_on_signal = StopOnSignal::install();
    let a = &s.run;
    let specs = s
        .policy
        .iter()
        .map(|e| resolve(e, a.distributed.powersgd_rank, a.distributed.powersgd_start_iter))
        .collect::<Result<Vec<_>>>()?;
    let sc = check_flags(&s, &specs)?;
    // a signal stops the policy in progress at a step boundary; that run is dropped, and --out
    // gets the policies that finished
    let opts = RunOptions {
        observer: Some(Arc::new(stop_on_signal)),
        ..RunOptions::default()
    };
    let late = Arc::new(LateHeldOut::default());
    let cfg = train_config(a, &opts, &late)?;
    let kind = a.model.kind();
    let names: Vec<String> = specs.iter().map(|p| p.to_string()).collect();
    // --out (and its parents) made here are removed again when the study is refused or ends
    // with nothing written
    let made = MadeDirs::missing([s.out.as_path()]);
    // the library's own checks of the request last, so that --tensorboard's directories are
    // removed again when it refuses
    check_study_outputs(&s, &names, || Ok(brigade::study::check(&cfg, &names, &sc)?))?;
    let studied = brigade::study::study(
        &launch_config(a, &opts),
        &cfg,
        registry(),
        &names,
        &sc,
        |world| setup(a, &opts, &kind, world, &late).map_err(into_library),
        |_ctx| Ok(kind.build(a.model.seed)?),
    );
    // a policy that failed while it trained: the policies before it are written, then its error
    let (results, failed) = finished_policies(studied?, &names);
    let interrupted = failed.is_none() && results.len() < names.len();
    if results.is_empty() {
        if let Some(failed) = failed {
            return Err(failed);
        }
        return Err(Error::StudyInterrupted {
            policies: 0,
            of: names.len(),
        });
    }
    write_results(&s, &results)?;
    made.keep();
    let tensorboard = tensorboard_failures(s.tensorboard.as_deref(), &results);
    if let Some(failed) = failed {
        if let Err(e) = tensorboard {
            eprintln!("error: {e}");
        }
        return Err(failed);
    }
    tensorboard?;
    if interrupted {
        return Err(Error::StudyInterrupted {
            policies: results.len(),
            of: names.len(),
        });
    }
    if results.iter().all(|r| r.diverged_at.is_some()) {
        // the advice of a policy with an outer optimizer names its outer lr too
        let advice = specs
            .iter()
            .map(crate::error::lower_lr_advice)
            .max_by_key(String::len)
            .unwrap_or_default();
        return Err(Error::Usage(format!(
            "every policy diverged, so none reached a target (each has a note above): {advice}"
        )));
    }
    Ok(())
}

/// The policies a study of `names` finished, and the error that stopped it early (a policy that
/// failed while it trained, in the flags' terms, naming the policies after it that did not run).
fn finished_policies(studied: brigade::study::Studied, names: &[String]) -> (Vec<PolicyStudy>, Option<Error>) {
    let failed = studied.stopped.map(|e| match e {
        brigade::Error::StudyPolicyFailed {
            policy,
            finished,
            source,
        } => Error::StudyPolicyFailed {
            not_run: names.iter().skip_while(|n| **n != policy).skip(1).cloned().collect(),
            policy,
            source,
            finished,
            of: names.len(),
        },
        e => e.into(),
    });
    (studied.policies, failed)
}

/// Writes `--out`'s files of the finished policies and prints the table (or the JSON) with its
/// notes, and each diverged policy's note.
fn write_results(s: &StudyArgs, results: &[PolicyStudy]) -> Result<()> {
    let a = &s.run;
    write_atomic(&s.out.join(STUDY_OUTPUTS[0]), curves_csv(results).as_bytes())?;
    write_atomic(&s.out.join(STUDY_OUTPUTS[1]), summary_csv(results).as_bytes())?;
    draw_chart(&s.out.join(STUDY_OUTPUTS[2]), results)?;
    if s.json {
        let text = serde_json::to_string_pretty(results).map_err(|e| Error::json("the study", e))?;
        outln!("{text}");
    } else {
        print_table(results);
        if a.distributed.net_gbps.is_none() {
            outln!(
                "note: measured_step_ms is each policy's step on this machine's own link (the study has no \
                 --net-gbps), the same on every row; predicted_step_ms is the step on the row's link"
            );
        }
        if (a.data.val_fraction.is_some() || a.recipe.eval_every.is_some()) && s.tensorboard.is_none() {
            outln!(
                "note: the validation loss (--val-fraction, --eval-every) is in none of the study's files: \
                 --tensorboard DIR writes it (train/val_loss)"
            );
        }
        outln!("wrote {}", s.out.join(STUDY_OUTPUTS[1]).display());
    }
    for r in results {
        if let Some(step) = r.diverged_at {
            eprintln!(
                "note: {}: diverged at step {step} (its loss or update was not finite): the steps before are kept, and it reaches no target",
                r.policy
            );
        }
    }
    Ok(())
}

/// Checks every flag before any policy trains (each under every policy of the list), and
/// returns the study's configuration: the links, the other world sizes and the targets.
fn check_flags(s: &StudyArgs, specs: &[PolicySpec]) -> Result<StudyConfig> {
    let a = &s.run;
    // one policy twice would be one run twice, its TensorBoard events in one directory
    listed_once("--policy", specs, "each policy is one run")?;
    listed_once("--target-loss", &s.target_loss, "give each once")?;
    listed_once("--predict-world-sizes", &s.predict_world_sizes, "give each once")?;
    if let Some(n) = s.predict_world_sizes.iter().find(|n| !(1..=MAX_WORLD).contains(*n)) {
        return Err(Error::Usage(format!(
            "--predict-world-sizes must each be between 1 and {MAX_WORLD}, got {n}"
        )));
    }
    // the trained world is predicted on every link already: listed again it would be one
    // prediction twice, as a repeated link would
    let trained = a.distributed.world_size;
    if s.predict_world_sizes.contains(&trained) {
        return Err(Error::Usage(format!(
            "--predict-world-sizes {trained} is the world the study trains at (--world-size {trained}), predicted \
             already: give the other world sizes"
        )));
    }
    a.check_no_policy_alias()?;
    // every flag is checked under each policy of the list, not the run's own (`train --policy`);
    // one wrong under any policy is the run's, said without naming a policy
    a.check_settings_flags(specs, true)?;
    a.validate_run()?;
    for spec in specs {
        a.validate_for(spec)
            .map_err(|e| Error::Usage(format!("--policy {spec}: {e}")))?;
    }
    let links = links(s)?;
    if links.is_empty() {
        return Err(Error::Usage(
            "say which link to predict for: --net-gbps G (the run's link) or --predict-gbps LIST".into(),
        ));
    }
    Ok(StudyConfig {
        links,
        other_worlds: s.predict_world_sizes.clone(),
        targets: s.target_loss.clone(),
        tensorboard: s.tensorboard.clone(),
        ..StudyConfig::new(vec![], vec![])
    })
}

/// Checks the study's outputs before any policy trains: --out's files, and --tensorboard's
/// directory and its run directory per policy (`policies`, their specs), none of them one of
/// --out's files; then `then` (the checks that follow). Creates --out and --tensorboard when
/// missing, and removes the --tensorboard directories it made when a check after them fails
/// ([`crate::tensorboard::prepare_then`]).
fn check_study_outputs(s: &StudyArgs, policies: &[String], then: impl FnOnce() -> Result<()>) -> Result<()> {
    if let Some(dir) = &s.tensorboard {
        let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let tb = absolute(dir);
        if let Some(f) = STUDY_OUTPUTS.iter().find(|f| tb.starts_with(absolute(&s.out.join(f)))) {
            return Err(Error::Usage(format!(
                "--tensorboard {} is --out's {f}: give the event files a directory of their own",
                dir.display()
            )));
        }
    }
    make_out_dir(&s.out, &STUDY_OUTPUTS, "study")?;
    let Some(dir) = &s.tensorboard else { return then() };
    let outputs: Vec<Output> = STUDY_OUTPUTS
        .iter()
        .map(|f| Output::new("--out", &s.out.join(f)))
        .collect();
    crate::tensorboard::prepare_then(dir, &outputs, || {
        for p in policies {
            let run = crate::tensorboard::run_dir(dir, p);
            if run.exists() && !run.is_dir() {
                return Err(Error::Usage(format!(
                    "--tensorboard {}: {} (the policy {p}'s run directory) is not a directory: move it or pick another --tensorboard",
                    dir.display(),
                    run.display()
                )));
            }
            if run.is_dir() {
                check_outputs(&[Output::new("--tensorboard", &run.join("events.out.tfevents"))])?;
            } else {
                // made and removed: a name the file system refuses (too long) fails here, not
                // after every policy trained
                std::fs::create_dir(&run)
                    .and_then(|()| std::fs::remove_dir(&run))
                    .map_err(|e| {
                        Error::Usage(format!(
                            "--tensorboard {}: the policy {p}'s run directory {} cannot be made: {e}",
                            dir.display(),
                            run.display()
                        ))
                    })?;
            }
        }
        then()
    })
}

/// The TensorBoard writes that failed (the study went on, and its other outputs are written),
/// one line each, named by --tensorboard and the policy.
fn tensorboard_failures(dir: Option<&Path>, results: &[PolicyStudy]) -> Result<()> {
    let Some(dir) = dir else { return Ok(()) };
    let failures: Vec<String> = results
        .iter()
        .filter_map(|r| {
            let e = r.tensorboard_failure.as_ref()?;
            Some(format!("--tensorboard {} ({}): {e}", dir.display(), r.policy))
        })
        .collect();
    match failures.is_empty() {
        true => Ok(()),
        false => Err(Error::Outputs(failures)),
    }
}

/// The links to predict for: the run's (--net-gbps at --net-latency-us), then each of
/// --predict-gbps at its --predict-latency-us.
fn links(s: &StudyArgs) -> Result<Vec<brigade::comm::NetModel>> {
    let own = s.run.distributed.net_latency_us;
    let latencies = &s.predict_latency_us;
    if !latencies.is_empty() && s.predict_gbps.is_empty() {
        return Err(Error::Usage(
            "--predict-latency-us is the latency of the --predict-gbps links: give --predict-gbps too".into(),
        ));
    }
    if !(latencies.len() <= 1 || latencies.len() == s.predict_gbps.len()) {
        return Err(Error::Usage(format!(
            "--predict-latency-us gives {} latencies for {} --predict-gbps links: give one for all, or one per link",
            latencies.len(),
            s.predict_gbps.len()
        )));
    }
    let run = (s.run.distributed.net_gbps).map(|g| (("--net-gbps", g), ("--net-latency-us", own)));
    let predicted = s.predict_gbps.iter().enumerate().map(|(i, &g)| {
        let us = match latencies.len() {
            0 => ("--net-latency-us", own),
            1 => ("--predict-latency-us", latencies[0]),
            _ => ("--predict-latency-us", latencies[i]),
        };
        (("--predict-gbps", g), us)
    });
    let links: Vec<_> = run.into_iter().chain(predicted).collect();
    for ((gbps_flag, g), us) in &links {
        crate::args::check_link_of((gbps_flag, Some(*g)), *us)?;
    }
    // one link twice would be one prediction twice, in every table and chart
    let values: Vec<(f64, f64)> = links.iter().map(|((_, g), (_, us))| (*g, *us)).collect();
    if let Some((first, again)) = brigade::study::repeated(&values) {
        let ((flag, g), (_, us)) = links[again - 1];
        let ((earlier, _), _) = links[first - 1];
        return Err(Error::Usage(match earlier == flag {
            true => format!("{flag} lists the link {g} Gb/s at {us} µs twice: give each link once"),
            false => format!("{flag} {g} at {us} µs repeats the link of {earlier}: give each link once"),
        }));
    }
    Ok(values.into_iter().map(|(g, us)| net_model(g, us)).collect())
}

/// One `--target-loss` entry: a finite number of 0 or more (clap's value parser; the message is the
/// rest of clap's line).
fn target_loss(s: &str) -> std::result::Result<f64, String> {
    let t: f64 = s.trim().parse().map_err(|_| "not a number".to_string())?;
    if !t.is_finite() {
        return Err("a target loss must be a finite number".into());
    }
    if t < 0.0 {
        return Err(
            "a loss of the command line's models (cross-entropy) is never negative, so no run reaches it: give targets of 0 or more"
                .into(),
        );
    }
    Ok(t)
}

/// How a summary cell prints a time: for the CSV every digit (Rust's shortest round-trip
/// form), for the table three decimals, or as many as show three significant digits of a
/// smaller value (a predicted step or time to target under a millisecond).
#[derive(Clone, Copy)]
enum Digits {
    Full,
    Table,
}

impl Digits {
    fn time(self, v: f64) -> String {
        match self {
            Digits::Full => format!("{v}"),
            Digits::Table => significant(v),
        }
    }
}

/// `v` with three decimals, or with three significant digits where that needs more (down to
/// 1e-9, then in exponent form).
fn significant(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v:.3}");
    }
    let magnitude = v.abs().log10().floor() as i32;
    if magnitude < -9 {
        return format!("{v:.2e}");
    }
    let decimals = (2 - magnitude).max(3) as usize;
    format!("{v:.decimals$}")
}

/// `x` as `digits` prints a time, or `-` when absent.
fn or_dash(x: Option<f64>, digits: Digits) -> String {
    x.map_or("-".into(), |v| digits.time(v))
}

/// The summary rows: one per policy and prediction (world, link), times printed as `digits` says.
fn summary_rows(results: &[PolicyStudy], digits: Digits) -> Vec<Vec<String>> {
    let targets = summary_targets(results).len();
    let mut rows = vec![];
    for r in results {
        let band = r
            .own_band
            .map(|b| format!("{:+.1}%..{:+.1}%", 100.0 * b.low, 100.0 * b.high));
        for p in &r.predictions {
            // measured at the trained world only: empty at the others
            let trained = p.world_size == r.world_size;
            let measured = |x: String| if trained { x } else { "-".into() };
            let mut row = vec![
                r.policy.clone(),
                p.world_size.to_string(),
                r.world_size.to_string(),
                format!("{}", p.net_gbps),
                format!("{}", p.net_latency_us),
                or_dash(p.step_s.map(|s| 1e3 * s), digits),
                measured(or_dash(r.measured_step_s.map(|s| 1e3 * s), digits)),
                measured(band.clone().unwrap_or_else(|| "-".into())),
                measured(format!("{:.0}", r.wire_bytes_per_step)),
                measured(format!("{:.0}", r.payload_bytes_per_step)),
            ];
            // steps to a target are the trained world's: at another world only the step
            for k in 0..targets {
                let t = p.reached.get(k);
                row.push(t.and_then(|t| t.steps).map_or("-".into(), |n| n.to_string()));
                row.push(or_dash(t.and_then(|t| t.seconds), digits));
            }
            row.push(measured(r.diverged_at.map_or("-".into(), |n| n.to_string())));
            rows.push(row);
        }
    }
    rows
}

/// The target losses (those of the trained world's first prediction).
fn summary_targets(results: &[PolicyStudy]) -> Vec<f64> {
    results
        .first()
        .and_then(|r| r.predictions.first())
        .map(|p| p.reached.iter().map(|t| t.target).collect())
        .unwrap_or_default()
}

/// The summary table's header, with two columns per target. `world_size` is the prediction's,
/// `steps_at_world_size` the world the policy trained at, whose losses give the steps to each
/// target (empty at the other worlds: only their step is predicted, and the measured step,
/// its band and the bytes sent are the trained world's, empty there too); `diverged_at_step`
/// last, the step where the policy's run diverged (`-`: it ran every step).
fn summary_header(results: &[PolicyStudy]) -> Vec<String> {
    let mut h: Vec<String> = [
        "policy",
        "world_size",
        "steps_at_world_size",
        "net_gbps",
        "net_latency_us",
        "predicted_step_ms",
        "measured_step_ms",
        "own_band",
        "wire_bytes_per_step",
        "payload_bytes_per_step",
    ]
    .map(String::from)
    .to_vec();
    for t in summary_targets(results) {
        h.push(format!("steps_to_{t}"));
        h.push(format!("seconds_to_{t}"));
    }
    h.push("diverged_at_step".into());
    h
}

fn summary_csv(results: &[PolicyStudy]) -> String {
    let mut out = summary_header(results).join(",") + "\n";
    for row in summary_rows(results, Digits::Full) {
        out += &(row.join(",") + "\n");
    }
    out
}

/// Loss against predicted wall-clock time: one row per policy, predicted link (at the trained
/// world) and step; `predicted_s` is the steps run so far (this one included) at the
/// predicted step.
fn curves_csv(results: &[PolicyStudy]) -> String {
    let mut out = String::from("policy,net_gbps,net_latency_us,step,loss,predicted_s\n");
    for r in results {
        for p in r
            .predictions
            .iter()
            .filter(|p| !p.reached.is_empty() || r.predictions.len() == 1)
        {
            for (i, loss) in r.losses.iter().enumerate() {
                out += &format!(
                    "{},{},{},{},{:.6},{}\n",
                    r.policy,
                    p.net_gbps,
                    p.net_latency_us,
                    i,
                    loss,
                    or_dash(p.step_s.map(|s| (i + 1) as f64 * s), Digits::Full)
                );
            }
        }
    }
    out
}

/// `n ranks`, or `1 rank`.
fn ranks(n: usize) -> String {
    format!("{n} rank{}", if n == 1 { "" } else { "s" })
}

fn print_table(results: &[PolicyStudy]) {
    let header = summary_header(results);
    let rows = summary_rows(results, Digits::Table);
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, String::len))
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    outln!("{}", line(&header));
    for r in &rows {
        outln!("{}", line(r));
    }
    if let Some(r) = results.first() {
        let others = r.predictions.iter().any(|p| p.world_size != r.world_size);
        outln!(
            "steps to each target: trained and measured at {}{}",
            ranks(r.world_size),
            if others {
                "; at the other world sizes the step alone is predicted"
            } else {
                ""
            }
        );
    }
    for r in results.iter().filter(|r| !r.note.is_empty()) {
        outln!("note: {}: {}", r.policy, r.note);
    }
}

/// The loss of each policy against its predicted wall-clock time on the first link at the
/// trained world, one curve per policy. Written atomically.
fn draw_chart(path: &Path, results: &[PolicyStudy]) -> Result<()> {
    let err = |m: String| Error::Chart {
        path: path.display().to_string(),
        msg: m,
    };
    let curves: Vec<(String, Vec<(f64, f64)>)> = results
        .iter()
        .filter_map(|r| {
            let step = r.predictions.first()?.step_s?;
            let pts = r
                .losses
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| ((i + 1) as f64 * step, l))
                .collect();
            Some((r.policy.clone(), pts))
        })
        .collect();
    let all = curves.iter().flat_map(|(_, c)| c.iter());
    let (xmax, ymax) = all.fold((0.0f64, 0.0f64), |(x, y), &(a, b)| (x.max(a), y.max(b)));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let link = results.first().and_then(|r| r.predictions.first());
        let caption = link.map_or(String::new(), |p| {
            format!(
                "loss against predicted time, {}, {} Gb/s, {} us",
                ranks(p.world_size),
                p.net_gbps,
                p.net_latency_us
            )
        });
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..xmax * 1.05 + 1e-9, 0.0..ymax * 1.05 + 1e-9)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc("predicted seconds")
            .y_desc("loss")
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (k, (name, pts)) in curves.into_iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    write_atomic(path, svg.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_time_keeps_three_decimals_or_three_significant_digits() {
        assert_eq!(significant(449.8894), "449.889");
        assert_eq!(significant(0.0627), "0.0627");
        assert_eq!(significant(0.000374123), "0.000374");
        assert_eq!(significant(1.5e-12), "1.50e-12");
        assert_eq!(significant(0.0), "0.000");
        assert_eq!(Digits::Full.time(0.000374123), "0.000374123");
    }

    #[test]
    fn a_target_loss_is_a_finite_number_of_zero_or_more() {
        assert_eq!(target_loss("0.3"), Ok(0.3));
        assert_eq!(target_loss("0"), Ok(0.0));
        assert!(target_loss("-1").unwrap_err().contains("never negative"));
        assert!(target_loss("nan").unwrap_err().contains("finite"));
        assert!(target_loss("x").is_err());
    }
}
