#!/usr/bin/env bash
# The CPU's GEMM libraries and training steps against PyTorch in one sitting, printed as markdown
# for docs/BENCHMARKS.md: `brigade bench gemm` on oneDNN and on the `gemm` crate beside PyTorch's
# `a @ b` (1 and 2 threads, f32 and bf16, the issue's four shapes and the models' own), rounds
# interleaved, median of ROUNDS with the spread (min-max); then the DDP step at world 2 (MLP,
# GPT) against PyTorch DDP over gloo, and one process's step in f32 against bf16 on both sides.
# Every command is printed (stderr) before it runs. About 5 minutes on 2 quiet cores (15 on a
# machine at load average 10).
#
#   scripts/cpu-sitting.sh [OUT_DIR]      (from anywhere; nothing else running, ideally)
#
# Needs: a Rust toolchain (builds target/release/brigade), PyTorch in TORCHREF's venv (default
# /root/torchref/.venv/bin/python, with ddp_bench.py and workloads.py beside it: see
# ../shared/torchref/README.md), and oneDNN (`apt-get install libdnnl2`) for its rows.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d -t cpu-sitting.XXXXXX)}
ROUNDS=${ROUNDS:-7}
TORCHREF=${TORCHREF:-/root/torchref}
PY=${PY:-$TORCHREF/.venv/bin/python}
B=target/release/brigade
mkdir -p "$OUT"
run() { echo "+ $*" >&2; "$@"; }
for f in "$PY" "$TORCHREF/ddp_bench.py" "$TORCHREF/workloads.py"; do
  [ -e "$f" ] || { echo "error: $f not found (see the header of $0)" >&2; exit 2; }
done
run cargo build --release -q -p brigade-cli
load_start=$(uptime)

shapes=1024x1024x1024,64x2048x2048,1024x256x768,1024x1024x256,64x512x2048,2048x64x2048,1024x256x1024,256x1024x768
cat >"$OUT/torch_gemm.py" <<'EOF'
import json, statistics, sys, time
import torch
threads, shapes = int(sys.argv[1]), sys.argv[2].split(",")
torch.set_num_threads(threads)
rows = []
for s in shapes:
    m, k, n = map(int, s.split("x"))
    a, b = torch.randn(m, k), torch.randn(k, n)
    for name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        x, y = a.to(dt), b.to(dt)
        x @ y
        t = []
        for _ in range(5):
            t0 = time.perf_counter(); x @ y; t.append(time.perf_counter() - t0)
        rows.append({"shape": [m, k, n], "dtype": name, "gflops": 2 * m * k * n / statistics.median(t) / 1e9})
print(json.dumps(rows))
EOF
for r in $(seq 1 "$ROUNDS"); do
  for t in 1 2; do
    run env BRIGADE_GEMM=onednn "$B" bench gemm --shapes "$shapes" --threads $t --reps 5 --dtypes f32,bf16 --json \
      >"$OUT/gemm_onednn_t${t}_$r.json"
    run env BRIGADE_GEMM=gemm "$B" bench gemm --shapes "$shapes" --threads $t --reps 5 --json >"$OUT/gemm_crate_t${t}_$r.json"
    run "$PY" "$OUT/torch_gemm.py" $t "$shapes" >"$OUT/gemm_torch_t${t}_$r.json"
  done
done

# training steps: Brigade's commands as ../shared/torchref/README.md matches them to ddp_bench.py
gpt=(--model gpt --batch-size 8 --optimizer adamw --lr 3e-4 --untimed-steps 5 --steps 25 --json)
mlp=(--model mlp --batch-size 64 --optimizer sgd --momentum 0 --lr 0.01 --untimed-steps 5 --steps 25 --json)
for w in mlp gpt; do
  declare -n args=$w
  run env BRIGADE_GEMM=onednn "$B" train "${args[@]}" --world-size 2 --bucket-mb 25 >"$OUT/step_${w}_ws2_onednn.json"
  run env BRIGADE_GEMM=gemm "$B" train "${args[@]}" --world-size 2 --bucket-mb 25 >"$OUT/step_${w}_ws2_gemm.json"
  (cd "$TORCHREF" && run "$PY" ddp_bench.py --workload $w --buckets 25 --tag cpu-sitting) >/dev/null
  cp "$TORCHREF/results/ddp_bench_${w}_cpu-sitting.json" "$OUT/torch_ddp_$w.json"
  for p in f32 bf16; do
    run env BRIGADE_GEMM=onednn "$B" train "${args[@]}" --world-size 1 --threads-per-rank 1 --precision $p >"$OUT/step_${w}_ws1_$p.json"
  done
done
cat >"$OUT/torch_precision.py" <<'EOF'
import json, statistics, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from workloads import get_workload, train_step
torch.set_num_threads(1)
out = {}
for name in ["mlp", "gpt"]:
    wl = get_workload(name)
    model = wl.build_model(0)
    opt = wl.make_optimizer(model)
    batches = wl.make_batches(1000, 4)
    for prec in ["f32", "bf16"]:
        t = []
        for i in range(25):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16"):
                train_step(wl, model, opt, batches[i % 4])
            t.append(time.perf_counter() - t0)
        out[f"{name}_{prec}"] = statistics.median(t[5:]) * 1e3
print(json.dumps(out))
EOF
run "$PY" "$OUT/torch_precision.py" "$TORCHREF" >"$OUT/torch_precision.json"
load_end=$(uptime)

python3 - "$OUT" "$ROUNDS" "$load_start" "$load_end" <<'EOF'
import json, re, statistics, subprocess, sys, time
out, rounds, load0, load1 = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
field = lambda k: next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith(k + ":")), "?")
flags = field("Flags").split()
has = lambda f: "yes" if f in flags else "no"
la = lambda s: re.search(r"load average: (.*)", s).group(1)
print(f"### {field('Model name')} (family {field('CPU family')} model {field('Model')}), {field('CPU(s)')} CPUs; "
      f"avx512_bf16 {has('avx512_bf16')}, amx_bf16 {has('amx_bf16')}; {time.strftime('%Y-%m-%d', time.gmtime())}")
print(f"\nLoad average (1, 5, 15 min) at the start {la(load0)}, at the end {la(load1)}.")
def load(kind, t, r):
    return json.load(open(f"{out}/gemm_{kind}_t{t}_{r}.json"))
def series(kind, t, shape, dtype):
    v = []
    for r in range(1, rounds + 1):
        for row in load(kind, t, r):
            if row["shape"] == shape and row.get("dtype", "f32") == dtype:
                v.append(row["gflops"] if kind == "torch" else row["brigade_gflops"])
    return v
fmt = lambda v: f"{statistics.median(v):.1f} ({min(v):.0f}-{max(v):.0f})" if v else "-"
name = load("onednn", 1, 1)[0]["cpu_gemm"]
print(f"\nGEMM, GFLOP/s, median of {rounds} interleaved rounds (min-max), each round's figure the median of 5 calls. "
      f"Brigade on oneDNN: `{name}`.\n")
print("| m×k×n | threads | dtype | Brigade, oneDNN | Brigade, gemm crate | PyTorch `a @ b` | oneDNN / PyTorch |")
print("|---|---|---|---|---|---|---|")
for t in (1, 2):
    for row in load("onednn", t, 1):
        shape, dt = row["shape"], row["dtype"]
        o, g, p = series("onednn", t, shape, dt), series("crate", t, shape, dt), series("torch", t, shape, dt)
        ratio = statistics.median(o) / statistics.median(p)
        print(f"| {'×'.join(map(str, shape))} | {t} | {dt} | {fmt(o)} | {fmt(g)} | {fmt(p)} | {ratio:.2f} |")
step = lambda f: json.load(open(f"{out}/{f}.json"))["median_step_ms"]
def torch_cfg(w, cfg):
    return next(x["median_ms"] for x in json.load(open(f"{out}/torch_ddp_{w}.json"))["results"] if x["config"] == cfg)
tp = json.load(open(f"{out}/torch_precision.json"))
print("\nTraining steps, median ms (25 steps, the first 5 untimed; one thread per rank).\n")
print("| step | Brigade, oneDNN | Brigade, gemm crate | PyTorch | Brigade (oneDNN) / PyTorch |")
print("|---|---|---|---|---|")
for w in ("mlp", "gpt"):
    b, g, p = step(f"step_{w}_ws2_onednn"), step(f"step_{w}_ws2_gemm"), torch_cfg(w, "ddp_ws2_b25")
    print(f"| {w.upper()} DDP world 2, bucket 25 MB (PyTorch: gloo) | {b:.1f} | {g:.1f} | {p:.1f} | {b / p:.2f} |")
print("\nOne process, one thread: f32 against bf16 (Brigade `--precision bf16`, PyTorch `autocast(bfloat16)`), median ms.\n")
print("| model | Brigade f32 | Brigade bf16 | bf16 / f32 | PyTorch f32 | PyTorch bf16 | bf16 / f32 |")
print("|---|---|---|---|---|---|---|")
for w in ("mlp", "gpt"):
    f, h = step(f"step_{w}_ws1_f32"), step(f"step_{w}_ws1_bf16")
    pf, ph = tp[f"{w}_f32"], tp[f"{w}_bf16"]
    print(f"| {w.upper()} | {f:.1f} | {h:.1f} | {h / f:.2f} | {pf:.1f} | {ph:.1f} | {ph / pf:.2f} |")
print(f"\n(raw outputs: {out})")
EOF
