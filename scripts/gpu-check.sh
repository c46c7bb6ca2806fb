#!/usr/bin/env bash
# The first run of Brigade's CUDA backend on a GPU machine: one command, started cold, done in
# at most 8 minutes, whose verdict can be trusted.
#
# Builds nothing (the GPU machine has no Rust toolchain): run scripts/gpu-build.sh HERE first; it
# fills gpu-carry/ (git-ignored) with the binaries (glibc >= 2.28), the GPT's CPU reference
# losses and PyTorch's reference model. On the device:   scripts/gpu-check.sh   (carry gpu-carry)
#
# Writes $OUT/summary.txt (default gpu-check-out/) line by line, each line the moment its check
# finishes, so a run cut off by its time limit still reports what it did:
#   PASS|FAIL|MISS <check>: <number>       FAIL also appends the last 20 lines of its log
# FAIL: something is wrong (every failing comparison fails the run: exit 1). MISS: the numbers
# are right but a speed goal was not reached (reported, exit 0).
#
# Order (the environment first, then the verdict checks, cheapest first, within the first 5
# minutes and a tenth; then the numbers):
#   env        driver, CUDA, NCCL, PyTorch, glibc; the comparison code's own tests
#   start      every carried binary starts (and the glibc it needs)
#   probe      cuda:0 opens (BRIGADE_REQUIRE_CUDA=1: a skip is a failure); NVRTC compiles here
#   ops        every op, forward and backward, CPU vs CUDA, f32 and f64 (tests/tensor cuda_ops::)
#              (sort, topk, gather, scatter-add: values and indices bit for bit, NaNs included)
#   half       every op in bf16 and f16 on cuda:0 (computed in f32, each output rounded once)
#              against f64 on the same rounded inputs: within one ulp (tests/tensor half_ops::)
#   parity     the GPT's losses on CUDA vs the CPU reference computed at build time (SGD, 3e-4)
#   ckpt       the GPT on CUDA with every block's activations checkpointed (recomputed in
#              backward) against the same run without: the same losses (SGD, 1e-6)
#   nccl       NCCL world 1 vs host-staged world 1, host-staged world 2 vs world 1 (SGD, 1e-5)
#   overlap    NCCL world 1 under a simulated 10 Gb/s link (a delay kernel per collective on the
#              comm stream): fails unless bucket collectives interleave with backward spans on the
#              GPU clock; the step beside `brigade predict` on the same profile (PASS/MISS)
#   policies   each reducer policy (fp16, bf16, PowerSGD 1@2, ZeRO-1, ZeRO-2) on NCCL world 1
#              under the simulated link: its losses against the same policy host-staged at world
#              1 (SGD, 1e-5), and its bucket reductions interleaving with backward on the GPU clock
#   zero3      ZeRO-3 (parameters gathered per unit, gradients reduce-scattered, both on the comm
#              stream behind events; units freed on the device) on NCCL world 1 against ZeRO-3
#              host-staged at world 1 and against plain DDP on NCCL world 1 (SGD, 1e-5); its memory
#              line must show units gathered and freed: gathered peak above 0, below the parameters
#   mixed      the GPT under --precision bf16 and fp16 (loss scaling) on CUDA, f32 master weights
#              on the device, against the same runs on the CPU at build time (AdamW, 1e-2)
#   gemm       Brigade's GEMM vs cuBLAS, 4096^3, f32 and bf16: outputs compared (FAIL), speed
#              >= 0.95x (PASS/MISS)
#   step       the GPT step (d 768, 12 layers, 64x128 tokens, AdamW, f32, TF32 off) vs PyTorch
#              eager on the same GPU: <= 1.1x (PASS/MISS); and under --precision bf16 vs PyTorch's
#              autocast(bfloat16) step with f32 weights: <= 1.1x (PASS/MISS)
#
#   --dry-run  (on any machine) the environment, every carried binary started with the glibc
#              it needs, and the budget of each section; runs nothing that needs a GPU
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
CARRY=${BRIGADE_CARRY:-gpu-carry}
OUT=${OUT:-$PWD/gpu-check-out}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
PY=python3
B="$CARRY/bin/brigade"
T="$CARRY/tests/tensor"

# Budgets: seconds from the start by which each section must be done (the verdict checks by
# 310 s, everything by 480 s = 8 minutes).
SECTIONS="env:30 start:40 probe:75 ops:125 half:140 parity:160 ckpt:180 nccl:210 overlap:235 policies:270 zero3:290 mixed:310 gemm:355 step:480"
deadline() { for s in $SECTIONS; do [ "${s%%:*}" = "$1" ] && echo "${s##*:}"; done; }

say() { echo "$*" | tee -a "$SUMMARY"; }
# record STATUS NAME TEXT [LOG]: one summary line now; a FAIL appends its log's last 20 lines.
record() {
  say "$1 $2: $3"
  if [ "$1" = FAIL ]; then
    FAILED=1
    if [ -n "${4:-}" ] && [ -f "$4" ]; then
      tail -n 20 "$4" | sed 's/^/    | /' | tee -a "$SUMMARY"
    fi
  fi
}
# run SECTION NAME CMD...: CMD with its output in $OUT/NAME.log, bounded by what is left of
# SECTION's budget; returns CMD's status (124: out of time).
run() {
  local section=$1 name=$2
  shift 2
  local left=$(($(deadline "$section") - (SECONDS - START)))
  if [ "$left" -le 2 ]; then
    echo "no time left in section $section" >"$OUT/$name.log"
    return 124
  fi
  timeout --kill-after=5 "$left" "$@" >"$OUT/$name.log" 2>&1
}
# judge NAME LOG CMD...: runs a comparison of scripts/gpu_check.py; its line goes to the summary.
judge() {
  local name=$1 log=$2
  shift 2
  local line
  line=$("$PY" scripts/gpu_check.py "$@" 2>&1 | tail -n 1)
  case "$line" in
    PASS*) say "$line" ;;
    MISS*) say "$line" ;;
    *)
      say "${line:-FAIL $name: the comparison printed nothing}"
      FAILED=1
      [ -f "$log" ] && tail -n 20 "$log" | sed 's/^/    | /' | tee -a "$SUMMARY"
      ;;
  esac
}
# ran NAME STATUS LOG: FAIL line for a command that did not finish (or failed).
ran() {
  if [ "$2" -eq 0 ]; then return 0; fi
  local why="exit $2"
  [ "$2" -eq 124 ] && why="out of time (its section's budget is spent)"
  record FAIL "$1" "$why" "$3"
  return 1
}

say "== gpu-check $(date -u +%FT%TZ) on $(hostname), carry $CARRY: $(head -1 "$CARRY/COMMIT" 2>/dev/null || echo 'none: run scripts/gpu-build.sh')"

# ---- env: the CUDA libraries from python3's nvidia wheels; the machine; the comparison code
NV=$("$PY" -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null)
if [ -n "$NV" ]; then
  for d in "$NV"/*/lib; do LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; done
  # NCCL's wheel ships only libnccl.so.2; cudarc opens libnccl.so: a link in a folder of our own
  mkdir -p "$OUT/.nccl-link"
  NCCL=$(find "$NV" -name 'libnccl.so.2' 2>/dev/null | head -n 1)
  [ -n "$NCCL" ] && ln -sf "$NCCL" "$OUT/.nccl-link/libnccl.so"
  export LD_LIBRARY_PATH="$OUT/.nccl-link:$LD_LIBRARY_PATH"
fi
"$PY" scripts/gpu_check.py env 2>&1 | tee -a "$SUMMARY"
for lib in libcublas.so libnvrtc.so libnccl.so; do
  hit=$(find ${NV:+"$NV"} "$OUT/.nccl-link" -name "$lib*" 2>/dev/null | head -n 1)
  if [ -n "$hit" ]; then say "env $lib: $hit"; else say "env $lib: not found under ${NV:-python3 nvidia wheels (none found)}"; fi
done
if run env selftest "$PY" scripts/test_gpu_check.py; then
  record PASS comparison-code "scripts/test_gpu_check.py: each comparison fails on its doctored input"
else
  record FAIL comparison-code "scripts/test_gpu_check.py failed: no verdict below can be trusted" "$OUT/selftest.log"
fi
# Kernels compile once per machine, not once per process.
export BRIGADE_KERNEL_CACHE="$OUT/kernel-cache"

# ---- start: every carried binary starts, and the glibc it needs
if [ ! -x "$B" ] || [ ! -x "$T" ]; then
  record FAIL start "$B or $T is missing: run scripts/gpu-build.sh on the build machine and carry $CARRY"
  exit 1
fi
"$PY" scripts/gpu_check.py glibc "$B" "$T" 2>&1 | sed 's/^/start /' | tee -a "$SUMMARY"
ok=1
run start start-brigade "$B" --version || ok=0
run start start-tests "$T" --list || ok=0
if [ $ok -eq 1 ]; then
  record PASS start "brigade $(head -1 "$OUT/start-brigade.log"); tests/tensor lists $(grep -c ': test' "$OUT/start-tests.log") tests"
else
  record FAIL start "a carried binary does not start here" "$OUT/start-brigade.log"
  tail -n 5 "$OUT/start-tests.log" | sed 's/^/    | /' | tee -a "$SUMMARY"
  exit 1
fi

if [ $DRY -eq 1 ]; then
  prev=0
  for s in $SECTIONS; do
    say "budget ${s%%:*}: $((${s##*:} - prev)) s (done by ${s##*:} s)"
    prev=${s##*:}
  done
  say "DRY RUN: stopping before the first step that needs a GPU ($((SECONDS - START)) s)"
  exit $FAILED
fi

export BRIGADE_REQUIRE_CUDA=1
# ---- probe: the GPU opens; NVRTC (this machine's, no newer than its driver) compiles every file
for t in cuda_probe cuda_nvrtc; do
  run probe "test-$t" "$T" --test-threads=4 "$t::"
  rc=$?
  if [ $rc -eq 0 ]; then
    record PASS "$t" "$(grep -o '[0-9]* passed' "$OUT/test-$t.log" | tail -1)"
  else ran "$t" $rc "$OUT/test-$t.log"; fi
done

# ---- ops: every op forward and backward on cuda:0 against the CPU, f32 and f64 (NaN rules too)
run ops test-cuda_ops "$T" --test-threads=4 --nocapture cuda_ops::
rc=$?
if [ $rc -eq 0 ]; then
  worst=$(grep -o 'worst |diff| [0-9.e+-]*' "$OUT/test-cuda_ops.log" | awk '{print $3}' | sort -g | tail -1)
  record PASS ops "$(grep -c '^cuda:0 ' "$OUT/test-cuda_ops.log") op outputs within tolerance (worst |diff| ${worst:-?}); $(grep -o '[0-9]* passed' "$OUT/test-cuda_ops.log" | tail -1)"
else ran ops $rc "$OUT/test-cuda_ops.log"; fi

# ---- half: every op in bf16 and f16 on cuda:0 against f64 on the same rounded inputs
run half test-half_ops "$T" --test-threads=4 half_ops::
rc=$?
if [ $rc -eq 0 ]; then
  record PASS half "bf16 and f16 ops on cuda:0 within one ulp of f64; $(grep -o '[0-9]* passed' "$OUT/test-half_ops.log" | tail -1)"
else ran half $rc "$OUT/test-half_ops.log"; fi

# ---- parity: the GPT on CUDA against its CPU losses computed at build time (SGD, no momentum)
GPT_SGD=$(cat "$CARRY/ref/gpt_sgd.args" 2>/dev/null)
if [ -z "$GPT_SGD" ]; then
  record FAIL parity "$CARRY/ref/gpt_sgd.args is missing (run scripts/gpu-build.sh)"
else
  # shellcheck disable=SC2086
  run parity parity-cuda "$B" train $GPT_SGD --device cuda --quiet --losses "$OUT/gpt_sgd_cuda.csv"
  rc=$?
  ran parity $rc "$OUT/parity-cuda.log" &&
    judge parity "$OUT/parity-cuda.log" losses "parity CUDA vs CPU reference ($(cat "$CARRY/ref/cpu.txt" 2>/dev/null | sed 's/.*: *//'))" \
      "$OUT/gpt_sgd_cuda.csv" "$CARRY/ref/gpt_sgd_cpu.csv" 3e-4
fi

# ---- ckpt: activation checkpointing on the GPU: the recompute in backward gives the same losses
CKPT_GPT=(--model gpt --steps 6 --seed 3 --optimizer sgd --lr 0.05 --momentum 0 --device cuda --batch-size 16 --quiet)
run ckpt ckpt-off "$B" train "${CKPT_GPT[@]}" --losses "$OUT/ckpt-off.csv"
r1=$?
run ckpt ckpt-on "$B" train "${CKPT_GPT[@]}" --activation-checkpointing 1 --losses "$OUT/ckpt-on.csv"
r2=$?
if ran ckpt-off $r1 "$OUT/ckpt-off.log" && ran ckpt-on $r2 "$OUT/ckpt-on.log"; then
  judge ckpt "$OUT/ckpt-on.log" losses "activation checkpointing on CUDA == without (recomputed blocks)" \
    "$OUT/ckpt-on.csv" "$OUT/ckpt-off.csv" 1e-6
fi

# ---- nccl: one GPU, so NCCL runs at world size 1; two ranks share the GPU host-staged
NCCL_GPT=(--model gpt --steps 20 --seed 3 --optimizer sgd --lr 0.05 --momentum 0 --device cuda --bucket-mb 4 --quiet)
run nccl nccl-world1 "$B" train "${NCCL_GPT[@]}" --backend nccl --world-size 1 --batch-size 16 --losses "$OUT/nccl1.csv"
r1=$?
run nccl staged-world1 "$B" train "${NCCL_GPT[@]}" --backend thread --world-size 1 --batch-size 16 --losses "$OUT/staged1.csv"
r2=$?
run nccl staged-world2 "$B" train "${NCCL_GPT[@]}" --backend thread --world-size 2 --batch-size 8 --losses "$OUT/staged2.csv"
r3=$?
if ran nccl-world1 $r1 "$OUT/nccl-world1.log" && ran staged-world1 $r2 "$OUT/staged-world1.log"; then
  judge nccl-vs-staged "$OUT/nccl-world1.log" losses "NCCL world 1 == host-staged world 1" \
    "$OUT/nccl1.csv" "$OUT/staged1.csv" 1e-5
fi
if ran staged-world2 $r3 "$OUT/staged-world2.log" && [ $r2 -eq 0 ]; then
  judge world2-vs-world1 "$OUT/staged-world2.log" losses "host-staged world 2 == world 1 on the whole batch" \
    "$OUT/staged2.csv" "$OUT/staged1.csv" 1e-5
fi

# ---- overlap: a simulated 10 Gb/s link on the one GPU; the bucket spans on the GPU clock
LINK=(--net-gbps 10 --net-latency-us 20)
run overlap overlap-nccl "$B" train --model gpt --steps 6 --warmup 2 --seed 3 --optimizer sgd --lr 0.05 --momentum 0 \
  --device cuda --backend nccl --world-size 1 --batch-size 16 --bucket-mb 1 --first-bucket-mb 1 "${LINK[@]}" \
  --timeline "$OUT/overlap.trace.json" --profile "$OUT/overlap.profile.json" --json --quiet
rc=$?
if ran overlap $rc "$OUT/overlap-nccl.log"; then
  judge overlap "$OUT/overlap-nccl.log" overlap "overlap (NCCL world 1, simulated link)" "$OUT/overlap.trace.json"
  run overlap overlap-predict "$B" predict --profile "$OUT/overlap.profile.json" "${LINK[@]}" --world-size 2 \
    --bucket-mb 1 --first-bucket-mb 1 --json
  "$PY" scripts/gpu_check.py predict "step vs brigade predict (same profile, world 2 link)" "$OUT/overlap-nccl.log" \
    "$OUT/overlap-predict.log" 2>&1 | tail -n 1 | tee -a "$SUMMARY"
fi

# ---- policies: every built-in reducer policy on the NCCL comm stream (world 1, simulated link)
# against the same policy host-staged; its bucket reductions (compute and collectives on the comm
# stream) must interleave with backward on the GPU clock
POLICY_GPT=(--model gpt --steps 6 --seed 3 --optimizer sgd --lr 0.05 --momentum 0 --device cuda --world-size 1
  --batch-size 16 --bucket-mb 1 --first-bucket-mb 1 --quiet)
POLICIES=("fp16:--policy fp16" "bf16:--policy bf16"
  "powersgd:--policy powersgd --powersgd-rank 1 --powersgd-start-iter 2" "zero1:--zero 1" "zero2:--zero 2")
for entry in "${POLICIES[@]}"; do
  name=${entry%%:*}
  read -r -a flags <<<"${entry#*:}"
  run policies "policy-$name-nccl" "$B" train "${POLICY_GPT[@]}" "${flags[@]}" --backend nccl "${LINK[@]}" \
    --timeline "$OUT/policy-$name.trace.json" --losses "$OUT/policy-$name-nccl.csv"
  r1=$?
  run policies "policy-$name-staged" "$B" train "${POLICY_GPT[@]}" "${flags[@]}" --backend thread \
    --losses "$OUT/policy-$name-staged.csv"
  r2=$?
  if ran "policy-$name-nccl" $r1 "$OUT/policy-$name-nccl.log" &&
    ran "policy-$name-staged" $r2 "$OUT/policy-$name-staged.log"; then
    judge "policy-$name" "$OUT/policy-$name-nccl.log" losses "policy $name: NCCL world 1 == host-staged world 1" \
      "$OUT/policy-$name-nccl.csv" "$OUT/policy-$name-staged.csv" 1e-5
    judge "policy-$name-overlap" "$OUT/policy-$name-nccl.log" overlap "policy $name: overlap (NCCL world 1, simulated link)" \
      "$OUT/policy-$name.trace.json"
  fi
done

# ---- zero3: ZeRO-3's gathers and reduce-scatters on the NCCL comm stream (world 1) against the
# same run host-staged and against plain DDP on NCCL; its memory line shows units freed
ZERO3_GPT=(--model gpt --steps 6 --seed 3 --optimizer sgd --lr 0.05 --momentum 0 --device cuda --world-size 1
  --batch-size 16 --quiet)
run zero3 zero3-nccl "$B" train "${ZERO3_GPT[@]}" --zero 3 --backend nccl --json --losses "$OUT/zero3-nccl.csv"
r1=$?
run zero3 zero3-staged "$B" train "${ZERO3_GPT[@]}" --zero 3 --backend thread --losses "$OUT/zero3-staged.csv"
r2=$?
run zero3 zero3-plain "$B" train "${ZERO3_GPT[@]}" --backend nccl --losses "$OUT/zero3-plain.csv"
r3=$?
if ran zero3-nccl $r1 "$OUT/zero3-nccl.log"; then
  judge zero3-units "$OUT/zero3-nccl.log" zero3 "zero3: units gathered and freed on the device (NCCL world 1)" \
    "$OUT/zero3-nccl.log"
  ran zero3-staged $r2 "$OUT/zero3-staged.log" &&
    judge zero3-vs-staged "$OUT/zero3-nccl.log" losses "zero3: NCCL world 1 == host-staged world 1" \
      "$OUT/zero3-nccl.csv" "$OUT/zero3-staged.csv" 1e-5
  ran zero3-plain $r3 "$OUT/zero3-plain.log" &&
    judge zero3-vs-plain "$OUT/zero3-nccl.log" losses "zero3 == plain DDP (NCCL world 1)" \
      "$OUT/zero3-nccl.csv" "$OUT/zero3-plain.csv" 1e-5
fi

# ---- mixed: bf16 and fp16 (loss scaling) on CUDA against the CPU's runs at build time
MIXED=$(cat "$CARRY/ref/gpt_mixed.args" 2>/dev/null)
if [ -z "$MIXED" ]; then
  record FAIL mixed "$CARRY/ref/gpt_mixed.args is missing (run scripts/gpu-build.sh)"
else
  for p in bf16 fp16; do
    # shellcheck disable=SC2086
    run mixed "mixed-$p" "$B" train $MIXED --precision "$p" --device cuda --quiet --losses "$OUT/gpt_${p}_cuda.csv"
    rc=$?
    ran "mixed-$p" $rc "$OUT/mixed-$p.log" &&
      judge "mixed-$p" "$OUT/mixed-$p.log" losses "mixed $p: CUDA vs CPU reference (f32 masters, AdamW)" \
        "$OUT/gpt_${p}_cuda.csv" "$CARRY/ref/gpt_${p}_cpu.csv" 1e-2
  done
fi

# ---- gemm: Brigade vs direct cuBLAS, 4096^3, f32 and bf16; outputs compared element by element
BRIGADE_BENCH_OUT="$OUT/gemm.json" run gemm bench-gemm "$T" --ignored --test-threads=1 cuda_bench::gemm_4096
rc=$?
if [ -f "$OUT/gemm.json" ]; then
  judge gemm "$OUT/bench-gemm.log" gemm "gemm vs cuBLAS 4096^3" "$OUT/gemm.json" 0.95
  [ $rc -ne 0 ] && ran bench-gemm $rc "$OUT/bench-gemm.log"
else ran bench-gemm $((rc == 0 ? 1 : rc)) "$OUT/bench-gemm.log"; fi

# ---- step: the GPT step beside PyTorch eager on the same GPU (both f32, TF32 off)
cat >"$OUT/torch_step.py" <<'PY'
import json, sys, time
sys.path.insert(0, sys.argv[1])
out = {}
try:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
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
    def timed():
        for _ in range(3): step()
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            s = time.perf_counter(); step(); torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
        return sorted(ts)[5]
    out["torch_gpt_step"] = {"s": timed(), "config": cfg, "batch": [64, 128], "torch": torch.__version__}
    # the same step under autocast(bfloat16): bf16 GEMMs, f32 weights and AdamW state
    f32_step = step
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            opt.zero_grad(set_to_none=True)
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), idx[:, 1:].reshape(-1))
        loss.backward(); opt.step()
    out["torch_gpt_step_bf16"] = {"s": timed(), "config": cfg, "batch": [64, 128], "autocast": "bfloat16"}
except Exception as e:
    out.setdefault("torch_gpt_step", {"error": repr(e)})
    out.setdefault("torch_gpt_step_bf16", {"error": repr(e)})
print(json.dumps(out))
json.dump(out, open(sys.argv[2], "w"))
PY
run step torch-step "$PY" "$OUT/torch_step.py" "$CARRY/torchref" "$OUT/torch.json"
run step gpt-step "$B" train --model gpt --d-model 768 --layers 12 --heads 12 --d-ff 3072 --context 128 --batch-size 64 \
  --optimizer adamw --lr 3e-4 --steps 12 --warmup 2 --world-size 1 --device cuda --json --quiet
rc=$?
if ran gpt-step $rc "$OUT/gpt-step.log"; then
  judge step "$OUT/gpt-step.log" step "gpt step vs PyTorch eager" "$OUT/gpt-step.log" "$OUT/torch.json" 1.1
fi
run step gpt-step-bf16 "$B" train --model gpt --d-model 768 --layers 12 --heads 12 --d-ff 3072 --context 128 --batch-size 64 \
  --optimizer adamw --lr 3e-4 --steps 12 --warmup 2 --world-size 1 --device cuda --precision bf16 --json --quiet
rc=$?
if ran gpt-step-bf16 $rc "$OUT/gpt-step-bf16.log"; then
  judge step-bf16 "$OUT/gpt-step-bf16.log" step "gpt bf16 step vs PyTorch autocast(bfloat16)" "$OUT/gpt-step-bf16.log" \
    "$OUT/torch.json" 1.1 torch_gpt_step_bf16
fi

say "== done in $((SECONDS - START)) s: $([ $FAILED -eq 0 ] && echo 'no check failed' || echo 'SOME CHECKS FAILED')"
exit $FAILED
