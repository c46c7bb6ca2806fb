#!/usr/bin/env bash
# The collectives sitting: Brigade's MPI all-reduce against raw MPI_Allreduce in the same
# run (shared segment off, then on), 2 and 4 ranks, 1-64 MiB; the segment with buffers in the
# shared heap (in place) and out of it, in turns, each pair after memcpy on 1 and 2 threads;
# then the thread backend's small and large messages against memcpy. Needs target/release/brigade built with --features mpi.
# Usage: scripts/bench-collectives.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BRIGADE:-target/release/brigade}
OUT=${1:-out/bench-collectives}
mkdir -p "$OUT"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe)
{
  echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p') $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
  for np in 2 4; do
    for shm in 0 1; do
      echo "## mpi, $np ranks, BRIGADE_MPI_SHM=$shm"
      BRIGADE_MPI_SHM=$shm timeout 600 "${MPIRUN[@]}" -np "$np" "$B" bench comm --backend mpi --sizes 1M,4M,16M,64M
    done
  done
  # The shared segment's two ways on 2 ranks, in turns: buffers in the shared heap (in place,
  # the default above) and out of it (BRIGADE_SHM_HEAP=0: through the segment's slots). Before
  # each pair, memcpy on 1 and 2 threads: how much more two cores move than one, just then.
  gcc -O2 -pthread scripts/memcpy-threads.c -o "$OUT/memcpy-threads"
  for run in 1 2; do
    echo "## memcpy on 1 and 2 threads (run $run of 2)"
    "$OUT/memcpy-threads"
    for heap in 1 0; do
      echo "## mpi, 2 ranks, BRIGADE_MPI_SHM=1 BRIGADE_SHM_HEAP=$heap (run $run of 2)"
      BRIGADE_MPI_SHM=1 BRIGADE_SHM_HEAP=$heap timeout 600 "${MPIRUN[@]}" -np 2 "$B" bench comm --backend mpi --sizes 1M,4M,16M,64M
    done
  done
  echo "## mpi, 4 ranks as 2 nodes of 2 (BRIGADE_NODE_SIZE=2, TCP between them)"
  BRIGADE_NODE_SIZE=2 timeout 600 "${MPIRUN[@]}" --mca btl tcp,self,vader -np 4 "$B" bench comm --backend mpi --sizes 1M,16M,64M
  # Three runs: on a 2-vCPU VM one run's mean can carry a stall of milliseconds (see the
  # median column), so the sitting quotes all three.
  for run in 1 2 3; do
    echo "## thread, 2 ranks (run $run of 3)"
    timeout 600 "$B" bench comm --world-size 2 --sizes 1K,4K,16K,64K,1M,16M,64M
  done
  echo "## the same in-place 2-thread reduction in plain C (a reference, not a ceiling), 16 and 64 MiB"
  gcc -O3 -pthread scripts/allreduce-ceiling.c -o "$OUT/allreduce-ceiling"
  for mib in 16 64; do "$OUT/allreduce-ceiling" "$mib" 20; done
} 2>&1 | tee "$OUT/sitting.txt"
