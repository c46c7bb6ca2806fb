// Host emulation of the CUDA constructs indexing.cu uses: each block runs as BLOCK std::threads
// that meet at a std::barrier for __syncthreads; __shared__ is a function-static (one block at a time).
#include <barrier>
#include <thread>
#include <vector>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <functional>
#define BRIGADE_MAX_RANK 8
#define BRIGADE_BLOCK 256
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;
struct dim3h { unsigned int x; };
thread_local dim3h threadIdx, blockIdx;
dim3h blockDim{BRIGADE_BLOCK}, gridDim{1};
std::barrier<>* g_bar;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct StridedLayout { unsigned int rank; unsigned int contiguous; u64 shape[8]; u64 strides[8]; u64 offset; };
struct f16_t { u16 bits; };
struct bf16_t { u16 bits; };
template <typename S> struct Compute { typedef S T; };
template <> struct Compute<f16_t> { typedef float T; };
template <> struct Compute<bf16_t> { typedef float T; };
inline float load_c(float x) { return x; }
inline double load_c(double x) { return x; }
inline float load_c(f16_t) { return 0; }
inline float load_c(bf16_t x) { unsigned int u = ((unsigned int)x.bits) << 16; float f; memcpy(&f, &u, 4); return f; }
#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)
// runs kernel body f on a grid of `blocks` blocks, each of BRIGADE_BLOCK threads
inline void run_grid(unsigned int blocks, const std::function<void()>& f) {
    gridDim.x = blocks;
    for (unsigned int b = 0; b < blocks; ++b) {
        std::barrier<> bar(BRIGADE_BLOCK);
        g_bar = &bar;
        std::vector<std::thread> ts;
        for (unsigned int t = 0; t < BRIGADE_BLOCK; ++t)
            ts.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; f(); });
        for (auto& t : ts) t.join();
    }
}
