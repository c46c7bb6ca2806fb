// How much more memory bandwidth two cores get than one on this machine, at this moment: memcpy
// of 256 MiB on 1 thread, then split in halves over 2 threads (best of 10 copies each). An
// in-place all-reduce of an N-byte buffer on 2 ranks reads and writes both buffers, 4N bytes,
// where a memcpy of N moves 2N (3N without non-temporal stores), so past the caches its busbw
// reaches single-thread memcpy's only when the two cores together move well more than one.
// Not a strict bound: memcpy's own store path is not the fastest way to move bytes everywhere.
//   gcc -O2 -pthread scripts/memcpy-threads.c -o /tmp/memcpy-threads && /tmp/memcpy-threads
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static size_t N = 256u << 20;
static char *src, *dst;
static int T;
static pthread_barrier_t bar;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void *copy_part(void *a) {
  long i = (long)a; size_t c = N / T;
  for (int rep = 0; rep < 10; rep++) { pthread_barrier_wait(&bar); memcpy(dst + i * c, src + i * c, c); pthread_barrier_wait(&bar); }
  return 0;
}
static double best_bw(int threads) {
  pthread_t th[2]; double best = 1e9; T = threads;
  pthread_barrier_init(&bar, 0, T + 1);
  for (long i = 0; i < T; i++) pthread_create(&th[i], 0, copy_part, (void *)i);
  for (int rep = 0; rep < 10; rep++) { pthread_barrier_wait(&bar); double s = now(); pthread_barrier_wait(&bar); double e = now() - s; if (e < best) best = e; }
  for (int i = 0; i < T; i++) pthread_join(th[i], 0);
  pthread_barrier_destroy(&bar);
  return N / best / 1e9;
}
int main(void) {
  src = malloc(N); dst = malloc(N); memset(src, 1, N); memset(dst, 0, N);
  double one = best_bw(1), two = best_bw(2);
  printf("memcpy 256 MiB: 1 thread %.2f GB/s, 2 threads %.2f GB/s (x%.2f)\n", one, two, two / one);
  return 0;
}
