#!/usr/bin/env bash
# Issue 13's sitting: Brigade against PyTorch in one run, as ratios of medians, rounds
# interleaved (Brigade then PyTorch, ROUNDS times) so that drift on a shared machine hits both.
#
#   scripts/speed-sitting.sh [OUT_DIR]        (from the repository root, nothing else running)
#
# Needs: target/release/brigade (cargo build --release -p brigade-cli), the torchref venv
# (TORCHREF, default $HOME/torchref with .venv, see ../shared/torchref/README.md), python3 with
# numpy + threadpoolctl for ../shared/tools/roofline.py. ROUNDS (default 3).
# Writes every raw output under OUT_DIR (default sitting-<date>/) and prints the ratio table.
set -euo pipefail
OUT=${1:-sitting-$(date -u +%Y%m%dT%H%M%S)}
ROUNDS=${ROUNDS:-3}
TORCHREF=${TORCHREF:-$HOME/torchref}
PY=${PY:-$TORCHREF/.venv/bin/python}
B=${B:-target/release/brigade}
ROOF=${ROOF:-../shared/tools/roofline.py}
mkdir -p "$OUT"
for f in "$B" "$PY" "$TORCHREF/ddp_bench.py" "$ROOF"; do
  [ -e "$f" ] || { echo "error: $f not found (see the header of $0)" >&2; exit 2; }
done
uptime | tee "$OUT/loadavg-start.txt"

gpt=(--model gpt --batch-size 8 --optimizer adamw --lr 3e-4 --warmup 5 --steps 25 --threads-per-rank 1 --json)
mlp=(--model mlp --batch-size 64 --optimizer sgd --momentum 0 --lr 0.01 --warmup 5 --steps 25 --threads-per-rank 1 --json)
for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r: Brigade" >&2
  "$B" train "${gpt[@]}" --world-size 1 > "$OUT/brigade_gpt_ws1_$r.json"
  "$B" train "${gpt[@]}" --world-size 2 --bucket-mb 25 > "$OUT/brigade_gpt_ws2_$r.json"
  "$B" train "${mlp[@]}" --world-size 1 > "$OUT/brigade_mlp_ws1_$r.json"
  "$B" train "${mlp[@]}" --world-size 2 --bucket-mb 25 > "$OUT/brigade_mlp_ws2_$r.json"
  echo "== round $r: PyTorch (compute_only, ddp_ws2_b25 ...)" >&2
  (cd "$TORCHREF" && "$PY" ddp_bench.py --workload all --buckets 25 --tag "speed$r") > "$OUT/torch_$r.md"
  cp "$TORCHREF/results/ddp_bench_gpt_speed$r.json" "$TORCHREF/results/ddp_bench_mlp_speed$r.json" "$OUT/"
done

echo "== GEMM: numpy, then Brigade with numpy's medians of the same minute" >&2
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 "$ROOF" --n 1024 2048 --reps 7 --json > "$OUT/roofline.json"
np2=$(python3 -c "import json;d=json.load(open('$OUT/roofline.json'));print(','.join('%.1f'%g['gflops_median'] for g in d['gemm'] if g['threads']==2))")
np1=$(python3 -c "import json;d=json.load(open('$OUT/roofline.json'));print(','.join('%.1f'%g['gflops_median'] for g in d['gemm'] if g['threads']==1))")
"$B" bench gemm --shapes 1024x1024x1024,2048x2048x2048 --threads 2 --reps 15 --numpy-gflops "$np2" | tee "$OUT/gemm_2t.txt"
"$B" bench gemm --shapes 1024x1024x1024,2048x2048x2048 --threads 1 --reps 15 --numpy-gflops "$np1" | tee "$OUT/gemm_1t.txt"
"$B" bench gemm --shapes 64x2048x2048 --threads 1 --reps 15 | tee "$OUT/gemm_mlp_1t.txt"

echo "== per-op tables (Brigade A/B fused vs reference attention; PyTorch's profile)" >&2
"$B" bench ops --model gpt --threads 1 --warmup 3 --steps 10 --ab | tee "$OUT/ops_brigade_gpt.txt"
"$PY" scripts/torch_ops_profile.py --workload gpt --threads 1 --steps 10 --torchref "$TORCHREF" | tee "$OUT/ops_torch_gpt.txt"
uptime | tee "$OUT/loadavg-end.txt"

python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def brig(name, r):
    return json.load(open(f"{out}/brigade_{name}_{r}.json"))["median_step_ms"]
def torch(wl, cfg, r):
    rows = json.load(open(f"{out}/ddp_bench_{wl}_speed{r}.json"))["results"]
    return next(x["median_ms"] for x in rows if x["config"] == cfg)
print("\n| comparison | round | Brigade ms | PyTorch ms | ratio | goal |")
print("|---|---|---|---|---|---|")
for label, name, wl, cfg, goal in [
    ("GPT single process", "gpt_ws1", "gpt", "compute_only", "<= 0.8"),
    ("GPT DDP 2 ranks, 25 MB", "gpt_ws2", "gpt", "ddp_ws2_b25", "<= 0.8"),
    ("MLP single process", "mlp_ws1", "mlp", "compute_only", "-"),
    ("MLP DDP 2 ranks, 25 MB", "mlp_ws2", "mlp", "ddp_ws2_b25", "<= 0.7"),
]:
    ratios = []
    for r in range(1, rounds + 1):
        b, t = brig(name, r), torch(wl, cfg, r)
        ratios.append(b / t)
        print(f"| {label} | {r} | {b:.1f} | {t:.1f} | {b / t:.3f} | {goal} |")
    print(f"| {label} | median | | | **{statistics.median(ratios):.3f}** | {goal} |")
EOF
