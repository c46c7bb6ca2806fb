#!/usr/bin/env bash
# The test suite as a CPU with other features runs it: every test binary of the workspace
# (and, for the CLI's tests, the `brigade` binary they start) under Debian's qemu-user with
# the CPU model named, so that the `gemm` crate's run-time dispatch and Brigade's own
# `is_x86_feature_detected!` kernels pick what that CPU would: `Haswell` or `Skylake-Client`
# (AVX2, no AVX-512), `Nehalem` (SSE4.2, no AVX). The MPI tests (scripts/mpi-tests.sh) and
# doc tests are not run here.
#
#   scripts/test-other-cpu.sh [CPU] [-- test-name-filter and libtest flags]
#
# Installs qemu-user with apt-get where it is missing and the user may (root).
set -euo pipefail
cd "$(dirname "$0")/.."
cpu="${1:-Haswell}"
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift

if ! command -v qemu-x86_64 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null
  else
    echo "error: qemu-x86_64 not found (Debian: apt-get install qemu-user)" >&2
    exit 1
  fi
fi
[ "$(uname -m)" = x86_64 ] || { echo "error: this script emulates x86-64 CPUs; run it on x86-64" >&2; exit 1; }

# qemu warns on stderr of every process about the model's features TCG cannot emulate (the
# CLI's tests demand one clean error line): ask for the model without them
model="$cpu"
for feature in $(qemu-x86_64 -cpu "$cpu" /bin/true 2>&1 | sed -n 's/.*CPUID[^ ]*\.\([A-Za-z0-9_-]*\) \[bit.*/\1/p'); do
  model="$model,-$feature"
done
qemu-x86_64 -cpu "$model" /bin/true || { echo "error: qemu-x86_64 has no CPU model '$cpu'" >&2; exit 1; }

# the same build as the README's test command (`cargo test --tests`): its test binaries, listed by cargo
list="$(mktemp)"
trap 'rm -f "$list" "${wrapper:-}"' EXIT
cargo test --tests --no-run --message-format=json |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["manifest_path"].rsplit("/", 1)[0], m["executable"])
' >"$list"
[ -s "$list" ] || { echo "error: cargo test --no-run listed no test binaries" >&2; exit 1; }

# the CLI's tests start `brigade` through $BRIGADE_BIN: the same CPU for it
bin="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/brigade"
wrapper="$(mktemp)"
printf '#!/bin/sh\nexec qemu-x86_64 -cpu %s %s "$@"\n' "$model" "$bin" >"$wrapper"
chmod +x "$wrapper"
export BRIGADE_BIN="$wrapper"

# The CLI's tests that send SIGINT or SIGTERM to a running `brigade`: qemu-user (7.2) crashes
# the emulated process when a signal reaches it while its threads run ("qemu: uncaught target
# signal 11"), whatever the handler does, so they run natively only (`cargo test`). They compare
# no floating-point result with one recorded elsewhere.
signal_tests=(signals:: lifecycle::sigint_ lifecycle::sigterm_ faults::two_sigterms_
  faults::a_signal_while_starting_ faults::a_second_run_on_one_checkpoint_
  policy_resume::powersgd_stopped_by_sigint_)

failed=()
while read -r dir exe; do
  echo "== $(basename "$exe") on -cpu $cpu"
  skip=()
  if [ "$(basename "$(dirname "$dir")")/$(basename "$dir")" = crates/cli ] && [[ "$(basename "$exe")" == cli-* ]]; then
    for t in "${signal_tests[@]}"; do skip+=(--skip "$t"); done
  fi
  # each binary from its package's directory, as cargo test runs it
  if ! (cd "$dir" && qemu-x86_64 -cpu "$model" "$exe" "$@" "${skip[@]}"); then
    failed+=("$(basename "$exe")")
  fi
done <"$list"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed on -cpu $cpu: ${failed[*]}" >&2
  exit 1
fi
echo "every test binary passed on -cpu $cpu"
