//! `brigade`: train models data-parallel, benchmark collectives, sweep bucket sizes.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;

/// Brigade: data-parallel training from scratch.
#[derive(Parser)]
#[command(name = "brigade", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Micro-benchmarks (collectives, ...).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(cmd) => bench::run(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
