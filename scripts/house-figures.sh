#!/usr/bin/env bash
# The house's static figures, read from the sources (scripts/house_figures.py says each one):
# files outside crates/policies whose non-test code names a built-in policy in a string literal
# (scripts/house-figures.allow lists the dtype and precision spellings allowed, with reasons);
# Brigade's own flags spelled in non-test code of crates/brigade/src (the flags every
# `brigade ... --help` lists, so another program's are not counted); the longest function of
# crates/ outside tests; the line counts of README.md, docs/ARCHITECTURE.md and the summary
# table at the top of docs/BENCHMARKS.md.
# --check: fails when one of the first three is above its limit in scripts/house-figures.limits
# (a ratchet: lower a limit in the commit that lowers its figure; the script says to what).
# Needs python3 and the brigade binary: $BRIGADE, else target/debug/brigade, built when missing
# (a stale binary lists stale flags: CI runs this right after `cargo test` built it).
# Usage: scripts/house-figures.sh [--check] [--limits FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
limits=scripts/house-figures.limits
check=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check=1 ;;
    --limits) [ $# -ge 2 ] || { echo "house-figures: --limits needs a file" >&2; exit 2; }; limits="$2"; check=1; shift ;;
    *) echo "usage: scripts/house-figures.sh [--check] [--limits FILE]" >&2; exit 2 ;;
  esac
  shift
done
brigade="${BRIGADE:-target/debug/brigade}"
if [ ! -x "$brigade" ]; then
  cargo build -q --bin brigade  # at the root: the features of `cargo test`, whose build it shares
  brigade=target/debug/brigade
fi
python3 scripts/house_figures.py "$brigade" ${check:+--check "$limits"}
