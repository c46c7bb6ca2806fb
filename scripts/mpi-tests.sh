#!/usr/bin/env bash
# The MPI backend's tests (each test launches `mpirun` itself): transport collectives,
# mismatch/timeout, the launch API (results, a failing rank named), and `brigade train
# --backend mpi` parity, overlap, setup errors, kill.
# Needs: apt-get install -y openmpi-bin libopenmpi-dev libclang-dev
set -euo pipefail
cd "$(dirname "$0")/.."
command -v mpirun >/dev/null || { echo "mpirun not found: apt-get install -y openmpi-bin libopenmpi-dev libclang-dev" >&2; exit 1; }
cargo test -p brigade-comm --features mpi --lib -- mpi::
cargo test -p brigade-comm --features mpi --test comm -- --test-threads=1 mpi_collectives::
cargo test -p brigade-cli --features mpi --test cli -- --test-threads=1 mpi_train::
cargo test -p brigade-cli --features mpi --test cli -- --test-threads=1 faults::under_mpirun::
cargo test -p brigade --features mpi --test brigade -- --test-threads=1 mpi_launch::
