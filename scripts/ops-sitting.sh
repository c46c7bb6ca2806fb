#!/usr/bin/env bash
# The GPT's step op by op against PyTorch's, in one sitting: `brigade bench ops --model gpt` and
# `scripts/torch_ops_profile.py --workload gpt` (one thread each by default), ROUNDS rounds, the
# two sides interleaved (which goes first alternates), then one markdown table of medians per op
# kind (forward and backward ms per step, each side, and Brigade / PyTorch), the median steps
# without a profiler beside it, the CPU and the load average at the start and the end.
# PyTorch's per-op figures come from torch.profiler, which adds overhead to every op: compare
# an op's ratio with the steps' ratio, not its milliseconds alone. About 3 minutes on 2 quiet
# cores; run it on a quiet machine.
#
#   scripts/ops-sitting.sh [OUT_DIR]     (ROUNDS=7 THREADS=1 STEPS=10 PRECISION=f32 by default)
#
# Needs: a Rust toolchain (builds target/release/brigade) and PyTorch in TORCHREF's venv
# (default /root/torchref/.venv/bin/python, with workloads.py beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d -t ops-sitting.XXXXXX)}
ROUNDS=${ROUNDS:-7}
THREADS=${THREADS:-1}
STEPS=${STEPS:-10}
PRECISION=${PRECISION:-f32}
TORCHREF=${TORCHREF:-/root/torchref}
PY=${PY:-$TORCHREF/.venv/bin/python}
B=target/release/brigade
mkdir -p "$OUT"
run() { echo "+ $*" >&2; "$@"; }
for f in "$PY" "$TORCHREF/workloads.py"; do
  [ -e "$f" ] || { echo "error: $f not found (see the header of $0)" >&2; exit 2; }
done
run cargo build --release -q -p brigade-cli
load_start=$(uptime)
brigade() {
  run "$B" bench ops --model gpt --threads "$THREADS" --steps "$STEPS" --precision "$PRECISION" >"$OUT/brigade_$1.txt"
}
torch() {
  run "$PY" scripts/torch_ops_profile.py --workload gpt --threads "$THREADS" --steps "$STEPS" \
    --precision "$PRECISION" --torchref "$TORCHREF" >"$OUT/torch_$1.txt"
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then brigade "$r"; torch "$r"; else torch "$r"; brigade "$r"; fi
done
load_end=$(uptime)

python3 - "$OUT" "$ROUNDS" <<'PY'
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ROW = re.compile(r"^(\S[\w ()/]*?)\s+(-?[\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s+([\d.]+)\s+[\d.]+%$")

def table(path):
    """op -> (fwd ms, bwd ms), and the median step without the profiler (ms)."""
    ops, step = {}, None
    for line in open(path):
        line = line.rstrip()
        m = ROW.match(line)
        if m and m.group(1) != "op":
            ops[m.group(1).strip()] = (float(m.group(2)), float(m.group(4)))
        if o := re.match(r"^optimizer step\s+([\d.]+)\s+[\d.]+%$", line):
            ops["optimizer step"] = (0.0, float(o.group(1)))
        if (s := re.search(r"median step ([\d.]+) ms", line)) or (s := re.search(r", step ([\d.]+) ms$", line)):
            step = float(s.group(1))
    return ops, step

sides = {side: [table(f"{out}/{side}_{r}.txt") for r in range(1, rounds + 1)] for side in ("brigade", "torch")}
med = lambda xs: statistics.median(xs) if xs else float("nan")
steps = {s: med([t[1] for t in v if t[1] is not None]) for s, v in sides.items()}
print(f"GPT step ({rounds} interleaved rounds, median): Brigade {steps['brigade']:.2f} ms (its profiled steps), "
      f"PyTorch {steps['torch']:.2f} ms (without the profiler), ratio {steps['brigade'] / steps['torch']:.2f}\n")
print("| op | Brigade fwd ms | bwd ms | PyTorch fwd ms | bwd ms | Brigade / PyTorch (fwd+bwd) |")
print("|---|---|---|---|---|---|")
ops = sorted({op for v in sides.values() for t in v for op in t[0]},
             key=lambda op: -med([sum(t[0].get(op, (0, 0))) for t in sides["brigade"]]))
for op in ops:
    f = {s: [t[0][op] for t in v if op in t[0]] for s, v in sides.items()}
    fb = {s: (med([x[0] for x in f[s]]), med([x[1] for x in f[s]])) for s in f}
    total = {s: sum(fb[s]) for s in fb}
    ratio = f"{total['brigade'] / total['torch']:.2f}" if f["brigade"] and f["torch"] and total["torch"] > 0 else "-"
    cell = lambda s, i: f"{fb[s][i]:.3f}" if f[s] else "-"
    print(f"| {op} | {cell('brigade', 0)} | {cell('brigade', 1)} | {cell('torch', 0)} | {cell('torch', 1)} | {ratio} |")
PY
echo
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'); load at the start: ${load_start##*load average: }; at the end: ${load_end##*load average: }"
echo "raw outputs in $OUT"
