// Row reductions: the host permutes the reduced dims last and gathers the view into a
// contiguous [rows, cols] buffer; one block reduces one row. Same results as
// crates/tensor/src/cpu/reduce.rs up to summation order; the maximum propagates any NaN.

// 16-bit storage accumulates in f32 and rounds each row's result once.

template <typename S>
__device__ void sum_rows_impl(const S* x, S* out, u64 rows, u64 cols) {
    typedef typename Compute<S>::T T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* row = x + r * cols;
        T acc = T(0);
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) acc += load_c(row[j]);
        acc = block_sum<T>(acc);
        if (threadIdx.x == 0) out[r] = store_c<S>(acc);
    }
}

template <typename S>
__device__ void max_rows_impl(const S* x, S* out, u64 rows, u64 cols) {
    typedef typename Compute<S>::T T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* row = x + r * cols;
        T m = neg_infinity<T>();
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) m = max_nan<T>(m, load_c(row[j]));
        m = block_max<T>(m);
        if (threadIdx.x == 0) out[r] = store_c<S>(m);
    }
}

#define ROW_REDUCTIONS(S, SUF)                                                                   \
    extern "C" __global__ void sum_rows_##SUF(const S* x, S* out, u64 rows, u64 cols) { sum_rows_impl<S>(x, out, rows, cols); } \
    extern "C" __global__ void max_rows_##SUF(const S* x, S* out, u64 rows, u64 cols) { max_rows_impl<S>(x, out, rows, cols); }

ROW_REDUCTIONS(float, f32)
ROW_REDUCTIONS(double, f64)
ROW_REDUCTIONS(f16_t, f16)
ROW_REDUCTIONS(bf16_t, bf16)
