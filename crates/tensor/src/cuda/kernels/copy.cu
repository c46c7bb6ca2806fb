// Data movement on the device: gathering a strided view into contiguous memory, writing
// through a strided view (fill, scaled accumulate), and dtype conversions. Gathers and
// fills move raw bits, so one kernel per element size serves every dtype.

// out[i] = x[view(i)] (gather), dst[view(i)] = value (fill) and dst[view(i)] = src[i]
// (scatter, bit for bit), for elements of 1, 2, 4 and 8 bytes.
#define GATHER(bytes, T)                                                                  \
    extern "C" __global__ void gather_b##bytes(const T* x, T* out, StridedLayout lx, u64 n) { \
        GRID_STRIDE(i, n) out[i] = x[strided_offset(lx, i)];                              \
    }                                                                                     \
    extern "C" __global__ void fill_b##bytes(T* dst, StridedLayout ld, u64 n, T value) {  \
        GRID_STRIDE(i, n) dst[strided_offset(ld, i)] = value;                             \
    }                                                                                     \
    extern "C" __global__ void scatter_b##bytes(T* dst, const T* src, StridedLayout ld, u64 n) { \
        GRID_STRIDE(i, n) dst[strided_offset(ld, i)] = src[i];                            \
    }

GATHER(1, unsigned char)
GATHER(2, u16)
GATHER(4, unsigned int)
GATHER(8, u64)

// dst[view(i)] += scale * src[i]: gradient accumulation through a view (a view never
// names one storage element twice, so no atomics are needed); 16-bit storage sums in f32 and
// rounds once, as the CPU's widened accumulation does.
#define SCALED_ADD(S, SUF)                                                                        \
    extern "C" __global__ void scaled_add_##SUF(S* dst, const S* src, StridedLayout ld, u64 n, Compute<S>::T scale) { \
        GRID_STRIDE(i, n) {                                                                       \
            u64 o = strided_offset(ld, i);                                                        \
            dst[o] = store_c<S>(load_c(dst[o]) + scale * load_c(src[i]));                         \
        }                                                                                         \
    }

SCALED_ADD(float, f32)
SCALED_ADD(double, f64)
SCALED_ADD(f16_t, f16)
SCALED_ADD(bf16_t, bf16)

// Loading any element as a double is exact; storing a double rounds once to the target,
// as the CPU's to_dtype does (every conversion goes through f64 there).
__device__ __forceinline__ double load_f32(float x) { return (double)x; }
__device__ __forceinline__ double load_f64(double x) { return x; }
__device__ __forceinline__ double load_f16(u16 x) { return (double)f16_bits_to_f32(x); }
__device__ __forceinline__ double load_bf16(u16 x) { return (double)bf16_bits_to_f32(x); }
__device__ __forceinline__ double load_i64(i64 x) { return (double)x; }
__device__ __forceinline__ double load_u8(unsigned char x) { return (double)x; }
__device__ __forceinline__ double load_i8(signed char x) { return (double)x; }

// A double rounded to f32 toward zero with the sticky bit kept (round to odd): rounding
// that f32 to nearest-even at 16 bits or fewer equals rounding the double directly.
__device__ __forceinline__ float round_to_odd_f32(double d) {
    float f = __double2float_rz(d);
    if ((double)f != d && f == f) f = __uint_as_float(__float_as_uint(f) | 1u);
    return f;
}

__device__ __forceinline__ float store_f32(double d) { return (float)d; }
__device__ __forceinline__ double store_f64(double d) { return d; }
__device__ __forceinline__ u16 store_f16(double d) { return f32_to_f16_bits(round_to_odd_f32(d)); }
__device__ __forceinline__ u16 store_bf16(double d) { return f32_to_bf16_bits(round_to_odd_f32(d)); }
// Float to integer truncates toward zero and saturates, NaN gives 0 (Rust's `as`).
__device__ __forceinline__ i64 store_i64(double d) {
    if (d != d) return 0;
    if (d >= 9223372036854775807.0) return 9223372036854775807LL;
    if (d <= -9223372036854775808.0) return (-9223372036854775807LL - 1);
    return (i64)d;
}
__device__ __forceinline__ unsigned char store_u8(double d) {
    if (d != d || d <= 0.0) return 0;
    if (d >= 255.0) return 255;
    return (unsigned char)d;
}
// The quantizing cast: round half to even (rint), saturate at +-127 (never -128), NaN gives 0.
__device__ __forceinline__ signed char store_i8(double d) {
    if (d != d) return 0;
    double r = rint(d);
    if (r >= 127.0) return 127;
    if (r <= -127.0) return -127;
    return (signed char)r;
}

// out[i] = convert(x[view(i)]) for every pair of dtypes: cast_<from>_<to>.
#define CAST(FROM, FT, TO, TT)                                                                 \
    extern "C" __global__ void cast_##FROM##_##TO(const FT* x, TT* out, StridedLayout lx, u64 n) { \
        GRID_STRIDE(i, n) out[i] = store_##TO(load_##FROM(x[strided_offset(lx, i)]));         \
    }
#define CAST_FROM(FROM, FT)                  \
    CAST(FROM, FT, f32, float)               \
    CAST(FROM, FT, f64, double)              \
    CAST(FROM, FT, f16, u16)                 \
    CAST(FROM, FT, bf16, u16)                \
    CAST(FROM, FT, i64, i64)                 \
    CAST(FROM, FT, u8, unsigned char)        \
    CAST(FROM, FT, i8, signed char)

CAST_FROM(f32, float)
CAST_FROM(f64, double)
CAST_FROM(f16, u16)
CAST_FROM(bf16, u16)
CAST_FROM(i64, i64)
CAST_FROM(u8, unsigned char)
CAST_FROM(i8, signed char)
