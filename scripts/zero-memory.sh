#!/usr/bin/env bash
# Per-rank memory of ZeRO stages 0, 1, 2, measured from live allocations by
# `brigade train --json`, beside the ZeRO paper's formula for AdamW in f32. Memory figures are
# not timings: valid on a loaded machine. Usage: scripts/zero-memory.sh [path/to/brigade]
# Prints a markdown table for docs/BENCHMARKS.md.
set -euo pipefail
BIN=${1:-target/release/brigade}
[ -x "$BIN" ] || cargo build --release -p brigade-cli
MLP=(--model mlp)             # reference widths 512,2048,2048,2048,10
GPT=(--model gpt)             # reference d_model 256, 4 layers, 4 heads, context 128
mib() { python3 -c "print(f'{$1/2**20:.2f}')"; }
echo "| model | ranks | zero | parameters MiB | gradients MiB (buckets) | optimizer state MiB | comm scratch MiB | total MiB | paper: 4Ψ + grads + state MiB |"
echo "|---|---|---|---|---|---|---|---|---|"
for model in mlp gpt; do
  if [ $model = mlp ]; then flags=("${MLP[@]}"); else flags=("${GPT[@]}"); fi
  for world in 2 4; do
    for zero in 0 1 2; do
      out=$("$BIN" train "${flags[@]}" --optimizer adamw --world-size $world --batch-size 2 --steps 1 \
            --threads-per-rank 1 --zero $zero --json --quiet)
      python3 - "$model" "$world" "$zero" "$out" <<'PY'
import json, sys
model, world, zero, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
m = out["memory"]
mib = lambda b: f"{b / 2**20:.2f}"
psi = m["parameter_bytes"] / 4
grads = 4 * psi / world if zero == 2 else 4 * psi
state = 8 * psi / world if zero >= 1 else 8 * psi
paper = 4 * psi + grads + state
print(f"| {model} (Ψ = {psi:,.0f}) | {world} | {zero} | {mib(m['parameter_bytes'])} | "
      f"{mib(m['gradient_bytes'])} ({mib(m['bucket_bytes'])}) | {mib(m['optimizer_state_bytes'])} | "
      f"{mib(m['comm_scratch_bytes'])} | {mib(m['total_bytes'])} | {mib(paper)} |")
PY
    done
  done
done
