//! `brigade bench ...` subcommands.

use clap::Subcommand;

/// What to benchmark.
#[derive(Subcommand)]
pub enum BenchCommand {}

/// Runs one benchmark subcommand.
pub fn run(cmd: BenchCommand) -> Result<(), Box<dyn std::error::Error>> {
    match cmd {}
}
