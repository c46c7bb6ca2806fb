//! `brigade train`: run a training, print a summary, write the requested files.

use std::path::PathBuf;
use std::sync::Arc;

use brigade::checkpoint_files::{stray_placeholder, PATH_FIELD};
use brigade::config::CheckpointConfig;
use brigade::observe::TrainObserver;
use brigade::tensorboard::TensorBoard;
use brigade_ddp::overlap::StepProfile;
use brigade_models::tokens::expand_glob;
use clap::Args;

use crate::args::RunArgs;
use crate::error::{checkpoint_failure, Error, Result};
use crate::outputs::{check_outputs, run_files, write_all, write_atomic, Input, Output, OutputLocks, Write};
use crate::report::loss_chart::{write_loss_chart, LossPoint};
use crate::report::progress::ProgressBar;
use crate::report::summary::{print_summary, PrintNotes};
use crate::report::timeline_svg::write_timeline;
use crate::run::{run, RunOptions, RunReport};
use crate::signal::StopOnSignal;

/// Options of `brigade train`.
#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// How DDP reduces each gradient bucket and what the optimizer steps, as one spec (default:
    /// an f32 all-reduce). A bare name whose policy takes settings takes them from their flags
    /// (--powersgd-rank, --powersgd-start-iter); not with --zero.
    #[arg(long, value_parser = crate::policy::parse_entry, conflicts_with_all = ["comm_hook_alias", "zero"])]
    pub policy: Option<String>,
    /// `auto`: choose the reducer policy, the bucket cap and activation checkpointing before
    /// training. One short profiled calibration run per policy family on this model, data and
    /// ranks (not part of the run: nothing written), then the plan under --memory-budget less
    /// the memory model's 10% accuracy (as `brigade plan` prints it), then training from step 0
    /// under the fastest configuration predicted to fit, said in one line (and in --json's `plan`). The caps weighed are
    /// --bucket-mb's list when it names two or more, else 1,5,25. Every checkpoint records the
    /// choice; --resume of one keeps it without calibrating.
    #[arg(long, value_enum)]
    pub plan: Option<crate::plan_auto::PlanMode>,
    /// Write the final parameters here (safetensors, atomically). Every output path is
    /// checked before step 0 (its directory exists and takes files; no two outputs share a
    /// file; none is a file the run reads); a symbolic link is kept and its target written.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Write `step,loss,lr,grad_norm,val_loss` for every step (global mean loss before the
    /// step's update, the step's learning rate, the global gradient norm before clipping with
    /// --clip-grad-norm, the held-out loss after the step with --eval-every; empty when not
    /// computed). With --resume, the rows before the resume step already
    /// in this file are kept (with --eval-every, their validation loss where the uninterrupted
    /// run evaluates only), so the file ends as the uninterrupted run's; a file of another run
    /// (its row before the resume step holds another loss than the checkpoint's) is refused
    /// before step 0; one that lacks
    /// some of them keeps none (a note names the missing steps), and rows past the resume step
    /// are dropped.
    #[arg(long)]
    pub losses: Option<PathBuf>,
    /// Draw the training loss, the validation loss (on the steps of --eval-every) and the
    /// learning rate against the step, as SVG. With --resume and --losses, the steps before
    /// the resume read from that file are drawn too.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write TensorBoard event files into DIR (created if missing) as the run goes, a record
    /// per step: train/loss, train/lr, train/bytes_sent (payload, as --json's
    /// sent_bytes_by_step), train/step_ms, and train/val_loss (--eval-every) and
    /// train/grad_norm (--clip-grad-norm) on the steps that compute them. View with
    /// `tensorboard --logdir DIR` (or a directory above it: one run per directory). Each run
    /// adds a new file; a run given the DIR of an earlier one replaces that run's steps from
    /// its first on (a --resume continues the curve from the checkpoint's step). A write that
    /// fails does not stop the training: the steps before it stay in the file, and the
    /// command names the failure at the end with a non-zero exit.
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Write a Chrome trace of the last step (and FILE.svg beside it); nothing when no step runs.
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Write the last step's profile (every rank's gradient-ready times, bucket launches and
    /// link times, backward and optimizer spans; JSON, schema in `brigade_ddp::overlap`), for
    /// `brigade predict`.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// With --profile: write every step of A..B (half-open: `5..8` is steps 5, 6 and 7) as a
    /// JSON list of step profiles instead of the last step alone (`brigade predict` reads both).
    #[arg(long, value_parser = parse_step_range)]
    pub profile_steps: Option<std::ops::Range<usize>>,
    /// Write parameters and optimizer state here at the end (and every --checkpoint-every
    /// steps, during the step it resumes once that step's loss is finite); also when no step
    /// runs. `{step}` in the file name becomes the step the checkpoint resumes at
    /// (`run-{step}.ckpt`), so that each is kept; without it each replaces the last. It is the
    /// one placeholder: another `{...}` (`{STEP}`, `{rank}`) is refused. Refused
    /// before step 0 when any step's name (a signal or the end of --join's data writes at
    /// other steps than the period's) is a file the run reads or another output.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Checkpoint period in steps (at least 1; needs --checkpoint).
    #[arg(long)]
    pub checkpoint_every: Option<usize>,
    /// Keep only the newest N checkpoints of this run's lineage under a --checkpoint path
    /// holding `{step}` (at least 1). A lineage starts with a run from step 0 and goes on
    /// through its resumes; newest is last written (a run resumed from an earlier checkpoint
    /// writes newer ones than the steps it abandoned). Another run's checkpoints, and any file
    /// that is not a checkpoint, stay.
    #[arg(long, value_name = "N")]
    pub keep_last: Option<usize>,
    /// Continue from a checkpoint written by --checkpoint, until --steps. The checkpoint
    /// holds the parameters (so --init is an error), the --seed and the data's fingerprint
    /// (a different seed or data is an error), and the rows a step read per rank: data read in
    /// order or under --join resumes only with a --batch-size x --accum of as many rows.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// End with the summary as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Parses `--profile-steps A..B` (half-open, A < B).
fn parse_step_range(s: &str) -> std::result::Result<std::ops::Range<usize>, String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("'{s}' is not a step range A..B (e.g. 5..8: steps 5, 6 and 7)"))?;
    let step = |v: &str| {
        v.parse::<usize>()
            .map_err(|_| format!("'{s}': '{v}' is not a step number (a range is A..B, e.g. 5..8)"))
    };
    let (a, b) = (step(a)?, step(b)?);
    if a >= b {
        return Err(format!("'{s}' holds no step (A..B runs from A up to B, B excluded)"));
    }
    Ok(a..b)
}

impl TrainArgs {
    /// Sets the run's policy from `--policy` or its older spellings ([`RunArgs::resolve_policy`]).
    pub fn take_policy(&mut self) -> Result<()> {
        let entry = self.policy.take();
        self.run.resolve_policy(entry.as_deref())
    }

    /// Checks the flags before any work: numbers, combinations, and every output path.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        self.run.validate()?;
        self.run.bucket_cap()?;
        // --untimed-steps counts the steps this run runs: after a resume, those from its step on
        let untimed = self.run.runtime.untimed_steps;
        let resumed_at = self.resume.as_deref().and_then(brigade::checkpoint::checkpoint_step);
        if let Some(at) = resumed_at.filter(|&at| untimed > 0 && at < self.run.recipe.steps) {
            let left = self.run.recipe.steps - at;
            if untimed >= left {
                return bad(format!(
                    "--untimed-steps {untimed} leaves no step to time: --resume continues from step {at}, so this run \
                     runs the {left} steps to --steps {}; give --untimed-steps below {left} or more --steps",
                    self.run.recipe.steps
                ));
            }
        }
        match (&self.profile_steps, &self.profile) {
            (Some(r), None) => {
                return bad(format!(
                    "--profile-steps {r:?} needs --profile FILE.json (where to write)"
                ))
            }
            (Some(r), Some(_)) if r.end > self.run.recipe.steps => {
                return bad(format!(
                    "--profile-steps {r:?} reaches past --steps {} (the run ends before step {})",
                    self.run.recipe.steps,
                    r.end - 1
                ))
            }
            (Some(r), Some(_)) => {
                // a resume runs from the checkpoint's step on: a step before it is not run here
                let resumed_at = self.resume.as_deref().and_then(brigade::checkpoint::checkpoint_step);
                if let Some(at) = resumed_at.filter(|&at| r.start < at) {
                    return bad(format!(
                        "--profile-steps {r:?} starts before step {at}, where --resume continues: give steps from {at} on"
                    ));
                }
            }
            _ => {}
        }
        if let Some(p) = self
            .plot
            .as_ref()
            .filter(|p| !p.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg")))
        {
            return bad(format!("--plot {} draws SVG: give a FILE.svg", p.display()));
        }
        // made before the outputs' check (an output at DIR is then a directory's), and removed
        // again when a check fails
        match &self.tensorboard {
            Some(dir) => crate::tensorboard::prepare_then(dir, &self.outputs(), || self.check_inputs_and_files()),
            None => self.check_inputs_and_files(),
        }
    }

    /// The checks of [`TrainArgs::validate`] on the files the run reads and writes.
    fn check_inputs_and_files(&self) -> Result<()> {
        if let (Some(resume), Some(init)) = (&self.resume, &self.run.model.init) {
            return Err(Error::Usage(format!(
                "--resume {} already holds the parameters; drop --init {} (or start afresh without --resume)",
                resume.display(),
                init.display()
            )));
        }
        if let (Some(resume), crate::args::ModelName::Gpt) = (&self.resume, self.run.model.model) {
            let given = self.run.model.tokenizer;
            if let Some(recorded) = crate::commands::sample::recorded_tokenizer(resume)?.filter(|&t| t != given) {
                return Err(crate::commands::sample::tokenizer_mismatch(
                    "--resume", resume, recorded, given,
                ));
            }
        }
        self.check_files()
    }

    /// Checks every file the run reads and writes before any work: every output can be
    /// written, no output lands on an input or another output, and no checkpoint the
    /// --checkpoint path may name does either.
    pub fn check_files(&self) -> Result<()> {
        self.check_checkpoint_flags()?;
        let outputs = self.outputs();
        // `{step}` is a checkpoint's (one file a step); any other output is written once, and
        // no `{...}` is a placeholder there
        for o in outputs.iter().filter(|o| o.flag != "--checkpoint") {
            let (flag, path) = (&o.flag, o.path.display());
            let once = format!("{flag} is written once, at the end");
            if o.path.to_string_lossy().contains("{step}") {
                return Err(Error::Usage(format!(
                    "{flag} {path}: {{step}} names each checkpoint's step in --checkpoint; {once}"
                )));
            }
            if let Some(token) = stray_placeholder(&o.path) {
                return Err(Error::Usage(format!(
                    "{flag} {path}: {token} is not a placeholder ({{step}}, in --checkpoint, is the one there is); {once}"
                )));
            }
        }
        check_outputs(&outputs)?;
        let inputs = self.inputs();
        crate::outputs::check_inputs_are_files(&inputs)?;
        // the checkpoints' own check is the library's, by their path's pattern
        let (checkpoints, others): (Vec<Output>, Vec<Output>) =
            outputs.into_iter().partition(|o| o.flag == "--checkpoint");
        crate::outputs::check_inputs_kept(&inputs, &others)?;
        let patterns: Vec<Input<'_>> = [
            ("--data", &self.run.data.data),
            ("--eval-data", &self.run.data.eval_data),
        ]
        .into_iter()
        .filter_map(|(flag, p)| Some(Input::new(flag, p.as_ref()?)))
        .collect();
        crate::outputs::check_patterns_kept(&patterns, &others)?;
        if !checkpoints.is_empty() {
            let inputs: Vec<Input<'_>> = inputs.iter().cloned().chain(patterns).collect();
            self.checkpoint_config().check_files(&run_files(&inputs, &others))?;
        }
        Ok(())
    }

    /// --checkpoint-every and --keep-last: at least 1, and with the --checkpoint they need.
    fn check_checkpoint_flags(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        match (self.checkpoint_every, &self.checkpoint) {
            (Some(0), _) => return bad("--checkpoint-every must be at least 1 (steps between checkpoints)".into()),
            (Some(_), None) => return bad("--checkpoint-every needs --checkpoint FILE (where to write)".into()),
            _ => {}
        }
        if let Some(p) = &self.checkpoint {
            brigade::checkpoint_files::check_placeholders(PATH_FIELD, p)
                .map_err(|e| Error::Usage(crate::error::in_flag_terms(&e)))?;
            let in_dir = p.parent().is_some_and(|d| d.to_string_lossy().contains("{step}"));
            let twice = p
                .file_name()
                .is_some_and(|n| n.to_string_lossy().matches("{step}").count() > 1);
            if in_dir || twice {
                return bad(format!(
                    "--checkpoint {}: {{step}} may appear once, in the file name (each checkpoint's step)",
                    p.display()
                ));
            }
        }
        let templated = self
            .checkpoint
            .as_ref()
            .and_then(|p| p.file_name())
            .is_some_and(|n| n.to_string_lossy().contains("{step}"));
        match (self.keep_last, templated) {
            (Some(0), _) => return bad("--keep-last must be at least 1 (checkpoints to keep)".into()),
            (Some(k), false) => {
                return bad(format!(
                    "--keep-last {k} needs {{step}} in the --checkpoint file name (e.g. run-{{step}}.ckpt): without it each checkpoint replaces the last"
                ))
            }
            _ => {}
        }
        Ok(())
    }

    /// The checkpoint part of the library's configuration, as the flags give it.
    pub fn checkpoint_config(&self) -> CheckpointConfig {
        CheckpointConfig {
            resume: self.resume.clone(),
            path: self.checkpoint.clone(),
            every: self.checkpoint_every,
            keep_last: self.keep_last,
            metadata: vec![],
        }
    }

    /// Every file this run reads, with the flag that names it: a `--data` path with `{rank}`
    /// is every rank's file (the ranks of --world-size, or of the `mpirun` job this process
    /// belongs to), and a `--data` or `--eval-data` pattern (`*`, `?`) every file it matches.
    pub fn inputs(&self) -> Vec<Input<'static>> {
        let mut inputs = vec![];
        let mut add = |flag: &'static str, path: &Option<PathBuf>, may_replace: &'static [&'static str]| {
            let Some(p) = path else { return };
            // a pattern that matches nothing is its own error, when the data is opened
            let files = match flag {
                "--data" | "--eval-data" => expand_glob(p).unwrap_or_else(|_| vec![p.clone()]),
                _ => vec![p.clone()],
            };
            for f in files {
                inputs.push(Input {
                    may_replace,
                    ..Input::new(flag, &f)
                });
            }
        };
        add("--resume", &self.resume, &["--checkpoint"]);
        add("--init", &self.run.model.init, &["--save"]);
        add("--text", &self.run.data.text, &[]);
        add("--eval-data", &self.run.data.eval_data, &[]);
        if self.run.rank_data().is_none() {
            add("--data", &self.run.data.data, &[]);
        }
        for rank in 0..launched_world_size(&self.run) {
            if let Some(p) = self.run.rank_data_path(rank) {
                inputs.push(Input {
                    whose: Some(format!("rank {rank}'s")),
                    ..Input::new("--data", &p)
                });
            }
        }
        inputs
    }

    /// Every file this run writes, with the flag that asked for it.
    pub fn outputs(&self) -> Vec<Output> {
        let mut out = vec![];
        for (flag, path) in [
            ("--save", &self.save),
            ("--losses", &self.losses),
            ("--timeline", &self.timeline),
            ("--profile", &self.profile),
            ("--plot", &self.plot),
        ] {
            if let Some(p) = path {
                out.push(Output::new(flag, p));
            }
        }
        if let Some(p) = &self.timeline {
            out.push(Output::new("--timeline (its chart)", &p.with_extension("svg")));
        }
        if let Some(p) = &self.checkpoint {
            out.push(Output::new("--checkpoint", p));
        }
        out
    }
}

/// The ranks this run will have: `mpirun`'s size under MPI (from its environment), else
/// --world-size.
fn launched_world_size(run: &RunArgs) -> usize {
    let from_mpirun = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok());
    match (run.distributed.backend, from_mpirun) {
        (brigade::launch::CommBackend::Mpi, Some(n)) => n,
        _ => run.distributed.world_size,
    }
}

/// The rows of an existing `--losses` file, by step (kept when a resumed run rewrites it);
/// `None` when there is no such file.
fn previous_losses(path: &std::path::Path) -> Result<Option<Vec<(usize, String)>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(Error::Io {
                path: path.display().to_string(),
                source,
            })
        }
    };
    let mut lines = text.lines();
    let not_ours = || {
        Error::Usage(format!(
            "--losses {}: the file exists but is not a `step,loss` file; a resumed run keeps its earlier rows, so move it away or pick another file",
            path.display()
        ))
    };
    // files written before the lr and grad_norm columns start `step,loss`
    if !lines.next().is_some_and(|h| {
        h == LOSSES_HEADER || h == LOSSES_HEADER_SCALED || h == "step,loss" || h == "step,loss,lr,grad_norm"
    }) {
        return Err(not_ours());
    }
    lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            let step = l
                .split_once(',')
                .and_then(|(s, _)| s.parse().ok())
                .ok_or_else(not_ours)?;
            Ok((step, l.to_string()))
        })
        .collect::<Result<_>>()
        .map(Some)
}

/// The rows of an existing `--losses` file at `path` that a run resumed at `first_step` keeps:
/// steps 0 to `first_step - 1`, each once and in order, rows after them dropped (another run's).
/// A file that lacks some of them (or repeats one) keeps none, so that the file has no gap,
/// and a note says which steps were missing. Under --eval-every (`evaluated`: after which steps
/// the uninterrupted run evaluates) a kept row's validation loss stays only where the
/// uninterrupted run has one: the earlier run's evaluation after its own last step goes.
fn rows_before(
    kept: Vec<(usize, String)>,
    first_step: usize,
    evaluated: Option<&dyn Fn(usize) -> bool>,
    path: &std::path::Path,
) -> Vec<(usize, String)> {
    let before: Vec<(usize, String)> = kept
        .into_iter()
        .filter(|(s, _)| *s < first_step)
        .map(|(s, row)| match evaluated {
            Some(evaluated) if !evaluated(s) => (s, without_val_loss(&row)),
            _ => (s, row),
        })
        .collect();
    if before.iter().map(|(s, _)| *s).eq(0..first_step) {
        return before;
    }
    let mut held = vec![false; first_step];
    for (s, _) in &before {
        held[*s] = true;
    }
    let mut missing = vec![];
    let mut s = 0;
    while s < first_step {
        if held[s] {
            s += 1;
            continue;
        }
        let start = s;
        while s < first_step && !held[s] {
            s += 1;
        }
        missing.push(match s - start {
            1 => format!("step {start}"),
            _ => format!("steps {start} to {}", s - 1),
        });
    }
    let what = if missing.is_empty() {
        "repeats or reorders the steps".to_string()
    } else {
        format!("holds no row for {}", missing.join(", "))
    };
    eprintln!(
        "note: --losses {} {what} before the resume at step {first_step} (another run's rows): it is written with this run's rows alone, from step {first_step}",
        path.display()
    );
    vec![]
}

/// Refuses, before step 0, a `--losses` file (its `rows`) of another run than the checkpoint
/// `resume`: its row of the step before the checkpoint's holds another loss than the checkpoint
/// records of that step. A resume rewrites the file with the rows before its step kept; another
/// run's rows would be spliced in, or that run's record lost.
fn check_rows_are_the_checkpoints(
    rows: &[(usize, String)],
    resume: &std::path::Path,
    path: &std::path::Path,
) -> Result<()> {
    let Some(meta) = brigade::checkpoint::read_metadata(resume) else {
        return Ok(());
    };
    let recorded = |k: &str| meta.get(k).and_then(|v| v.parse::<f64>().ok());
    let (Some(step), Some(loss)) = (recorded("step"), recorded(brigade::checkpoint::LAST_LOSS_KEY)) else {
        return Ok(());
    };
    let Some((s, row)) = (step as usize)
        .checked_sub(1)
        .and_then(|s| rows.iter().find(|(k, _)| *k == s))
    else {
        return Ok(());
    };
    let written = row.split(',').nth(1).unwrap_or_default();
    if written == format!("{loss:.9}") {
        return Ok(());
    }
    Err(Error::Usage(format!(
        "--losses {} holds another run's rows: its step {s} has loss {written}, the run of --resume {} had {loss:.9}; a resume rewrites the file from its rows before step {step}, so move it away or give another file",
        path.display(),
        resume.display()
    )))
}

/// A `--losses` row with its validation loss (the fifth cell) emptied.
fn without_val_loss(row: &str) -> String {
    let mut cells: Vec<&str> = row.split(',').collect();
    if let Some(v) = cells.get_mut(4) {
        *v = "";
    }
    cells.join(",")
}

/// The header of the `--losses` file.
const LOSSES_HEADER: &str = "step,loss,lr,grad_norm,val_loss";

/// The header of the `--losses` file of an fp16 run: the loss scale of each step last.
const LOSSES_HEADER_SCALED: &str = "step,loss,lr,grad_norm,val_loss,scale";

/// Runs `brigade train`.
pub fn train(mut t: TrainArgs) -> Result<()> {
    // first: a signal at any point from here on stops the run (at once while it starts)
    let stop_on_signal = StopOnSignal::install();
    // the files first: a typo costs no calibration
    t.check_files()?;
    let plan = match t.plan {
        Some(crate::plan_auto::PlanMode::Auto) => Some(crate::plan_auto::choose(
            &mut t.run,
            t.policy.is_some(),
            t.resume.as_deref(),
            Arc::new(stop_on_signal),
        )?),
        None => None,
    };
    t.take_policy()?;
    t.validate()?;
    if let (Some(p), false) = (&plan, t.json) {
        crate::report::stdout::outln!("{}", p.line());
    }
    let locks = Arc::new(OutputLocks::new(t.outputs()));
    let kept = match (&t.resume, &t.losses) {
        (Some(_), Some(path)) => previous_losses(path)?,
        _ => None,
    };
    if let (Some(rows), Some(resume), Some(path)) = (&kept, &t.resume, &t.losses) {
        check_rows_are_the_checkpoints(rows, resume, path)?;
    }
    // --tensorboard: every step's scalars, as the run goes
    let tensorboard = t.tensorboard.as_ref().map(|dir| Arc::new(TensorBoard::new(dir)));
    let opts = run_options(&t, stop_on_signal, tensorboard.clone(), plan.as_ref(), locks)?;
    let mut report = run(&t.run, &opts)?;
    let kept = kept_rows(&t, kept, report.outcome.first_step);
    // a run that diverged, or that a rank's failure stopped partway, has no model to --save
    let diverged =
        matches!(&report.outcome.stopped, Some(e) if matches!(e, brigade::Error::NonFinite { .. }) || !e.is_agreed());
    let mut written = write_outputs(&t, &report, &kept, diverged);
    let stopped = report.outcome.stopped.take();
    if let Some(failure) = report.outcome.checkpoint_error.take() {
        let failure = checkpoint_failure(&failure);
        written = match written {
            Err(Error::Outputs(mut failures)) => {
                failures.push(failure);
                Err(Error::Outputs(failures))
            }
            Err(e) => Err(Error::Outputs(vec![e.to_string(), failure])),
            Ok(()) => Err(Error::Outputs(vec![failure])),
        };
    }
    let written = crate::tensorboard::with_failures(written, tensorboard.as_deref());
    // the summary once the files are written: a stdout that fails costs nothing else
    print_summary(&t.run, t.json, report.world_size, &report.outcome, plan.as_ref());
    note_over_budget(&t, &report);
    // a diverged or failed run's finished steps are written above; then its error
    if let Some(e) = stopped {
        return Err(crate::error::under_policy(e, &t.run.hook_spec()));
    }
    written?;
    if report.outcome.interrupted {
        let step = (report.outcome.first_step + report.outcome.losses().len()).saturating_sub(1);
        return Err(Error::Interrupted {
            step,
            steps: t.run.recipe.steps,
        });
    }
    Ok(())
}

/// The run's options from the command's: who watches (the signals, the notes, unless told
/// otherwise the bar, and --tensorboard), what is recorded and checkpointed, the plan kept in
/// the checkpoints.
fn run_options(
    t: &TrainArgs,
    stop_on_signal: StopOnSignal,
    tensorboard: Option<Arc<TensorBoard>>,
    plan: Option<&crate::plan_auto::Choice>,
    locks: Arc<OutputLocks>,
) -> Result<RunOptions> {
    let watch = (stop_on_signal, PrintNotes);
    let observer: Arc<dyn TrainObserver> = if t.quiet || t.json {
        Arc::new(watch)
    } else {
        Arc::new((ProgressBar::default(), watch))
    };
    let observer: Arc<dyn TrainObserver> = Arc::new((observer, tensorboard));
    Ok(RunOptions {
        compute_only: false,
        record: t.timeline.is_some(),
        resume: t.resume.clone(),
        checkpoint: t.checkpoint.clone(),
        checkpoint_every: t.checkpoint_every,
        checkpoint_keep_last: t.keep_last,
        profile: t.profile.is_some(),
        profile_steps: t.profile_steps.clone(),
        checkpoint_metadata: plan
            .iter()
            .map(|p| {
                let text = serde_json::to_string(p).map_err(|e| Error::json("the plan", e))?;
                Ok((crate::plan_auto::PLAN_KEY.to_string(), text))
            })
            .collect::<Result<_>>()?,
        observer: Some(observer),
        locks: Some(locks),
    })
}

/// The rows of an existing `--losses` file that a resumed run writes again: those before its
/// first step, with the evaluations the uninterrupted run would have made (every
/// --eval-every, and its last step).
fn kept_rows(t: &TrainArgs, kept: Option<Vec<(usize, String)>>, first_step: usize) -> Vec<(usize, String)> {
    let steps = t.run.recipe.steps;
    let evaluated = t
        .run
        .recipe
        .eval_every
        .map(|every| move |s: usize| (s + 1).is_multiple_of(every.max(1)) || s + 1 == steps);
    match (kept, &t.losses) {
        (Some(rows), Some(path)) => rows_before(
            rows,
            first_step,
            evaluated.as_ref().map(|e| e as &dyn Fn(usize) -> bool),
            path,
        ),
        _ => vec![],
    }
}

/// A note on stderr when the measured peak passed --memory-budget.
fn note_over_budget(t: &TrainArgs, report: &RunReport) {
    if let (Some(mb), Some(m)) = (t.run.runtime.memory_budget, report.outcome.memory) {
        let policy = t.run.hook_spec();
        let every = t.run.model.activation_checkpointing.unwrap_or(0);
        let predicted = t.run.predicted_peak(&policy, every, t.run.data.batch_size);
        let note = crate::footprint::over_budget_note(mb, m.peak as u64, predicted.map(|p| p.total()));
        if let Some(note) = note {
            eprintln!("note: {note}");
        }
    }
}

/// `--save`, `--losses`, `--timeline`, written from rank 0's view of the run, every one
/// attempted even when another fails. `kept` are the rows of an existing `--losses` file:
/// those before the first step run are written again (a resumed run). A `diverged` run's
/// parameters are not a model: it writes no `--save`, and an earlier file there stays.
pub fn write_outputs(t: &TrainArgs, report: &RunReport, kept: &[(usize, String)], diverged: bool) -> Result<()> {
    let outcome = &report.outcome;
    let mut writes: Vec<Write<'_>> = vec![];
    if let Some(path) = t.save.as_ref().filter(|_| !diverged) {
        let write = move || Ok(brigade_models::save_safetensors(path, &outcome.params, None)?);
        writes.push((Output::new("--save", path), Box::new(write)));
    }
    if let Some(path) = &t.losses {
        let write = move || write_atomic(path, losses_csv(outcome, kept).as_bytes());
        writes.push((Output::new("--losses", path), Box::new(write)));
    }
    if let Some(path) = &t.timeline {
        writes.extend(timeline_write(t, report, path));
    }
    if let Some(path) = &t.plot {
        writes.extend(plot_write(t, report, kept, path));
    }
    if let Some(path) = &t.profile {
        writes.extend(profile_write(t, outcome, path));
    }
    write_all(writes)
}

/// The `--losses` file: the `kept` rows before the first step run, then this run's steps.
fn losses_csv(outcome: &brigade::outcome::TrainOutcome, kept: &[(usize, String)]) -> String {
    let kept: Vec<&str> = kept
        .iter()
        .filter(|(s, _)| *s < outcome.first_step)
        .map(|(_, r)| r.as_str())
        .collect();
    // a scale column where any row has one (a resume across fp16 and another
    // precision), and every row as many cells as the header
    let scaled = outcome.scales().iter().any(Option::is_some)
        || kept
            .iter()
            .any(|r| r.split(',').count() > LOSSES_HEADER.split(',').count());
    let header = if scaled { LOSSES_HEADER_SCALED } else { LOSSES_HEADER };
    let cells = header.split(',').count();
    let mut csv = format!("{header}\n");
    for row in kept {
        csv.push_str(row);
        csv.push_str(&",".repeat(cells.saturating_sub(row.split(',').count())));
        csv.push('\n');
    }
    for (i, r) in outcome.steps.iter().enumerate() {
        let norm = r.grad_norm.map(|n| format!("{n:.9}")).unwrap_or_default();
        let val = r.val_loss.map(|v| format!("{v:.9}")).unwrap_or_default();
        csv.push_str(&format!(
            "{},{:.9},{},{norm},{val}",
            outcome.first_step + i,
            r.loss,
            r.lr
        ));
        if scaled {
            csv.push_str(&format!(",{}", r.scale.map(|s| s.to_string()).unwrap_or_default()));
        }
        csv.push('\n');
    }
    csv
}

/// `--timeline`'s write (`None`, said in a note, when no step ran).
fn timeline_write<'a>(t: &'a TrainArgs, report: &'a RunReport, path: &'a PathBuf) -> Option<Write<'a>> {
    match &report.timeline {
        Some(tl) if !report.outcome.losses().is_empty() => {
            let write = move || {
                let title = format!(
                    "step {}: {} ranks, bucket cap {} MiB",
                    tl.step,
                    report.world_size,
                    t.run.bucket_cap()?
                );
                write_timeline(path, &tl.events, tl.origin, &title)
            };
            Some((Output::new("--timeline", path), Box::new(write)))
        }
        _ => {
            eprintln!(
                "note: no step was run, so there is no timeline to write to {}",
                path.display()
            );
            None
        }
    }
}

/// `--plot`'s write: the rows before a resume, as --losses keeps them, then this run's steps
/// (`None`, said in a note, when there are none).
fn plot_write<'a>(
    t: &'a TrainArgs,
    report: &'a RunReport,
    kept: &'a [(usize, String)],
    path: &'a PathBuf,
) -> Option<Write<'a>> {
    let outcome = &report.outcome;
    let earlier = kept
        .iter()
        .filter(|(s, _)| *s < outcome.first_step)
        .filter_map(|(_, row)| LossPoint::from_csv_row(row));
    let points: Vec<LossPoint> = earlier
        .chain(outcome.steps.iter().enumerate().map(|(i, r)| LossPoint {
            step: outcome.first_step + i,
            loss: r.loss,
            lr: Some(r.lr),
            val_loss: r.val_loss,
        }))
        .collect();
    if points.is_empty() {
        eprintln!(
            "note: no step was run, so there is no loss chart to draw in {}",
            path.display()
        );
        return None;
    }
    let title = format!(
        "{}, world size {}, {} rows/rank, {} --lr {}",
        crate::args::flag_name(&t.run.model.model),
        report.world_size,
        t.run.rows_per_rank(),
        crate::args::flag_name(&t.run.recipe.optimizer),
        crate::args::compact(t.run.recipe.lr)
    );
    let write = move || write_loss_chart(path, &points, &title);
    Some((Output::new("--plot", path), Box::new(write)))
}

/// Why a run wrote no profile: it stopped before `--profile-steps`' window (interrupted,
/// diverged or failed), or ran no synchronized step (one rank, no DDP).
fn no_profile_why(t: &TrainArgs, outcome: &brigade::outcome::TrainOutcome) -> String {
    let last = outcome.steps.last().map(|s| s.step);
    match (&t.profile_steps, last) {
        (Some(w), Some(last)) if last < w.start => format!(
            "the run stopped after step {last}, before --profile-steps {}..{} was reached",
            w.start, w.end
        ),
        (Some(w), None) => format!(
            "the run stopped before its first step, before --profile-steps {}..{} was reached",
            w.start, w.end
        ),
        _ => match &outcome.stopped {
            Some(e) if !e.is_agreed() => {
                "a rank failed partway, and every rank's profile entries are gathered over its collectives".into()
            }
            _ => "no synchronized step was run (or no DDP)".into(),
        },
    }
}

/// `--profile`'s write: the recorded step profiles, each naming the command line that ran
/// (`None`, said in a note, when no synchronized step ran).
fn profile_write<'a>(
    t: &'a TrainArgs,
    outcome: &'a brigade::outcome::TrainOutcome,
    path: &'a PathBuf,
) -> Option<Write<'a>> {
    // the command line that ran, as `brigade ...` (what `brigade plan` edits into its pick)
    let command: Vec<String> = std::iter::once("brigade".to_string())
        .chain(std::env::args().skip(1))
        .collect();
    let with_command = |p: &StepProfile| {
        let mut p = p.clone();
        if let Some(run) = &mut p.run {
            run.command = command.clone();
        }
        p
    };
    let text = match &t.profile_steps {
        Some(_) if outcome.profiles.is_empty() => None,
        Some(_) => Some(serde_json::to_string_pretty(
            &outcome.profiles.iter().map(with_command).collect::<Vec<_>>(),
        )),
        None => outcome
            .profile
            .as_ref()
            .map(with_command)
            .as_ref()
            .map(serde_json::to_string_pretty),
    };
    let Some(text) = text else {
        eprintln!(
            "note: {}, so there is no profile to write to {}",
            no_profile_why(t, outcome),
            path.display()
        );
        return None;
    };
    let write = move || {
        let text = text.map_err(|e| Error::json("step profile", e))?;
        write_atomic(path, text.as_bytes())
    };
    Some((Output::new("--profile", path), Box::new(write)))
}
