#!/usr/bin/env bash
# Runs the CUDA indexing kernels' own source (crates/tensor/src/cuda/kernels/indexing.cu) on the
# host, without a GPU: g++ compiles the .cu text behind scripts/kernel-emulation/prelude.h, which
# runs each block as 256 threads meeting at a barrier for __syncthreads, and checks the sort
# (shared-memory tiles and merge passes), gather and scatter-add against a reference written
# apart from them (f32 and f64 paths; the 16-bit loads are not emulated). What it cannot see:
# launch configuration, memory limits, and anything the GPU's compiler or hardware does
# differently. Needs g++ with C++20 (std::barrier). Prints ALL OK and exits 0, or the first
# mismatch of each check and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cp crates/tensor/src/cuda/kernels/indexing.cu scripts/kernel-emulation/prelude.h "$dir/"
cp scripts/kernel-emulation/indexing_check.cpp "$dir/emu.cpp"
g++ -std=c++20 -O1 -pthread -w "$dir/emu.cpp" -o "$dir/emu"
"$dir/emu"
