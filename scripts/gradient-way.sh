#!/usr/bin/env bash
# One gradient's way, counted: runs the policies test `gradient_way` (one parameter, so one
# bucket, on two thread ranks, the all-reduce policy, one SGD step) under callgrind, which
# zeroes its counters once both ranks are built and about to call `backward()` and dumps them
# once both have stepped: every thread's work in between, the comm streams' workers included.
# Prints the source files under crates/*/src of every function that ran there (inlined ones
# included; code at line 0, which the compiler placed at no source line, belongs to none), and fails when
# there are more than MAX (default 15). WAY_FUNCTIONS=1 also lists each file's functions.
# Needs: valgrind (apt-get install -y valgrind), python3.
# Usage: scripts/gradient-way.sh [MAX]
set -euo pipefail
cd "$(dirname "$0")/.."
max="${1:-15}"
command -v valgrind >/dev/null || { echo "valgrind not found: apt-get install -y valgrind" >&2; exit 1; }
bin="$(cargo test -q -p brigade-policies --test policies --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "policies":
        print(m["executable"])')"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
valgrind --tool=callgrind --callgrind-out-file="$out/cg" --dump-instr=no \
  --zero-before='*gradient_way::way_starts' --dump-before='*gradient_way::way_ends' \
  "$bin" --exact gradient_way::one_bucket_on_two_thread_ranks_is_averaged_and_stepped \
  --test-threads=1 >"$out/test.log" 2>"$out/valgrind.log" || { cat "$out/test.log" "$out/valgrind.log" >&2; exit 1; }
python3 - "$out" "$max" <<'PY'
import glob, os, re, sys
out, most = sys.argv[1], int(sys.argv[2])
root = os.getcwd() + "/"
files = {}
# the dump at `way_ends` (every thread's costs summed; names compressed per file)
dumps = glob.glob(os.path.join(out, "cg.1"))
if not dumps:
    sys.exit("callgrind wrote no dump at way_ends: did the test run?")
for path in dumps:
    names, fns = {}, {}
    fl = current = fn = None
    at = 0  # the source line of the cost line (positions are compressed: +n, -n, * for the last)
    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        m = re.match(r"(c?)(fl|fi|fe|fn)=\((\d+)\)(?: (.*))?$", line)
        if m:
            kind, key, name = m.group(2), m.group(3), m.group(4)
            table = fns if kind == "fn" else names
            if name is not None:
                table[key] = name
            if m.group(1):
                continue  # the callee of the next call line
            if kind == "fn":
                fn, current = fns.get(key), fl
            elif kind == "fl":
                fl = current = names.get(key)
            else:
                current = names.get(key)
            continue
        m = re.match(r"([+\-*]?)(\d*)\s", line)
        if not m:
            continue
        sign, n = m.group(1), m.group(2)
        at = at + int(n) if sign == "+" else at - int(n) if sign == "-" else at if sign == "*" else int(n)
        # line 0 is code the compiler placed at no source line (the unit's root file is named
        # beside it): it is no file's code
        if current and at and any(int(c) for c in line.split()[1:] if c.isdigit()):
            files.setdefault(current, set()).add(fn)
def ours(f):
    # the workspace's own sources (relative in the debug info, or under this checkout)
    if f.startswith(root):
        f = f[len(root):]
    return f if re.match(r"crates/[^/]+/src/", f) else None
src = {}
for f, in_fns in files.items():
    if ours(f):
        src.setdefault(ours(f), set()).update(in_fns)
for f in sorted(src):
    print(f)
    if os.environ.get("WAY_FUNCTIONS"):
        for name in sorted(n for n in src[f] if n):
            print("    " + name)
print(f"{len(src)} files (at most {most})")
sys.exit(0 if len(src) <= most else 1)
PY
