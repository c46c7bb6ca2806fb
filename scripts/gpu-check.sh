#!/usr/bin/env bash
# The prepared first run of Brigade's CUDA backend on a GPU machine (issue 9, part 5).
#
# Builds nothing: the GPU machine has no Rust toolchain. Run scripts/gpu-build.sh here first;
# it fills gpu-carry/ (git-ignored) with the release test binaries, the brigade binary and
# PyTorch's reference GPT. On the device:  scripts/gpu-check.sh   (carry: ["gpu-carry"])
#
# Finds libcublas, libnvrtc and libnccl in python3's nvidia/*/lib wheels, runs every device
# test (each kernel and its backward against the CPU), the GEMM benchmark (Brigade vs direct
# cuBLAS at 4096^3, f32 and bf16), PyTorch's GEMM and GPT step, the GPT's CPU-vs-CUDA loss
# parity (20 steps) and Brigade's GPT step on the GPU beside PyTorch's;
# writes everything to $OUT (summary.txt first). Whole run bounded to under 8 minutes.
# Issue 10: NCCL at world size 1 vs host-staged DDP, two ranks host-staged on the one GPU vs
# world size 1, overlap read from the CUDA-event times in the NCCL run's trace, step times.
# `--dry-run` stops after finding the libraries (what a CPU machine can check).
# GPU_CHECK_SECTIONS=tests,gemm,torch,nccl (default: all) runs only those sections.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
CARRY=${BRIGADE_CARRY:-gpu-carry}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
say() { echo "$*" | tee -a "$SUMMARY"; }
# want SECTION: whether GPU_CHECK_SECTIONS (comma-separated, default all) asks for it.
want() { [[ ",${GPU_CHECK_SECTIONS:-all}," == *",all,"* || ",${GPU_CHECK_SECTIONS:-all}," == *",$1,"* ]]; }
# Seconds left of the 450 s budget (8 minutes minus a margin for the copy back).
left() { echo $((450 - (SECONDS - START))); }
# run NAME LIMIT CMD...: bounded by LIMIT and by what is left of the budget; logs to $OUT/NAME.log.
run() {
  local name=$1 limit=$2
  shift 2
  local l
  l=$(left)
  [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -le 5 ]; then
    say "SKIPPED $name: the 8-minute budget is spent"
    FAILED=1
    return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then say "PASS $name ($((SECONDS - t0)) s)"; else
    local why="exit $rc"
    [ $rc -eq 124 ] && why="timed out after ${limit} s"
    say "FAIL $name: $why after $((SECONDS - t0)) s; see $name.log"
    FAILED=1
  fi
}

say "== gpu-check $(date -u +%FT%TZ), carry: $CARRY ($(cat "$CARRY/COMMIT" 2>/dev/null || echo 'no COMMIT: run scripts/gpu-build.sh'))"
if [ ! -d "$CARRY/tests" ]; then
  say "ERROR: $CARRY/tests is missing: run scripts/gpu-build.sh on the build machine and carry $CARRY"
  exit 1
fi

# ---- CUDA libraries from python3's nvidia wheels
NV=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null)
if [ -z "$NV" ]; then
  say "ERROR: python3 has no 'nvidia' package: no CUDA wheels (cuBLAS, NVRTC, NCCL) to load"
  exit 1
fi
for d in "$NV"/*/lib; do LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; done
# NCCL's wheel ships only libnccl.so.2; cudarc opens libnccl.so: a link in a folder of our own.
NCCL_LINKS="$OUT/.nccl-link"
mkdir -p "$NCCL_LINKS"
NCCL=$(find "$NV" -name 'libnccl.so.2' | head -n 1)
[ -n "$NCCL" ] && ln -sf "$NCCL" "$NCCL_LINKS/libnccl.so"
export LD_LIBRARY_PATH="$NCCL_LINKS:$LD_LIBRARY_PATH"
for lib in libcublas.so libnvrtc.so libnccl.so; do
  hit=$(find "$NV" "$NCCL_LINKS" -name "$lib*" 2>/dev/null | head -n 1)
  if [ -n "$hit" ]; then say "found $lib: $hit"; else
    say "MISSING $lib under $NV/*/lib"
    FAILED=1
  fi
done
if command -v nvidia-smi >/dev/null; then nvidia-smi -L >"$OUT/gpu.txt" 2>&1; else echo "nvidia-smi: not installed" >"$OUT/gpu.txt"; fi
sed 's/^/gpu: /' "$OUT/gpu.txt" | tee -a "$SUMMARY"

if [ "${1:-}" = "--dry-run" ]; then
  say "DRY RUN: stopping before the first step that needs a GPU"
  exit $FAILED
fi

# ---- every device test: each kernel, forward and backward, against the CPU
export BRIGADE_REQUIRE_CUDA=1
if want tests; then
for t in cuda_probe cuda_nvrtc cuda_ops; do
  run "test-$t" 200 "$CARRY/tests/tensor" --test-threads=1 "$t::"
done
fi

# ---- GEMM: Brigade vs direct cuBLAS, 4096^3, f32 and bf16 (goal: >= 0.95x)
if want gemm; then
BRIGADE_BENCH_OUT="$OUT/gemm_brigade.json" run bench-gemm 90 "$CARRY/tests/tensor" --ignored --test-threads=1 cuda_bench::gemm_4096
if [ -f "$OUT/gemm_brigade.json" ]; then say "gemm (Brigade vs cuBLAS): $(cat "$OUT/gemm_brigade.json")"; else
  say "FAIL bench-gemm wrote no numbers"
  FAILED=1
fi
fi

# ---- PyTorch on the same GPU: the same GEMMs, and the GPT step of the issue
cat >"$OUT/torch_side.py" <<'PY'
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
out = {}
torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default: true f32
def bench(f, reps=10):
    for _ in range(3): f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
    return sorted(ts)[reps // 2]
n = 4096
for dt in (torch.float32, torch.bfloat16):
    a = torch.randn(n, n, device="cuda", dtype=dt); b = torch.randn(n, n, device="cuda", dtype=dt)
    s = bench(lambda: a @ b)
    out[f"torch_gemm_{str(dt).split('.')[-1]}"] = {"s": s, "tflops": 2 * n**3 / s / 1e12}
try:
    import workloads
    torch.manual_seed(0)
    cfg = dict(vocab=256, d=768, n_layers=12, n_heads=12, d_ff=3072, ctx=128)
    model = workloads.GPT(**cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 256, (64, 129), device="cuda")
    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1))
        loss.backward(); opt.step()
    s = bench(step, reps=10)
    nparams = sum(p.numel() for p in model.parameters())
    tokens = 64 * 128
    # 6 N per token for the weights, plus attention's 12 L T d per token (fwd+bwd)
    flops = 6 * nparams * tokens + 12 * cfg["n_layers"] * 128 * cfg["d"] * tokens
    out["torch_gpt_step"] = {"s": s, "params": nparams, "tflops": flops / s / 1e12, "config": cfg, "batch": [64, 128]}
except Exception as e:  # the GEMM numbers above still count
    out["torch_gpt_step"] = {"error": repr(e)}
print(json.dumps(out))
json.dump(out, open(sys.argv[2], "w"), indent=1)
PY
if want torch; then
run torch-side 150 python3 "$OUT/torch_side.py" "$CARRY" "$OUT/torch.json"
[ -f "$OUT/torch.json" ] && say "pytorch: $(tr -d '\n' <"$OUT/torch.json")"
fi

# ---- NCCL (issue 10). One GPU only: NCCL refuses two ranks on one device, so the checks
# are NCCL at world size 1, and two ranks on the one GPU through the host-staged path.
if want nccl; then
B="$CARRY/brigade"
GPT=(--model gpt --steps 20 --seed 3 --lr 1e-3 --optimizer adamw --device cuda --bucket-mb 4 --quiet --json)
run nccl-world1 120 "$B" train "${GPT[@]}" --backend nccl --world-size 1 --batch-size 16 \
  --losses "$OUT/nccl1.csv" --timeline "$OUT/nccl1.trace.json"
run staged-world1 120 "$B" train "${GPT[@]}" --backend thread --world-size 1 --batch-size 16 --losses "$OUT/staged1.csv"
run staged-world2 120 "$B" train "${GPT[@]}" --backend thread --world-size 2 --batch-size 8 --losses "$OUT/staged2.csv"
python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import csv, json, os, sys
out = sys.argv[1]
def losses(name):
    p = os.path.join(out, name)
    return [float(r["loss"]) for r in csv.DictReader(open(p))] if os.path.exists(p) else None
def compare(what, a, b, tol):
    la, lb = losses(a), losses(b)
    if not la or not lb or len(la) != len(lb):
        print(f"FAIL {what}: missing or unequal loss files ({a}, {b})"); return
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(la, lb))
    print(f"{'PASS' if worst <= tol else 'FAIL'} {what}: worst relative loss difference {worst:.2e} (tolerance {tol:g}) over {len(la)} steps")
# With one rank the average is the identity: NCCL must give exactly what DDP without a peer gives.
compare("NCCL world 1 == host-staged world 1 (no peer: DDP reduces nothing)", "nccl1.csv", "staged1.csv", 1e-6)
compare("2 ranks host-staged on one GPU == world 1 on the whole batch", "staged2.csv", "staged1.csv", 1e-4)
# Overlap from GPU clocks: a bucket's collective started on the comm stream before the compute
# stream reached the last bucket's ready event (backward kernels were still running).
p = os.path.join(out, "nccl1.trace.json")
if not os.path.exists(p):
    print("FAIL nccl trace: no trace written")
else:
    t = json.load(open(p)); ev = t["traceEvents"] if isinstance(t, dict) else t
    spans = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "comm"]
    ready = {e["args"]["tag"]: e["ts"] for e in spans if e["args"].get("op") == "ready"}
    colls = [e for e in spans if e["args"].get("op") == "all_reduce" and e["args"].get("tag", "").startswith("bucket")]
    if not ready or not colls:
        print(f"FAIL nccl trace: {len(ready)} ready events, {len(colls)} collectives on the GPU clock")
    else:
        last_ready = max(ready.values())
        early = [e["args"]["tag"] for e in colls if e["ts"] < last_ready]
        print(f"{'PASS' if early else 'NO OVERLAP'} nccl trace: {len(early)} of {len(colls)} bucket collectives started on the comm stream before the last bucket was ready on the compute stream")
PY
for f in nccl-world1 staged-world1 staged-world2; do
  [ -f "$OUT/$f.log" ] && say "$f: $(grep -h '^{' "$OUT/$f.log" | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print("median step", d["median_step_ms"], "ms, last loss", d["last_loss"])' 2>/dev/null)"
done
say "NOT MEASURED: step time without DDP (brigade train has no compute-only flag; brigade sweep's compute-only row is the baseline once sweep takes --device cuda)"
fi

# ---- parity: the GPT, 20 steps, same seed and data, CPU vs CUDA: losses within 1e-3 relative
PARITY="--model gpt --steps 20 --seed 0 --world-size 1 --quiet"
run gpt-cpu 120 "$CARRY/brigade" train $PARITY --device cpu --losses "$OUT/gpt_cpu_losses.csv"
run gpt-cuda 120 "$CARRY/brigade" train $PARITY --device cuda --losses "$OUT/gpt_cuda_losses.csv"
if [ -f "$OUT/gpt_cpu_losses.csv" ] && [ -f "$OUT/gpt_cuda_losses.csv" ]; then
  if python3 - "$OUT/gpt_cpu_losses.csv" "$OUT/gpt_cuda_losses.csv" >"$OUT/parity.txt" 2>&1 <<'PY'
import sys
def rows(p):
    return [float(l.split(",")[1]) for l in open(p).read().split("\n")[1:] if l.strip()]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
print(f"{len(a)} cpu / {len(b)} cuda losses; first {a[0]:.6f} vs {b[0]:.6f}; last {a[-1]:.6f} vs {b[-1]:.6f}; worst relative difference {worst:.2e}")
sys.exit(0 if len(a) == len(b) == 20 and worst <= 1e-3 else 1)
PY
  then say "PASS parity CPU vs CUDA: $(cat "$OUT/parity.txt")"; else
    say "FAIL parity CPU vs CUDA: $(cat "$OUT/parity.txt")"
    FAILED=1
  fi
else
  say "FAIL parity CPU vs CUDA: a run wrote no losses (see gpt-cpu.log, gpt-cuda.log)"
  FAILED=1
fi

# ---- Brigade's GPT step on the GPU beside PyTorch's (above): goal <= 1.3x PyTorch's step
GPT_STEP="--model gpt --d-model 768 --layers 12 --heads 12 --d-ff 3072 --context 128 --batch-size 64 --optimizer adamw --lr 3e-4"
run gpt-step 150 "$CARRY/brigade" train $GPT_STEP --steps 12 --warmup 2 --world-size 1 --device cuda --json --quiet
if [ -f "$OUT/torch.json" ] && grep -q median_step_ms "$OUT/gpt-step.log"; then
  python3 - "$OUT/gpt-step.log" "$OUT/torch.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
log = open(sys.argv[1]).read()
b = json.loads(log[log.index("{"):log.rindex("}") + 1])
t = json.load(open(sys.argv[2])).get("torch_gpt_step", {})
ms = b["median_step_ms"]
if "s" in t:
    tflops = t["tflops"] * t["s"] * 1e3 / ms
    print(f"gpt step (64x128, d 768, 12 layers): brigade {ms:.1f} ms ({tflops:.1f} TFLOP/s), pytorch {t['s'] * 1e3:.1f} ms; ratio {ms / (t['s'] * 1e3):.2f}x (goal <= 1.3x)")
else:
    print(f"gpt step: brigade {ms:.1f} ms; pytorch's side failed: {t}")
PY
fi

# ---- the CLI's own GEMM table on the GPU (bench gemm --device cuda)
run cli-bench-gemm 60 "$CARRY/brigade" bench gemm --device cuda --shapes 4096x4096x4096,64x2048x2048 --dtypes f32,bf16 --reps 10

say "== done in $((SECONDS - START)) s; $( [ $FAILED -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED' )"
exit $FAILED
