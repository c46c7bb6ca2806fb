//! `brigade`: train models data-parallel, benchmark collectives, sweep bucket sizes; as a
//! library, the whole command line with a user's own reducer policies added
//! ([`main_with`]):
//!
//! ```no_run
//! use brigade::policies::Registry;
//!
//! fn main() -> std::process::ExitCode {
//!     let mut policies = Registry::new();
//!     policies
//!         .register("mean", |_arg| Ok(Box::new(brigade::policies::AllReduce)))
//!         .unwrap();
//!     brigade_cli::main_with(policies) // `--policy mean` runs it
//! }
//! ```

#![warn(missing_docs)]

use std::process::ExitCode;

use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, Subcommand};

mod args;
mod argv;
mod bucket_cap;
mod commands;
mod error;
mod footprint;
mod outputs;
mod plan_auto;
mod policy;
mod report;
mod run;
#[cfg(test)] // a test's path in the system temp dir, removed when it passes
#[path = "../../test-support/scratch.rs"]
mod scratch;
mod sent;
mod signal;
mod tensorboard;

use args::say_old_spellings;
use commands::{bench, plan, predict, sample, study, sweep, sweep_args, tokenize, train};

// Collectives' buffers (DDP's buckets) can live in memory the node's other processes map, so
// that an all-reduce under mpirun runs in place (`brigade_comm::host_vec`).
#[global_allocator]
static HEAP: brigade_comm::SharedHeap = brigade_comm::SharedHeap;

/// Brigade: data-parallel training from scratch.
#[derive(Parser)]
#[command(name = "brigade", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (N ranks as threads with --world-size, or under mpirun with --backend mpi).
    Train(Box<train::TrainArgs>),
    /// Step time, compute-only time and exposed communication for several bucket sizes, or
    /// reducer policies side by side (--policy).
    Sweep(Box<sweep_args::SweepArgs>),
    /// Predict step time and exposed communication under other bucket caps, links or world
    /// sizes from one recorded step (`brigade train --profile`), without running anything.
    Predict(Box<predict::PredictArgs>),
    /// The fastest reducer policy, bucket cap and activation checkpointing that fit a memory
    /// budget per rank, from one profiled step per policy family, without running anything.
    Plan(Box<plan::PlanArgs>),
    /// Which reducer policy reaches a target loss soonest at a target world size and link:
    /// each trains there on thread ranks, its steps are profiled and its step predicted.
    ///
    /// A policy whose loss or update stops being finite keeps its row, marked diverged at that
    /// step (it reaches no target), with a note on stderr. Exit status: 0 when at least one
    /// policy ran every step; 1, with one error line, when every policy diverged, when a policy
    /// failed while it trained (the study stops there, --out then holding the policies that
    /// finished before it), or on any other error; 130 when SIGINT or SIGTERM stopped it, --out
    /// then holding the policies that finished.
    Study(Box<study::StudyArgs>),
    /// Text out of a trained GPT's checkpoint, streamed to stdout as it is generated.
    Sample(Box<sample::SampleArgs>),
    /// A UTF-8 text file as an llm.c token shard (GPT-2's tokens by default), for --data.
    Tokenize(Box<tokenize::TokenizeArgs>),
    /// Micro-benchmarks: all-reduce bandwidth against memcpy; GEMM against the library under it.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// Two rules for every flag of every subcommand, kept in one place: a flag given twice is an
/// error (a list flag such as `--widths` would otherwise append the second list to the first;
/// `plan`'s `--profile`, one file per policy family, is the one flag that repeats), and a value that looks like a negative number goes to the flag's own parser, which names
/// the flag and says what it takes (instead of "unexpected argument '-1'").
fn flag_rules(cmd: clap::Command) -> clap::Command {
    // `brigade plan --profile F --profile G`: one profile per policy family
    let repeatable = |a: &clap::Arg, plan: bool| plan && a.get_id() == "profile";
    let plan = cmd.get_name() == "plan";
    cmd.mut_args(|a| {
        let a = match a.get_action() {
            ArgAction::Append if !repeatable(&a, plan) => a.action(ArgAction::Set),
            _ => a,
        };
        if a.get_action().takes_values() {
            a.allow_negative_numbers(true)
        } else {
            a
        }
    })
    .mut_subcommands(flag_rules)
}

/// The command line, parsed under [`flag_rules`], its `--policy` help listing the registry's
/// policies.
fn parse<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args = negative_values_attached(args.into_iter().map(Into::into).collect());
    let matches = policy::listed_in_help(flag_rules(Cli::command())).try_get_matches_from(args)?;
    Cli::from_arg_matches(&matches)
}

/// `args` with a value that starts with a negative number (`-1,0.5`, `-1e-3`) joined to the
/// long flag before it (`--target-loss=-1,0.5`): clap reads a plain negative number as the
/// flag's value ([`flag_rules`]), but a list or an exponent with a sign as short flags;
/// joined, the flag's parser names the flag and what it takes. A flag's name is never taken
/// as a value, and nothing after `--` is touched.
fn negative_values_attached(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let negative_list = |a: &str| {
        let rest = a.strip_prefix('-').unwrap_or_default();
        rest.starts_with(|c: char| c.is_ascii_digit() || c == '.')
    };
    let mut out: Vec<std::ffi::OsString> = Vec::with_capacity(args.len());
    let mut escaped = false;
    for a in args {
        let text = a.to_str().unwrap_or_default();
        let flag = out
            .last()
            .and_then(|f| f.to_str())
            .filter(|f| f.starts_with("--") && f.len() > 2 && !f.contains('='));
        match flag {
            Some(f) if !escaped && negative_list(text) => {
                let joined = format!("{f}={text}");
                *out.last_mut().expect("a flag before") = joined.into();
            }
            _ => {
                escaped |= text == "--";
                out.push(a);
            }
        }
    }
    out
}

/// A usage error in one line, like every other error: clap's first line (it adds a usage
/// block), with the values the flag takes and the spelling clap suggests, which clap puts on
/// lines of their own.
fn one_line(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let text = e.render().to_string();
    let mut line = text.lines().next().unwrap_or("error: bad arguments").to_string();
    // the missing required flags, which clap lists on the lines below its first
    if let (clap::error::ErrorKind::MissingRequiredArgument, Some(ContextValue::Strings(missing))) =
        (e.kind(), e.get(ContextKind::InvalidArg))
    {
        line.push_str(&format!(" {}", missing.join(", ")));
    }
    // (clap gives an empty list for a flag that takes any value)
    if let Some(ContextValue::Strings(values)) = e
        .get(ContextKind::ValidValue)
        .filter(|v| !matches!(v, ContextValue::Strings(s) if s.is_empty()))
    {
        line.push_str(&format!(" (one of: {})", values.join(", ")));
    }
    for kind in [
        ContextKind::SuggestedArg,
        ContextKind::SuggestedValue,
        ContextKind::SuggestedSubcommand,
    ] {
        match e.get(kind) {
            Some(ContextValue::String(s)) => line.push_str(&format!(" (did you mean '{s}'?)")),
            Some(ContextValue::Strings(s)) if !s.is_empty() => {
                line.push_str(&format!(" (did you mean '{}'?)", s.join("', '")))
            }
            _ => {}
        }
    }
    line
}

/// Runs the `brigade` command line (`std::env::args`) with `registry`'s policies beside the
/// built-in ones: `--policy NAME[:ARGS]` (and a sweep's `--policy` list) names them, and
/// `--help` and errors list them. Returns the process's exit status (2 for a usage error).
pub fn main_with(registry: brigade::policies::Registry) -> ExitCode {
    ExitCode::from(run_with(registry, std::env::args_os()))
}

/// [`main_with`] on the command line `args` (the program's name first), returning the exit
/// status: 0, 2 for a usage error, 1 or another code for a failed command. Call it once per
/// process (the first registry stays installed).
pub fn run_with<I, T>(registry: brigade::policies::Registry, args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    policy::install(registry);
    // before any tensor exists: reuse freed activation memory instead of faulting in fresh pages
    brigade::tensor::retain_freed_host_memory();
    // a write past `ulimit -f` fails with EFBIG (reported, the other outputs kept) instead of
    // killing the process with no message
    signal::ignore_file_size_signal();
    let cli = match parse(args) {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            eprintln!("{}", one_line(&e));
            return 2;
        }
    };
    // a GEMM library that BRIGADE_GEMM names and this machine cannot use: said before any work
    if let Err(e) = std::env::var_os("BRIGADE_GEMM").map_or(Ok(()), |_| brigade::tensor::cpu_gemm().map(drop)) {
        eprintln!("error: {e}");
        return 1;
    }
    let result = match cli.command {
        Command::Train(mut t) => {
            let notes = t.run.take_old_spellings();
            train::train(*t).inspect(|()| say_old_spellings(&notes))
        }
        Command::Sweep(mut s) => {
            let notes = s.run.take_old_spellings();
            sweep::sweep(*s).inspect(|()| say_old_spellings(&notes))
        }
        Command::Predict(p) => predict::predict(*p),
        Command::Plan(p) => plan::run_plan(*p),
        Command::Study(mut s) => {
            let notes = s.run.take_old_spellings();
            study::study(*s).inspect(|()| say_old_spellings(&notes))
        }
        Command::Sample(s) => sample::sample(*s),
        Command::Tokenize(t) => tokenize::tokenize(*t),
        Command::Bench(cmd) => bench::run(cmd),
    };
    // a stdout that failed (other than a reader that went away) fails a command that succeeded
    let result = result.and_then(|()| report::stdout::failure());
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}
