// Data movement on the device: gathering a strided view into contiguous memory, writing
// through a strided view (fill, scaled accumulate), and dtype conversions. Gathers and
// fills move raw bits, so one kernel per element size serves every dtype.

// out[i] = x[view(i)] for elements of 1, 2, 4 and 8 bytes.
#define GATHER(bytes, T)                                                                  \
    extern "C" __global__ void gather_b##bytes(const T* x, T* out, StridedLayout lx, u64 n) { \
        GRID_STRIDE(i, n) out[i] = x[strided_offset(lx, i)];                              \
    }                                                                                     \
    extern "C" __global__ void fill_b##bytes(T* dst, StridedLayout ld, u64 n, T value) {  \
        GRID_STRIDE(i, n) dst[strided_offset(ld, i)] = value;                             \
    }

GATHER(1, unsigned char)
GATHER(2, u16)
GATHER(4, unsigned int)
GATHER(8, u64)

// dst[view(i)] += scale * src[i]: gradient accumulation through a view (a view never
// names one storage element twice, so no atomics are needed).
extern "C" __global__ void scaled_add_f32(float* dst, const float* src, StridedLayout ld, u64 n, float scale) {
    GRID_STRIDE(i, n) dst[strided_offset(ld, i)] += scale * src[i];
}
extern "C" __global__ void scaled_add_f64(double* dst, const double* src, StridedLayout ld, u64 n, double scale) {
    GRID_STRIDE(i, n) dst[strided_offset(ld, i)] += scale * src[i];
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

extern "C" __global__ void cast_f32_f16(const float* x, u16* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = f32_to_f16_bits(x[i]);
}
extern "C" __global__ void cast_f16_f32(const u16* x, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = f16_bits_to_f32(x[i]);
}
extern "C" __global__ void cast_f32_bf16(const float* x, u16* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = f32_to_bf16_bits(x[i]);
}
extern "C" __global__ void cast_bf16_f32(const u16* x, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = bf16_bits_to_f32(x[i]);
}
extern "C" __global__ void cast_f32_f64(const float* x, double* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = (double)x[i];
}
extern "C" __global__ void cast_f64_f32(const double* x, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = (float)x[i];
}
