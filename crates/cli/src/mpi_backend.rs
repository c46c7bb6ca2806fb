//! `--backend mpi`: one rank per process under `mpirun`. This build has no MPI support.

use crate::args::RunArgs;
use crate::error::{CliError, Result};
use crate::run::{RunOptions, RunReport};

/// Explains how to get a build with MPI.
pub fn run(_args: &RunArgs, _opts: &RunOptions) -> Result<RunReport> {
    Err(CliError::Usage(
        "--backend mpi needs a build with MPI support: install OpenMPI (apt-get install openmpi-bin libopenmpi-dev libclang-dev) \
         and build with `cargo build --release --features mpi`"
            .into(),
    ))
}
