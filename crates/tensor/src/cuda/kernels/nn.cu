// Neural-network kernels over the last axis of contiguous [rows, d] buffers: softmax,
// log-softmax and their backwards, layer norm forward/backward, embedding gather and its
// scatter-add backward, the causal mask, cross-entropy. One block per row unless noted.
// Same maths as crates/tensor/src/ops/nn.rs.

template <typename T>
__device__ void softmax_rows_impl(const T* x, T* out, u64 rows, u64 d, int log_softmax) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * d;
        T* o = out + r * d;
        T m = neg_infinity<T>();
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) m = max_nan<T>(m, row[j]);
        m = block_max<T>(m);
        T s = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += exp(row[j] - m);
        s = block_sum<T>(s);
        if (log_softmax) {
            T lse = log(s) + m;
            for (u64 j = threadIdx.x; j < d; j += blockDim.x) o[j] = row[j] - lse;
        } else {
            T inv = T(1) / s;
            for (u64 j = threadIdx.x; j < d; j += blockDim.x) o[j] = exp(row[j] - m) * inv;
        }
    }
}

// softmax: o = y * (g - sum(g * y)); log-softmax: o = g - exp(y) * sum(g).
template <typename T>
__device__ void softmax_backward_rows_impl(const T* y, const T* g, T* out, u64 rows, u64 d, int log_softmax) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* yr = y + r * d;
        const T* gr = g + r * d;
        T* o = out + r * d;
        T s = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += log_softmax ? gr[j] : gr[j] * yr[j];
        s = block_sum<T>(s);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x)
            o[j] = log_softmax ? gr[j] - exp(yr[j]) * s : yr[j] * (gr[j] - s);
    }
}

// y = (x - mean) * rstd * w + b; saves mean and rstd = 1/sqrt(var + eps) per row.
template <typename T>
__device__ void layer_norm_rows_impl(const T* x, const T* w, const T* b, T* out, T* mean_out, T* rstd_out,
                                     u64 rows, u64 d, T eps) {
    T inv_d = T(1) / T(d);
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * d;
        T* o = out + r * d;
        T s = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += row[j];
        T mean = block_sum<T>(s) * inv_d;
        T v = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) v += (row[j] - mean) * (row[j] - mean);
        T rstd = T(1) / sqrt(block_sum<T>(v) * inv_d + eps);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) o[j] = (row[j] - mean) * rstd * w[j] + b[j];
        if (threadIdx.x == 0) {
            mean_out[r] = mean;
            rstd_out[r] = rstd;
        }
    }
}

// dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)) per row.
template <typename T>
__device__ void layer_norm_backward_dx_impl(const T* x, const T* w, const T* g, const T* mean, const T* rstd, T* dx,
                                            u64 rows, u64 d) {
    T inv_d = T(1) / T(d);
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * d;
        const T* gr = g + r * d;
        T m = mean[r], rs = rstd[r];
        T s1 = T(0), s2 = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
            T dxhat = gr[j] * w[j];
            s1 += dxhat;
            s2 += dxhat * (xr[j] - m) * rs;
        }
        s1 = block_sum<T>(s1) * inv_d;
        s2 = block_sum<T>(s2) * inv_d;
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
            T xhat = (xr[j] - m) * rs;
            dx[r * d + j] = rs * (gr[j] * w[j] - s1 - xhat * s2);
        }
    }
}

// dw[j] = sum_r g*xhat, db[j] = sum_r g in two stages, deterministic (a fixed order, no
// atomics). Stage 1: a block of 32 columns x 8 thread rows sums chunks of COL_CHUNK rows
// (chunks blockIdx.y, blockIdx.y + gridDim.y, ...) into one partial row per blockIdx.y;
// stage 2 (column_sum) adds the gridDim.y partial rows of each column in order.
#define COL_CHUNK 64
template <typename T>
__device__ void layer_norm_dwdb_partial_impl(const T* x, const T* g, const T* mean, const T* rstd, T* pw, T* pb,
                                             u64 rows, u64 d) {
    __shared__ T sw[8][33];
    __shared__ T sb[8][33];
    u64 j = (u64)blockIdx.x * 32 + threadIdx.x;
    T aw = T(0), ab = T(0);
    if (j < d) {
        for (u64 c = blockIdx.y; c * COL_CHUNK < rows; c += gridDim.y) {
            u64 end = (c + 1) * COL_CHUNK < rows ? (c + 1) * COL_CHUNK : rows;
            for (u64 r = c * COL_CHUNK + threadIdx.y; r < end; r += 8) {
                T gv = g[r * d + j];
                aw += gv * (x[r * d + j] - mean[r]) * rstd[r];
                ab += gv;
            }
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && j < d) {
        T tw = T(0), tb = T(0);
        for (int k = 0; k < 8; ++k) {
            tw += sw[k][threadIdx.x];
            tb += sb[k][threadIdx.x];
        }
        pw[(u64)blockIdx.y * d + j] = tw;
        pb[(u64)blockIdx.y * d + j] = tb;
    }
}

// out[j] = sum over the `parts` rows of p[parts, d], in row order.
template <typename T>
__device__ void column_sum_impl(const T* p, T* out, u64 parts, u64 d) {
    GRID_STRIDE(j, d) {
        T a = T(0);
        for (u64 k = 0; k < parts; ++k) a += p[k * d + j];
        out[j] = a;
    }
}

// out[r, :] = w[ids[r], :]. The host validated the ids (before uploading them); an id outside
// 0..vocab all the same reads nothing and gives a zero row.
template <typename T, typename I>
__device__ void embedding_impl(const T* w, const I* ids, T* out, u64 n_ids, u64 vocab, u64 d) {
    GRID_STRIDE(i, n_ids * d) {
        u64 r = i / d, j = i % d;
        i64 id = (i64)ids[r];
        out[i] = (id < 0 || (u64)id >= vocab) ? T(0) : w[(u64)id * d + j];
    }
}

// table[ids[r], :] += g[r, :] (atomics: repeated ids add up in an unspecified order); an id
// outside 0..vocab (validated away by the host) writes nothing.
template <typename T, typename I>
__device__ void embedding_backward_impl(const I* ids, const T* g, T* table, u64 n_ids, u64 vocab, u64 d) {
    GRID_STRIDE(i, n_ids * d) {
        u64 r = i / d, j = i % d;
        i64 id = (i64)ids[r];
        if (id >= 0 && (u64)id < vocab) atomicAdd(&table[(u64)id * d + j], g[i]);
    }
}

// In place on a contiguous [.., t, s] buffer: key j after query i (j > i + s - t) := value.
template <typename T>
__device__ void causal_fill_impl(T* x, u64 n, u64 t, u64 s, T value) {
    GRID_STRIDE(i, n) {
        u64 j = i % s, q = (i / s) % t;
        if (j > q + (s - t)) x[i] = value;
    }
}

// Per row: probs = softmax(logits), loss_rows[r] = logsumexp - logits[target]. The host
// validated the targets; one outside 0..c all the same gives a NaN loss, never a wild read.
template <typename T, typename I>
__device__ void cross_entropy_rows_impl(const T* logits, const I* targets, T* probs, T* loss_rows, u64 rows,
                                        u64 c) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = logits + r * c;
        T m = neg_infinity<T>();
        for (u64 j = threadIdx.x; j < c; j += blockDim.x) m = max_nan<T>(m, row[j]);
        m = block_max<T>(m);
        T s = T(0);
        for (u64 j = threadIdx.x; j < c; j += blockDim.x) s += exp(row[j] - m);
        s = block_sum<T>(s);
        T inv = T(1) / s;
        for (u64 j = threadIdx.x; j < c; j += blockDim.x) probs[r * c + j] = exp(row[j] - m) * inv;
        if (threadIdx.x == 0) {
            i64 t = (i64)targets[r];
            if (t < 0 || (u64)t >= c) {
                loss_rows[r] = quiet_nan<T>();
            } else {
                loss_rows[r] = log(s) + m - row[t];
            }
        }
    }
}

// out[0] = sum(x) / divisor accumulated in f64, one block: the mean of the per-row
// losses, as the CPU accumulates it.
template <typename T>
__device__ void mean_f64_impl(const T* x, T* out, u64 n, double divisor) {
    double acc = 0.0;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) acc += (double)x[j];
    acc = block_sum<double>(acc);
    if (threadIdx.x == 0) out[0] = (T)(acc / divisor);
}

// (probs - onehot(targets)) * scale with scale = g[0] / divisor in f64, rounded to T (the
// upstream gradient stays on the device); targets were checked by the host.
template <typename T, typename I>
__device__ void cross_entropy_backward_impl(const T* probs, const I* targets, const T* g, T* out, u64 rows, u64 c,
                                            double divisor) {
    T scale = (T)((double)g[0] / divisor);
    GRID_STRIDE(i, rows * c) {
        u64 r = i / c, j = i % c;
        T v = probs[i];
        if ((i64)j == (i64)targets[r]) v += T(-1);
        out[i] = v * scale;
    }
}

#define NN_FLOAT(T, SUF)                                                                                           \
    extern "C" __global__ void softmax_rows_##SUF(const T* x, T* out, u64 rows, u64 d, int log_softmax) {          \
        softmax_rows_impl<T>(x, out, rows, d, log_softmax);                                                        \
    }                                                                                                              \
    extern "C" __global__ void softmax_backward_rows_##SUF(const T* y, const T* g, T* out, u64 rows, u64 d, int log_softmax) { \
        softmax_backward_rows_impl<T>(y, g, out, rows, d, log_softmax);                                            \
    }                                                                                                              \
    extern "C" __global__ void layer_norm_rows_##SUF(const T* x, const T* w, const T* b, T* out, T* mean, T* rstd, \
                                                     u64 rows, u64 d, T eps) {                                     \
        layer_norm_rows_impl<T>(x, w, b, out, mean, rstd, rows, d, eps);                                           \
    }                                                                                                              \
    extern "C" __global__ void layer_norm_backward_dx_##SUF(const T* x, const T* w, const T* g, const T* mean,      \
                                                            const T* rstd, T* dx, u64 rows, u64 d) {               \
        layer_norm_backward_dx_impl<T>(x, w, g, mean, rstd, dx, rows, d);                                          \
    }                                                                                                              \
    extern "C" __global__ void layer_norm_dwdb_partial_##SUF(const T* x, const T* g, const T* mean, const T* rstd, \
                                                             T* pw, T* pb, u64 rows, u64 d) {                      \
        layer_norm_dwdb_partial_impl<T>(x, g, mean, rstd, pw, pb, rows, d);                                        \
    }                                                                                                              \
    extern "C" __global__ void column_sum_##SUF(const T* p, T* out, u64 parts, u64 d) {                            \
        column_sum_impl<T>(p, out, parts, d);                                                                      \
    }                                                                                                              \
    extern "C" __global__ void causal_fill_##SUF(T* x, u64 n, u64 t, u64 s, T value) {                             \
        causal_fill_impl<T>(x, n, t, s, value);                                                                    \
    }                                                                                                              \
    extern "C" __global__ void mean_f64_##SUF(const T* x, T* out, u64 n, double divisor) { mean_f64_impl<T>(x, out, n, divisor); }

#define NN_INDEXED(T, SUF, I, ISUF)                                                                                \
    extern "C" __global__ void embedding_##SUF##_##ISUF(const T* w, const I* ids, T* out, u64 n_ids, u64 vocab,   \
                                                        u64 d) {                                                   \
        embedding_impl<T, I>(w, ids, out, n_ids, vocab, d);                                                        \
    }                                                                                                              \
    extern "C" __global__ void embedding_backward_##SUF##_##ISUF(const I* ids, const T* g, T* table, u64 n_ids,   \
                                                                 u64 vocab, u64 d) {                               \
        embedding_backward_impl<T, I>(ids, g, table, n_ids, vocab, d);                                             \
    }                                                                                                              \
    extern "C" __global__ void cross_entropy_rows_##SUF##_##ISUF(const T* logits, const I* targets, T* probs,     \
                                                                 T* loss_rows, u64 rows, u64 c) {                  \
        cross_entropy_rows_impl<T, I>(logits, targets, probs, loss_rows, rows, c);                                 \
    }                                                                                                              \
    extern "C" __global__ void cross_entropy_backward_##SUF##_##ISUF(const T* probs, const I* targets, const T* g, \
                                                                     T* out, u64 rows, u64 c, double divisor) {     \
        cross_entropy_backward_impl<T, I>(probs, targets, g, out, rows, c, divisor);                                \
    }

NN_FLOAT(float, f32)
NN_FLOAT(double, f64)
NN_INDEXED(float, f32, i64, i64)
NN_INDEXED(float, f32, unsigned char, u8)
NN_INDEXED(double, f64, i64, i64)
NN_INDEXED(double, f64, unsigned char, u8)
