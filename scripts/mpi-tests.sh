#!/usr/bin/env bash
# The MPI backend's tests (each test launches `mpirun` itself): transport collectives,
# mismatch/timeout, the launch API (results, a failing rank named), and `brigade train
# --backend mpi` parity, overlap, setup errors, kill.
# Needs: apt-get install -y openmpi-bin libopenmpi-dev libclang-dev
set -euo pipefail
cd "$(dirname "$0")/.."
command -v mpirun >/dev/null || { echo "mpirun not found: apt-get install -y openmpi-bin libopenmpi-dev libclang-dev" >&2; exit 1; }

# One cargo command builds every test binary below: the three packages and their `mpi` features
# resolved together, so each crate is compiled once. (A cargo command per package would resolve
# the shared dependencies' features per package, num-traits' among them, and compile the whole
# chain from brigade-dtype up again for each.)
binaries="$(cargo test -p brigade-comm -p brigade -p brigade-cli \
  --features brigade-comm/mpi,brigade/mpi,brigade-cli/mpi \
  --lib --test comm --test cli --test brigade --no-run --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        directory = m["manifest_path"].rsplit("/", 1)[0]
        kind = "lib" if "lib" in m["target"]["kind"] else m["target"]["name"]
        print(directory.rsplit("/", 1)[1], kind, directory, m["executable"])
')"
# Runs one test binary as `cargo test` would, from its package's directory: crates/CRATE,
# then `lib` (the unit tests) or the integration test's name, then the test arguments.
run() {
  local crate="$1" target="$2" line
  line="$(awk -v c="$crate" -v t="$target" '$1 == c && $2 == t' <<<"$binaries")"
  [ -n "$line" ] || { echo "no test binary $target in crates/$crate among: $binaries" >&2; exit 1; }
  shift 2
  read -r _ _ dir exe <<<"$line"
  echo "-- crates/$crate $target: $*"
  (cd "$dir" && "$exe" "$@")
}
run comm lib mpi::
run comm comm --test-threads=1 mpi_collectives::
run cli cli --test-threads=1 mpi_train::
run cli cli --test-threads=1 faults::under_mpirun::
run brigade brigade --test-threads=1 mpi_launch::
