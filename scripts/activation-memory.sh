#!/usr/bin/env bash
# Per-rank memory of the reference GPT at world 1, 2, 4 under DDP, ZeRO-1 and ZeRO-2, and at
# world 2 and 4 under ZeRO-3, with and without activation checkpointing (every block), measured
# by `brigade train --json` (the `memory` object: the state between steps from live storages,
# the activations and the peak of the last step from the tensor crate's allocation meter),
# beside the predicted peak that `--memory-budget` checks. Memory figures are not timings:
# valid on a loaded machine.
# Usage: scripts/activation-memory.sh [path/to/brigade] [batch-size]
# Prints a markdown table for docs/BENCHMARKS.md.
set -euo pipefail
BIN=${1:-target/release/brigade}
ROWS=${2:-8}
[ -x "$BIN" ] || cargo build --release -p brigade-cli
echo "| ranks | zero | checkpointing | parameters MiB | gradients MiB | optimizer state MiB | activations MiB | peak MiB | predicted peak MiB |"
echo "|---|---|---|---|---|---|---|---|---|"
for world in 1 2 4; do
  for zero in 0 1 2 3; do
    [ $zero = 3 ] && [ $world = 1 ] && continue
    for ck in off every; do
      extra=()
      [ $ck = every ] && extra=(--activation-checkpointing)
      out=$("$BIN" train --model gpt --optimizer adamw --world-size $world --batch-size "$ROWS" --steps 2 \
            --threads-per-rank 1 --zero $zero "${extra[@]}" --json --quiet)
      python3 - "$world" "$zero" "$ck" "$out" <<'PY'
import json, sys
world, zero, ck, out = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
m = out["memory"]
mib = lambda b: f"{b / 2**20:.2f}"
print(f"| {world} | {zero} | {ck} | {mib(m['parameter_bytes'])} | {mib(m['gradient_bytes'])} | "
      f"{mib(m['optimizer_state_bytes'])} | {mib(m['activation_bytes'])} | {mib(m['peak_bytes'])} | "
      f"{mib(m['predicted_peak_bytes'])} |")
PY
    done
  done
done
