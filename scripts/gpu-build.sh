#!/usr/bin/env bash
# Builds, HERE, everything scripts/gpu-check.sh runs on the GPU machine (which has no Rust
# toolchain and an unknown glibc) into gpu-carry/ (git-ignored); hand that folder to the device
# run as its carry:
#
#   bin/brigade            the release CLI
#   tests/tensor           the release test binary of brigade-tensor (cuda_probe, cuda_nvrtc,
#                          cuda_ops, half_ops, cuda_bench, fake_device)
#   ref/gpt_sgd.args       the GPT parity run's flags, and ref/gpt_sgd_cpu.csv its losses on this
#                          CPU: the reference the CUDA run is compared with on the GPU
#   ref/gpt_mixed.args     the same for mixed precision: ref/gpt_bf16_cpu.csv, ref/gpt_fp16_cpu.csv
#                          (--precision bf16 and fp16 on this CPU)
#   torchref/              PyTorch's reference model, from ../shared/torchref/ beside the checkout
#   COMMIT, MANIFEST       the commit, and each binary's size and the newest glibc it needs
#
# Binaries are linked for glibc 2.28 or newer (GLIBC=2.28 by default): cargo-zigbuild and zig,
# both from PyPI wheels (`cargo-zigbuild`, `ziglang`) that the script installs into .venv-zig.
# Needs: a Rust toolchain, python3 with venv, and PyPI. Honours CARGO_TARGET_DIR.
#
# Fails, naming the cause, on: a build error, a strip error, a missing file, a binary that needs a
# newer glibc than asked for, a binary that does not start, a carry over 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=gpu-carry
GLIBC=${GLIBC:-2.28}
TRIPLE=x86_64-unknown-linux-gnu
TORCHREF=${TORCHREF:-../shared/torchref}
LIMIT_MIB=60
ZIG_VENV=.venv-zig
ZIGLANG_VERSION=0.17.1
ZIGBUILD_VERSION=0.24.1
die() {
  echo "gpu-build: FAILED: $*" >&2
  exit 1
}

echo "== zig (PyPI ziglang $ZIGLANG_VERSION) and cargo-zigbuild (PyPI cargo-zigbuild $ZIGBUILD_VERSION)"
if [ ! -x "$ZIG_VENV/bin/python" ]; then
  python3 -m venv "$ZIG_VENV" || die "cannot make the venv $ZIG_VENV (Debian: apt-get install python3-venv)"
fi
"$ZIG_VENV/bin/python" -c "import ziglang" 2>/dev/null ||
  "$ZIG_VENV/bin/pip" install -q "ziglang==$ZIGLANG_VERSION" || die "pip install ziglang==$ZIGLANG_VERSION failed"
[ -x "$ZIG_VENV/bin/cargo-zigbuild" ] ||
  "$ZIG_VENV/bin/pip" install -q "cargo-zigbuild==$ZIGBUILD_VERSION" || die "pip install cargo-zigbuild==$ZIGBUILD_VERSION failed"
ZIG="$("$ZIG_VENV/bin/python" -c 'import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
[ -x "$ZIG" ] || die "no zig binary in the ziglang wheel ($ZIG)"
export CARGO_ZIGBUILD_ZIG_PATH="$ZIG"
# cargo finds `cargo zigbuild` on PATH: the venv's, whatever else is installed
export PATH="$PWD/$ZIG_VENV/bin:$PATH"
echo "zig $("$ZIG" version) at $ZIG; $(cargo-zigbuild --version)"
# where cargo writes (CARGO_TARGET_DIR, a config's build.target-dir, or ./target)
TARGET_DIR="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')" ||
  die "cargo metadata failed"

[ -f "$TORCHREF/workloads.py" ] || die "PyTorch's reference model $TORCHREF/workloads.py is missing (TORCHREF=... to point elsewhere)"

rm -rf "$CARRY"
mkdir -p "$CARRY/bin" "$CARRY/tests" "$CARRY/ref" "$CARRY/torchref"

echo "== release test binary of brigade-tensor, glibc $GLIBC"
cargo zigbuild --release -p brigade-tensor --test tensor --target "$TRIPLE.$GLIBC" --message-format=json \
  >"$CARRY/build.json" || die "building the tensor test binary"
python3 - "$CARRY" <<'PY' || die "no test executable in cargo's output"
import json, shutil, sys, os
carry = sys.argv[1]
found = 0
for line in open(os.path.join(carry, "build.json")):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "tensor":
        shutil.copy(m["executable"], os.path.join(carry, "tests", "tensor"))
        print("  tensor <-", m["executable"])
        found += 1
sys.exit(0 if found == 1 else 1)
PY
rm "$CARRY/build.json"

echo "== release brigade binary, glibc $GLIBC"
cargo zigbuild --release -p brigade-cli --target "$TRIPLE.$GLIBC" || die "building the brigade binary"
cp "$TARGET_DIR/$TRIPLE/release/brigade" "$CARRY/bin/brigade" || die "no brigade binary in $TARGET_DIR/$TRIPLE/release"

echo "== strip"
for f in "$CARRY/bin/brigade" "$CARRY/tests/tensor"; do
  strip "$f" || die "strip $f"
done

echo "== every carried binary starts here, and needs glibc <= $GLIBC"
"$CARRY/bin/brigade" --version >/dev/null || die "$CARRY/bin/brigade does not start"
"$CARRY/tests/tensor" --list >/dev/null || die "$CARRY/tests/tensor does not start"
python3 scripts/gpu_check.py glibc "$CARRY/bin/brigade" "$CARRY/tests/tensor" | tee "$CARRY/MANIFEST"
python3 - "$GLIBC" "$CARRY/MANIFEST" <<'PY' || die "a binary needs a newer glibc than $GLIBC (see $CARRY/MANIFEST)"
import re, sys
limit = tuple(int(x) for x in sys.argv[1].split("."))
for line in open(sys.argv[2]):
    m = re.search(r"GLIBC_([\d.]+)", line)
    if m and tuple(int(x) for x in m.group(1).split(".")) > limit:
        print("too new:", line.strip())
        sys.exit(1)
PY

echo "== the GPT parity reference on this CPU (SGD, no momentum)"
# the flags the GPU check runs with --device cuda; one place, read back by gpu-check.sh
echo "--model gpt --batch-size 8 --steps 20 --seed 0 --optimizer sgd --lr 0.05 --momentum 0 --world-size 1" \
  >"$CARRY/ref/gpt_sgd.args"
# shellcheck disable=SC2046
"$CARRY/bin/brigade" train $(cat "$CARRY/ref/gpt_sgd.args") --device cpu --quiet \
  --losses "$CARRY/ref/gpt_sgd_cpu.csv" || die "the CPU reference run failed"
[ "$(wc -l <"$CARRY/ref/gpt_sgd_cpu.csv")" -eq 21 ] || die "the reference holds $(wc -l <"$CARRY/ref/gpt_sgd_cpu.csv") lines, not 21"
lscpu | grep -m1 "Model name" >"$CARRY/ref/cpu.txt" || true

echo "== the GPT's mixed-precision references on this CPU (bf16; fp16 with loss scaling)"
echo "--model gpt --batch-size 8 --steps 10 --seed 0 --optimizer adamw --lr 3e-4 --world-size 1" \
  >"$CARRY/ref/gpt_mixed.args"
for p in bf16 fp16; do
  # shellcheck disable=SC2046
  "$CARRY/bin/brigade" train $(cat "$CARRY/ref/gpt_mixed.args") --precision "$p" --device cpu --quiet \
    --losses "$CARRY/ref/gpt_${p}_cpu.csv" || die "the CPU $p reference run failed"
  [ "$(wc -l <"$CARRY/ref/gpt_${p}_cpu.csv")" -eq 11 ] || die "the $p reference holds $(wc -l <"$CARRY/ref/gpt_${p}_cpu.csv") lines, not 11"
done

echo "== PyTorch's reference model"
cp "$TORCHREF/workloads.py" "$CARRY/torchref/workloads.py" || die "copying $TORCHREF/workloads.py"

git rev-parse HEAD >"$CARRY/COMMIT"
git diff --quiet HEAD -- || echo "dirty: the working tree differs from $(cat "$CARRY/COMMIT")" >>"$CARRY/COMMIT"
size=$(du -sm "$CARRY" | cut -f1)
ls -la "$CARRY"/*/
echo "carry: ${size} MiB (limit ${LIMIT_MIB})"
[ "$size" -le "$LIMIT_MIB" ] || die "the carry is ${size} MiB, over ${LIMIT_MIB} MiB"
echo "gpu-build: OK ($CARRY, commit $(head -1 "$CARRY/COMMIT"))"
