#!/usr/bin/env bash
# One gradient's way, counted: runs the policies test `gradient_way` (one parameter, so one
# bucket, on two thread ranks, the all-reduce policy, one SGD step) under callgrind, which
# zeroes its counters once both ranks are built and about to call `backward()` and dumps them
# once both have stepped: every thread's work in between, the comm streams' workers included,
# each function with its callers (--separate-callers). scripts/gradient_way.py maps every line
# that ran to its Rust item and prints four figures with their lists:
#   files      the files of crates/*/src with code that ran (inlined code included);
#   dispatch   the traits that chose an implementation between the reducer and the transport;
#   forms      the changes of form of the bucket's bytes (Tensor, Storage, Buffer);
#   reentries  the files entered again on one call chain outside an event (the gradient-ready
#              bus, a work's completion).
# What counts as a layer, a form and an event is set in one place, at the top of gradient_way.py.
# --check: fails when a figure is above its limit in scripts/gradient-way.limits (a ratchet:
# lower a limit in the commit that lowers its figure; the script says to what).
# --functions: lists the functions that ran in each file.
# Needs: valgrind (apt-get install -y valgrind), python3; builds the test binary if needed.
# Usage: scripts/gradient-way.sh [--check] [--limits FILE] [--functions]
set -euo pipefail
cd "$(dirname "$0")/.."
limits=scripts/gradient-way.limits
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --check) args+=(--check "$limits") ;;
    --limits) [ $# -ge 2 ] || { echo "gradient-way: --limits needs a file" >&2; exit 2; }; limits="$2"; args+=(--check "$2"); shift ;;
    --functions) args+=(--functions) ;;
    *) echo "usage: scripts/gradient-way.sh [--check] [--limits FILE] [--functions]" >&2; exit 2 ;;
  esac
  shift
done
[ -z "${WAY_FUNCTIONS:-}" ] || args+=(--functions)
command -v valgrind >/dev/null || { echo "gradient-way: valgrind not found: apt-get install -y valgrind" >&2; exit 1; }
# at the workspace's root, not with -p: the features are those of `cargo test`, so its build is
# reused as it stands
bin="$(cargo test -q --test policies --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "policies" \
            and "brigade-policies" in m["package_id"]:
        print(m["executable"])')"
[ -n "$bin" ] || { echo "gradient-way: cargo built no policies test binary" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# callers up to 100 deep: a chain is cut there (the test's deepest is about 25)
timeout 300 valgrind --tool=callgrind --callgrind-out-file="$out/cg" --dump-instr=no --separate-callers=100 \
  --zero-before='*gradient_way::way_starts' --dump-before='*gradient_way::way_ends' \
  "$bin" --exact gradient_way::one_bucket_on_two_thread_ranks_is_averaged_and_stepped \
  --test-threads=1 >"$out/test.log" 2>"$out/valgrind.log" || { cat "$out/test.log" "$out/valgrind.log" >&2; exit 1; }
[ -s "$out/cg.1" ] || { echo "gradient-way: callgrind wrote no dump at way_ends: did the test run?" >&2; exit 1; }
python3 scripts/gradient_way.py "$out/cg.1" "${args[@]}"
