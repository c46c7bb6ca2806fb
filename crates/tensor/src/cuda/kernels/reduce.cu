// Row reductions: the host permutes the reduced dims last and gathers the view into a
// contiguous [rows, cols] buffer; one block reduces one row. Same results as
// crates/tensor/src/cpu/reduce.rs up to summation order; the maximum propagates any NaN.

template <typename T>
__device__ void sum_rows_impl(const T* x, T* out, u64 rows, u64 cols) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * cols;
        T acc = T(0);
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) acc += row[j];
        acc = block_sum<T>(acc);
        if (threadIdx.x == 0) out[r] = acc;
    }
}

template <typename T>
__device__ void max_rows_impl(const T* x, T* out, u64 rows, u64 cols) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * cols;
        T m = neg_infinity<T>();
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) m = max_nan<T>(m, row[j]);
        m = block_max<T>(m);
        if (threadIdx.x == 0) out[r] = m;
    }
}

#define ROW_REDUCTIONS(T, SUF)                                                                   \
    extern "C" __global__ void sum_rows_##SUF(const T* x, T* out, u64 rows, u64 cols) { sum_rows_impl<T>(x, out, rows, cols); } \
    extern "C" __global__ void max_rows_##SUF(const T* x, T* out, u64 rows, u64 cols) { max_rows_impl<T>(x, out, rows, cols); }

ROW_REDUCTIONS(float, f32)
ROW_REDUCTIONS(double, f64)
