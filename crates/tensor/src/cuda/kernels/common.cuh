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
// `cuda::launch::StridedLayout` on the Rust side field for field. `contiguous` is 1 for a
// row-major view without gaps (then element i sits at offset + i).
struct StridedLayout {
    unsigned int rank;
    unsigned int contiguous;
    u64 shape[BRIGADE_MAX_RANK];
    u64 strides[BRIGADE_MAX_RANK];
    u64 offset;
};

// Storage index of the i-th element (row-major order) of a view: one add for a contiguous
// view (the flag is the same for every thread, so the branch never diverges), else one
// division per dimension.
__device__ __forceinline__ u64 strided_offset(const StridedLayout& l, u64 i) {
    if (l.contiguous) return l.offset + i;
    u64 o = l.offset;
    for (int d = (int)l.rank - 1; d >= 0; --d) {
        u64 s = l.shape[d];
        o += (i % s) * l.strides[d];
        i /= s;
    }
    return o;
}

// Round-to-nearest-even conversions through PTX's cvt (no cuda_fp16.h needed, so the
// kernels compile with NVRTC alone). bf16 conversion needs sm_80 or newer.
__device__ __forceinline__ u16 f32_to_f16_bits(float x) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}
__device__ __forceinline__ u16 f32_to_bf16_bits(float x) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float bf16_bits_to_f32(u16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// 16-bit float storage, computed in f32 (as autocast, and as the CPU's kernels do): a kernel
// templated on its storage type S loads each element with load_c (exact), computes in
// Compute<S>::T and rounds each output once with store_c<S>, to nearest even. f32 and f64
// compute in themselves (load_c and store_c are the identity there). The two 16-bit types are
// distinct structs over the same bits, so that overloads tell them apart.
struct f16_t { u16 bits; };
struct bf16_t { u16 bits; };

template <typename S> struct Compute { typedef S T; };
template <> struct Compute<f16_t> { typedef float T; };
template <> struct Compute<bf16_t> { typedef float T; };

__device__ __forceinline__ float load_c(float x) { return x; }
__device__ __forceinline__ double load_c(double x) { return x; }
__device__ __forceinline__ float load_c(f16_t x) { return f16_bits_to_f32(x.bits); }
__device__ __forceinline__ float load_c(bf16_t x) { return bf16_bits_to_f32(x.bits); }

template <typename S> __device__ __forceinline__ S store_c(typename Compute<S>::T x);
template <> __device__ __forceinline__ float store_c<float>(float x) { return x; }
template <> __device__ __forceinline__ double store_c<double>(double x) { return x; }
template <> __device__ __forceinline__ f16_t store_c<f16_t>(float x) {
    f16_t r;
    r.bits = f32_to_f16_bits(x);
    return r;
}
template <> __device__ __forceinline__ bf16_t store_c<bf16_t>(float x) {
    bf16_t r;
    r.bits = f32_to_bf16_bits(x);
    return r;
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

// The larger of a and b, where a NaN on either side wins (PyTorch's max, and the CPU's):
// the result does not depend on the order in which a reduction combines its elements.
template <typename T>
__device__ __forceinline__ T max_nan(T a, T b) {
    return (a != a || b <= a) ? a : b;
}

// Maximum of v over the block (blockDim.x == BRIGADE_BLOCK), NaN-propagating; every thread
// gets the result.
template <typename T>
__device__ T block_max(T v) {
    __shared__ T sh[BRIGADE_BLOCK];
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = max_nan<T>(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

template <typename T> __device__ __forceinline__ T neg_infinity();
template <> __device__ __forceinline__ float neg_infinity<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_infinity<double>() { return __longlong_as_double(0xfff0000000000000ULL); }

template <typename T> __device__ __forceinline__ T quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double quiet_nan<double>() { return __longlong_as_double(0x7ff8000000000000ULL); }

