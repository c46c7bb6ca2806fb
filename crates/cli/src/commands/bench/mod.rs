//! `brigade bench ...` subcommands.

mod fit;
mod gemm;
mod ops;

use crate::report::stdout::{out, outln};
use brigade_comm::bench::{default_sizes, parse_size, run_comm_bench, CommBenchConfig};
use clap::{Args, Subcommand};

use brigade::launch::CommBackend;

use crate::args::{backend_parser, MAX_THREAD_RANKS};
use crate::error::{Error, Result};
use crate::footprint;

/// What to benchmark.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// All-reduce bandwidth (algbw, busbw) against single-thread memcpy bandwidth.
    Comm(CommArgs),
    /// f32 GEMM: Brigade's matmul beside a direct call of the library under it (the `gemm`
    /// crate on the CPU), and numpy's figure when given.
    Gemm(gemm::GemmArgs),
    /// Where one training step's time goes, per op kind, forward and backward (the
    /// torchref workloads; `scripts/torch_ops_profile.py` prints PyTorch's side).
    Ops(ops::OpsArgs),
    /// The largest member of a GPT family of many blocks that trains under a memory budget
    /// per rank with plain DDP, against the largest with ZeRO-3 and activation checkpointing
    /// (measured peaks, bisected widths), and the ratio of their sizes.
    Fit(fit::FitArgs),
}

/// Options of `brigade bench comm`.
#[derive(Args)]
pub struct CommArgs {
    /// Number of ranks.
    #[arg(long, default_value_t = 2)]
    pub world_size: usize,
    /// Comma-separated buffer sizes (e.g. `1K,16M,64M`), each at least 4 bytes (one f32)
    /// per rank, rounded down to whole f32s; default 1 KiB to 64 MiB by 4x.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Option<Vec<usize>>,
    /// Timed iterations per size, 1 to 1000000 (default: about 512 MiB of traffic per size, 5 to 1000).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Backend (under MPI, rank 0 prints).
    #[arg(long, value_parser = backend_parser(), default_value_t = CommBackend::Thread)]
    pub backend: CommBackend,
}

/// The most timed all-reduces per size of `brigade bench comm` (each one's time is kept).
const MAX_ITERS: usize = 1_000_000;

/// Runs one benchmark subcommand.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Comm(args) => bench_comm(args),
        BenchCommand::Gemm(args) => gemm::bench_gemm(args),
        BenchCommand::Ops(args) => ops::bench_ops(args),
        BenchCommand::Fit(args) => fit::bench_fit(args),
    }
}

fn bench_comm(args: CommArgs) -> Result<()> {
    let bad = |m: String| Err(Error::Usage(m));
    if args.world_size == 0 {
        return bad("--world-size must be at least 1".into());
    }
    if args.backend == CommBackend::Thread && args.world_size > MAX_THREAD_RANKS {
        return bad(format!(
            "--world-size {} is more ranks than one process runs as threads (at most {MAX_THREAD_RANKS}): \
             start them under mpirun with --backend mpi",
            args.world_size
        ));
    }
    if let Some(n) = args.iters.filter(|&n| n == 0 || n > MAX_ITERS) {
        return bad(format!(
            "--iters must be between 1 and {MAX_ITERS} (timed all-reduces per size), got {n}"
        ));
    }
    let least = args.world_size.saturating_mul(4); // at most 4 * MAX_THREAD_RANKS under threads
    if let Some(small) = args.sizes.iter().flatten().find(|&&b| b < least) {
        return bad(format!(
            "--sizes: {small} B is too small to split among {} ranks; each size needs at least {least} B (one f32 per rank)",
            args.world_size
        ));
    }
    // every rank of this process holds its buffer of the size
    let ranks = if args.backend == CommBackend::Thread {
        args.world_size
    } else {
        1
    };
    for &size in args.sizes.iter().flatten() {
        footprint::check_fits(
            &format!(
                "--sizes {size} on {ranks} {}",
                if ranks == 1 { "rank" } else { "ranks" }
            ),
            footprint::mul(size as u64, ranks as u64),
        )?;
    }
    let cfg = CommBenchConfig::new(args.world_size, args.sizes.unwrap_or_else(default_sizes), args.iters);
    let report = match args.backend {
        CommBackend::Thread => run_comm_bench(&cfg)?,
        CommBackend::Mpi => match mpi_bench(&cfg)? {
            Some(report) => report,
            None => return Ok(()), // not rank 0
        },
        CommBackend::Nccl => {
            return bad("brigade bench comm measures the host backends (thread, mpi); NCCL's all-reduce is timed by scripts/gpu-check.sh".into())
        }
    };
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| Error::json("the bandwidth rows", e))?;
        outln!("{text}");
    } else {
        out!("{}", report.to_table());
    }
    Ok(())
}

/// The MPI all-reduce benchmark over the processes of this `mpirun` job; `Some` on rank 0.
#[cfg(feature = "mpi")]
fn mpi_bench(cfg: &CommBenchConfig) -> Result<Option<brigade_comm::bench::CommBenchReport>> {
    let world = brigade_comm::MpiWorld::init()?;
    Ok(world.bench_all_reduce(cfg)?)
}

/// Without the `mpi` feature: how to get it.
#[cfg(not(feature = "mpi"))]
fn mpi_bench(_cfg: &CommBenchConfig) -> Result<Option<brigade_comm::bench::CommBenchReport>> {
    Err(Error::Usage(
        "--backend mpi needs a build with MPI support: install OpenMPI (apt-get install openmpi-bin libopenmpi-dev \
         libclang-dev), build with `cargo build --release --features mpi` and run under `mpirun -np N`"
            .into(),
    ))
}
