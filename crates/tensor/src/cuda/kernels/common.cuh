// Brigade's CUDA kernels: helpers shared by every .cu file. The Rust side prepends this
// text to each file before NVRTC compiles it (NVRTC has no include path to our sources).
//
// Conventions: element counts and offsets are 64-bit; every kernel over n elements uses a
// grid-stride loop, so any grid size is correct; row kernels use one block of
// BRIGADE_BLOCK threads per row.

#define BRIGADE_MAX_RANK 8
#define BRIGADE_BLOCK 256

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;

// A strided view (shape, strides in elements, offset), passed by value. Mirrors
// `cuda::layout::StridedLayout` on the Rust side field for field.
struct StridedLayout {
    unsigned int rank;
    unsigned int pad;
    u64 shape[BRIGADE_MAX_RANK];
    u64 strides[BRIGADE_MAX_RANK];
    u64 offset;
};

// Storage index of the i-th element (row-major order) of a view.
__device__ __forceinline__ u64 strided_offset(const StridedLayout& l, u64 i) {
    u64 o = l.offset;
    for (int d = (int)l.rank - 1; d >= 0; --d) {
        u64 s = l.shape[d];
        o += (i % s) * l.strides[d];
        i /= s;
    }
    return o;
}

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// Sum of v over the block (blockDim.x == BRIGADE_BLOCK); every thread gets the result.
template <typename T>
__device__ T block_sum(T v) {
    __shared__ T sh[BRIGADE_BLOCK];
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

// Maximum of v over the block (blockDim.x == BRIGADE_BLOCK); every thread gets the result.
template <typename T>
__device__ T block_max(T v) {
    __shared__ T sh[BRIGADE_BLOCK];
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && sh[threadIdx.x + s] > sh[threadIdx.x]) sh[threadIdx.x] = sh[threadIdx.x + s];
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

template <typename T> __device__ __forceinline__ T neg_infinity();
template <> __device__ __forceinline__ float neg_infinity<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_infinity<double>() { return __longlong_as_double(0xfff0000000000000ULL); }

// Marks position r as holding a bad index: the host reads the smallest such r.
__device__ __forceinline__ void flag_bad_index(u64* bad, u64 r) {
    atomicMin(bad, r);
}
