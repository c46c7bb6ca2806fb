#!/usr/bin/env bash
# The overlap model against measurements: for mlp and gpt, 2 and 4 ranks, simulated
# 1 and 10 Gb/s links (20 us per message), caps 0.25-100 MiB:
#   - `brigade sweep --repeat R` (caps interleaved round-robin) measures each cap's median step,
#     compute-only baseline and exposed comm (step - compute-only), and replays every recorded
#     profile under each cap; the model's exposed comm is its predicted step minus the same
#     compute-only baseline; pass when it lies within 15% or 2 ms of the measured median. The
#     wait for the buckets after backward, recorded and replayed, is shown beside it;
#   - `brigade train --bucket-mb auto` (choosing among the same caps) must pick a cap whose
#     measured median step (in the sweep) is within 5% of the fastest cap's.
# Timing is meaningless on a loaded machine: run it alone. About 10-15 minutes on 2 cores.
#
# Usage: scripts/bench-overlap-model.sh [OUT_DIR]      (default: out/bench-overlap-model)
# Knobs (environment): REPEAT (3), STEPS (6), WARMUP (2), CAPS (0.25,1,5,25,100),
#   MODELS ("mlp gpt"), WORLDS ("2 4"), GBPS ("1 10"), LATENCY_US (20), BRIGADE (binary; default:
#   a release build of this checkout), SMOKE=1 (tiny models and 2 steps: checks that the script
#   runs, measures nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/bench-overlap-model}
REPEAT=${REPEAT:-3}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-2}
CAPS=${CAPS:-0.25,1,5,25,100}
MODELS=${MODELS:-mlp gpt}
WORLDS=${WORLDS:-2 4}
GBPS=${GBPS:-1 10}
LATENCY_US=${LATENCY_US:-20}
if [[ -z "${BRIGADE:-}" ]]; then
  cargo build --release -p brigade-cli >&2
  BRIGADE=target/release/brigade
fi
mkdir -p "$OUT"

model_flags() {
  if [[ "${SMOKE:-0}" == 1 ]]; then
    case $1 in
      mlp) echo "--model mlp --widths 64,256,256,4 --batch-size 8" ;;
      gpt) echo "--model gpt --d-model 32 --layers 2 --heads 2 --d-ff 64 --context 16 --batch-size 2" ;;
    esac
  else
    case $1 in
      mlp) echo "--model mlp --batch-size 64" ;;           # reference MLP, 36.1 MiB of gradients
      gpt) echo "--model gpt --batch-size 4" ;;            # reference GPT, 4 x 128 tokens per rank
    esac
  fi
}

start=$(date +%s)
for model in $MODELS; do
  for world in $WORLDS; do
    for gbps in $GBPS; do
      name="$model-w$world-${gbps}gbps"
      dir="$OUT/$name"
      common="$(model_flags "$model") --world-size $world --threads-per-rank 1 --optimizer sgd --lr 0.01
        --net-gbps $gbps --net-latency-us $LATENCY_US --steps $STEPS --warmup $WARMUP"
      echo "== $name" >&2
      # shellcheck disable=SC2086
      "$BRIGADE" sweep $common --bucket-mb "$CAPS" --repeat "$REPEAT" --out "$dir" --json > "$dir.sweep.json"
      # shellcheck disable=SC2086
      "$BRIGADE" train $common --bucket-mb auto --autotune-caps "$CAPS" --autotune-every 2 --quiet --json \
        > "$dir.auto.json"
    done
  done
done
elapsed=$(( $(date +%s) - start ))

python3 - "$OUT" "$MODELS" "$WORLDS" "$GBPS" "$elapsed" <<'EOF'
import json, sys
out, models, worlds, gbps, elapsed = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4].split(), sys.argv[5]
lines = ["| run | cap MiB | buckets | step ms (spread) | predicted step ms | compute-only ms | measured exposed ms (spread) | predicted exposed ms | model | waited ms | predicted wait ms | wait | lower bound ms |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
auto_lines = ["| run | auto's cap MiB | its measured median step ms | fastest cap MiB | its step ms | ratio | auto's own step: predicted / measured ms | auto |",
              "|---|---|---|---|---|---|---|---|"]
fails = 0
wait_fails = 0
within = lambda pred, meas: pred is not None and meas is not None and abs(pred - meas) <= max(2.0, 0.15 * meas)
for m in models:
    for w in worlds:
        for g in gbps:
            name = f"{m}-w{w}-{g}gbps"
            rows = json.load(open(f"{out}/{name}.sweep.json"))
            for r in rows:
                meas, pred = r["exposed_comm_ms"], r["predicted_exposed_ms"]
                ok = within(pred, meas)
                fails += not ok
                wait_ok = within(r["predicted_wait_ms"], r["waited_ms"])
                wait_fails += not wait_ok
                f = lambda v: "-" if v is None else f"{v:.2f}"
                lines.append(f"| {name} | {r['bucket_mb']} | {r['buckets']} | {r['step_ms']:.2f} ({r['step_spread_ms']:.2f}) | "
                             f"{f(r['predicted_step_ms'])} | {r['compute_only_ms']:.2f} | {meas:.2f} ({r['exposed_spread_ms']:.2f}) | "
                             f"{f(pred)} | {'pass' if ok else 'FAIL'} | {f(r['waited_ms'])} | {f(r['predicted_wait_ms'])} | "
                             f"{'pass' if wait_ok else 'FAIL'} | {f(r['lower_bound_ms'])} |")
            auto = json.load(open(f"{out}/{name}.auto.json"))["autotune"]
            best = min(rows, key=lambda r: r["step_ms"])
            at = [r for r in rows if r["bucket_mb"] == auto["cap_mb"]]
            if at:
                ratio = at[0]["step_ms"] / best["step_ms"]
                ok = ratio <= 1.05
                step = f"{at[0]['step_ms']:.2f}"
            else:
                ratio, ok, step = float("nan"), False, "not swept"
            fails += not ok
            f = lambda v: "-" if v is None else f"{v:.2f}"
            auto_lines.append(f"| {name} | {auto['cap_mb']} | {step} | {best['bucket_mb']} | {best['step_ms']:.2f} | {ratio:.3f} | "
                              f"{f(auto['predicted_step_ms'])} / {f(auto['measured_step_ms'])} | {'pass' if ok else 'FAIL'} |")
text = "\n".join(lines + [""] + auto_lines + ["", f"{fails} failing rows (model and auto); "
                 f"the wait alone: {wait_fails} rows off; {elapsed} s in all"]) + "\n"
open(f"{out}/summary.md", "w").write(text)
print(text)
EOF
