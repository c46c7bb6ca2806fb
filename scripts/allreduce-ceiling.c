// A reference for the thread backend's large all-reduce on this machine: two threads, each
// averaging its half of two buffers in place (what Brigade's thread backend does for 2 ranks),
// with a barrier around each iteration. `restrict` lets gcc vectorize the loop (without it the
// two stores may alias the loads and the loop stays scalar: 10-12 ms at 64 MiB, not a ceiling).
// Build and run beside Brigade, in turns:
//   gcc -O3 -pthread scripts/allreduce-ceiling.c -o /tmp/ceiling && /tmp/ceiling 64 10
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
size_t n; float *x,*y; pthread_barrier_t bar; double ts[2][4096]; int iters;
static void* w(void*p){long id=(long)p; for(int r=0;r<iters;r++){pthread_barrier_wait(&bar); double t0=now();
 size_t lo=id*n/2, hi=(id+1)*n/2; float *restrict a=x+lo, *restrict b=y+lo; for(size_t i=0;i<hi-lo;i++){float s=(a[i]+b[i])*0.5f; a[i]=s; b[i]=s;}
 pthread_barrier_wait(&bar); ts[id][r]=now()-t0;} return 0;}
int main(int c,char**v){ n=((size_t)atoi(v[1])<<20)/4; iters=atoi(v[2]); x=malloc(n*4); y=malloc(n*4); for(size_t i=0;i<n;i++){x[i]=1;y[i]=2;}
 pthread_barrier_init(&bar,0,2); pthread_t th[2]; for(long i=0;i<2;i++)pthread_create(&th[i],0,w,(void*)i); for(int i=0;i<2;i++)pthread_join(th[i],0);
 double s=0,mn=1e9; for(int r=0;r<iters;r++){s+=ts[0][r]; if(ts[0][r]<mn)mn=ts[0][r];} printf("C 2-thread in-place avg all-reduce %s MiB: mean %.0f us min %.0f us\n", v[1], s/iters*1e6, mn*1e6); }
