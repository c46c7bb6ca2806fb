// Elementwise maps over strided views: unary ops with up to two scalar parameters, and
// broadcasting binary ops (each operand's layout is already broadcast to the output
// shape, stride 0 on broadcast dims). Outputs are contiguous. Same maths as
// crates/tensor/src/ops/elementwise.rs.

#define INV_SQRT_2PI 0.3989422804014327
#define FRAC_1_SQRT_2 0.7071067811865476

template <typename T> __device__ __forceinline__ T gelu_fwd(T x) {
    return T(0.5) * x * (T(1) + erf(x * T(FRAC_1_SQRT_2)));
}

template <typename T> __device__ __forceinline__ T gelu_grad(T x) {
    T cdf = T(0.5) * (T(1) + erf(x * T(FRAC_1_SQRT_2)));
    T pdf = T(INV_SQRT_2PI) * exp(-(x * x) * T(0.5));
    return cdf + x * pdf;
}

// out[i] = f(x[view(i)], p0, p1), one kernel per storage type (16-bit storage computes in
// f32 and rounds the result once; its scalars arrive as f32)
#define UNARY_AS(name, S, SUF)                                                                    \
    extern "C" __global__ void name##_##SUF(const S* x, S* out, StridedLayout lx, u64 n, Compute<S>::T p0, \
                                            Compute<S>::T p1) {                                   \
        typedef Compute<S>::T C;                                                                  \
        GRID_STRIDE(i, n) out[i] = store_c<S>(name##_op<C>(load_c(x[strided_offset(lx, i)]), p0, p1)); \
    }
#define UNARY(name, expr)                                                                         \
    template <typename T> __device__ __forceinline__ T name##_op(T x, T p0, T p1) { return (expr); } \
    UNARY_AS(name, float, f32)                                                                    \
    UNARY_AS(name, double, f64)                                                                   \
    UNARY_AS(name, f16_t, f16)                                                                    \
    UNARY_AS(name, bf16_t, bf16)

UNARY(neg, -x)
UNARY(exp, exp(x))
UNARY(ln, log(x))
UNARY(sqrt, sqrt(x))
// x <= 0 ? 0 : x, so that a NaN stays NaN (as on the CPU and in PyTorch)
UNARY(relu, x <= T(0) ? T(0) : x)
UNARY(gelu, gelu_fwd<T>(x))
UNARY(sqr, x * x)
UNARY(affine, x * p0 + p1)
UNARY(powf, pow(x, p0))
UNARY(sin, sin(x))
UNARY(cos, cos(x))
UNARY(abs, fabs(x))
// 0 at 0, a NaN stays NaN (x * 0)
UNARY(sign, x > T(0) ? T(1) : (x < T(0) ? T(-1) : x * T(0)))
// half to even, as the CPU's round_ties_even
UNARY(round, rint(x))
// p0 = min, p1 = max; a NaN stays NaN
UNARY(clamp, x < p0 ? p0 : (x > p1 ? p1 : x))
// 1 where min <= x <= max: where a clamp passes its gradient
UNARY(in_range, (p0 <= x && x <= p1) ? T(1) : T(0))
// 1 where x is exactly 0 (the backward of max/amax/amin: which elements were the result).
UNARY(is_zero, x == T(0) ? T(1) : T(0))

// out[i] = f(a[view_a(i)], b[view_b(i)])
#define BINARY_AS(name, S, SUF)                                                                   \
    extern "C" __global__ void name##_##SUF(const S* a, const S* b, S* out, StridedLayout la, StridedLayout lb, u64 n) { \
        typedef Compute<S>::T C;                                                                  \
        GRID_STRIDE(i, n) out[i] = store_c<S>(name##_op<C>(load_c(a[strided_offset(la, i)]), load_c(b[strided_offset(lb, i)]))); \
    }
#define BINARY(name, expr)                                                                        \
    template <typename T> __device__ __forceinline__ T name##_op(T a, T b) { return (expr); }     \
    BINARY_AS(name, float, f32)                                                                   \
    BINARY_AS(name, double, f64)                                                                  \
    BINARY_AS(name, f16_t, f16)                                                               \
    BINARY_AS(name, bf16_t, bf16)

BINARY(add, a + b)
BINARY(sub, a - b)
BINARY(mul, a * b)
BINARY(div, a / b)
// a = x (the forward input), b = g (the gradient)
BINARY(relu_backward, a > T(0) ? b : T(0))
BINARY(gelu_backward, b * gelu_grad<T>(a))
