#!/usr/bin/env bash
# Builds, HERE, everything scripts/gpu-check.sh runs on the GPU machine (which has no Rust
# toolchain): the release `brigade` binary and the release CUDA test binaries of
# brigade-tensor, stripped, plus PyTorch's reference model definition, into gpu-carry/
# (git-ignored). Then hand the folder to the device run:  carry: ["gpu-carry"]
# (the device tool allows 64 MiB in all; this prints the size).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=gpu-carry
rm -rf "$CARRY"
mkdir -p "$CARRY/tests"

echo "== release test binaries (cargo test --release --no-run)"
cargo test --release -p brigade-tensor --no-run --message-format=json \
  --test tensor >"$CARRY/build.json"
# The test binary's executable (its CUDA tests are the modules cuda_*), from cargo's own JSON (no guessing at hashed names).
python3 - "$CARRY" <<'PY'
import json, shutil, sys, os
carry = sys.argv[1]
for line in open(os.path.join(carry, "build.json")):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        dst = os.path.join(carry, "tests", m["target"]["name"])
        shutil.copy(m["executable"], dst)
        print("  ", m["target"]["name"], "<-", m["executable"])
PY
rm "$CARRY/build.json"

echo "== release brigade binary"
cargo build --release -p brigade-cli
cp target/release/brigade "$CARRY/brigade"

strip "$CARRY/brigade" "$CARRY"/tests/* 2>/dev/null || true
if [ -f /work/shared/torchref/workloads.py ]; then
  cp /work/shared/torchref/workloads.py "$CARRY/workloads.py"
fi
git rev-parse HEAD >"$CARRY/COMMIT"
du -sh "$CARRY"
ls -la "$CARRY" "$CARRY/tests"
