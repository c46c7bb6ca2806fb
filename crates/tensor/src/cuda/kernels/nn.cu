// Neural-network kernels over the last axis of contiguous [rows, d] buffers: softmax,
// log-softmax and their backwards, layer norm forward/backward, embedding gather and its
// scatter-add backward, the causal mask, cross-entropy. One block per row unless noted.
// Same maths as crates/tensor/src/ops/nn.rs. Each kernel is templated on its storage type S
// and computes in T = Compute<S>::T: 16-bit storage is loaded exactly, every sum, mean and
// exponential runs in f32, and each output (mean and rstd too) is rounded once, as the CPU's
// 16-bit kernels do. The embedding's backward of 16-bit gradients runs the f32 kernel on an f32
// table (the host widens and narrows), so that repeated ids add up in f32.

template <typename S>
__device__ void softmax_rows_impl(const S* x, S* out, u64 rows, u64 d, int log_softmax) {
    typedef typename Compute<S>::T T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* row = x + r * d;
        S* o = out + r * d;
        T m = neg_infinity<T>();
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) m = max_nan<T>(m, load_c(row[j]));
        m = block_max<T>(m);
        T s = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += exp(load_c(row[j]) - m);
        s = block_sum<T>(s);
        if (log_softmax) {
            T lse = log(s) + m;
            for (u64 j = threadIdx.x; j < d; j += blockDim.x) o[j] = store_c<S>(load_c(row[j]) - lse);
        } else {
            T inv = T(1) / s;
            for (u64 j = threadIdx.x; j < d; j += blockDim.x) o[j] = store_c<S>(exp(load_c(row[j]) - m) * inv);
        }
    }
}

// softmax: o = y * (g - sum(g * y)); log-softmax: o = g - exp(y) * sum(g).
template <typename S>
__device__ void softmax_backward_rows_impl(const S* y, const S* g, S* out, u64 rows, u64 d, int log_softmax) {
    typedef typename Compute<S>::T T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* yr = y + r * d;
        const S* gr = g + r * d;
        S* o = out + r * d;
        T s = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x)
            s += log_softmax ? load_c(gr[j]) : load_c(gr[j]) * load_c(yr[j]);
        s = block_sum<T>(s);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
            T yj = load_c(yr[j]), gj = load_c(gr[j]);
            o[j] = store_c<S>(log_softmax ? gj - exp(yj) * s : yj * (gj - s));
        }
    }
}

// y = (x - mean) * rstd * w + b; saves mean and rstd = 1/sqrt(var + eps) per row.
template <typename S>
__device__ void layer_norm_rows_impl(const S* x, const S* w, const S* b, S* out, S* mean_out, S* rstd_out,
                                     u64 rows, u64 d, typename Compute<S>::T eps) {
    typedef typename Compute<S>::T T;
    T inv_d = T(1) / T(d);
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* row = x + r * d;
        S* o = out + r * d;
        T s = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += load_c(row[j]);
        T mean = block_sum<T>(s) * inv_d;
        T v = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
            T c = load_c(row[j]) - mean;
            v += c * c;
        }
        T rstd = T(1) / sqrt(block_sum<T>(v) * inv_d + eps);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x)
            o[j] = store_c<S>((load_c(row[j]) - mean) * rstd * load_c(w[j]) + load_c(b[j]));
        if (threadIdx.x == 0) {
            mean_out[r] = store_c<S>(mean);
            rstd_out[r] = store_c<S>(rstd);
        }
    }
}

// dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)) per row.
template <typename S>
__device__ void layer_norm_backward_dx_impl(const S* x, const S* w, const S* g, const S* mean, const S* rstd, S* dx,
                                            u64 rows, u64 d) {
    typedef typename Compute<S>::T T;
    T inv_d = T(1) / T(d);
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* xr = x + r * d;
        const S* gr = g + r * d;
        T m = load_c(mean[r]), rs = load_c(rstd[r]);
        T s1 = T(0), s2 = T(0);
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
            T dxhat = load_c(gr[j]) * load_c(w[j]);
            s1 += dxhat;
            s2 += dxhat * (load_c(xr[j]) - m) * rs;
        }
        s1 = block_sum<T>(s1) * inv_d;
        s2 = block_sum<T>(s2) * inv_d;
        for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
            T xhat = (load_c(xr[j]) - m) * rs;
            dx[r * d + j] = store_c<S>(rs * (load_c(gr[j]) * load_c(w[j]) - s1 - xhat * s2));
        }
    }
}

// dw[j] = sum_r g*xhat, db[j] = sum_r g in two stages, deterministic (a fixed order, no
// atomics). Stage 1: a block of 32 columns x 8 thread rows sums chunks of COL_CHUNK rows
// (chunks blockIdx.y, blockIdx.y + gridDim.y, ...) into one partial row per blockIdx.y;
// stage 2 (column_sum) adds the gridDim.y partial rows of each column in order. The partial
// rows are in the compute type (f32 for 16-bit storage): only the column sums are rounded.
#define COL_CHUNK 64
template <typename S>
__device__ void layer_norm_dwdb_partial_impl(const S* x, const S* g, const S* mean, const S* rstd,
                                             typename Compute<S>::T* pw, typename Compute<S>::T* pb, u64 rows, u64 d) {
    typedef typename Compute<S>::T T;
    __shared__ T sw[8][33];
    __shared__ T sb[8][33];
    u64 j = (u64)blockIdx.x * 32 + threadIdx.x;
    T aw = T(0), ab = T(0);
    if (j < d) {
        for (u64 c = blockIdx.y; c * COL_CHUNK < rows; c += gridDim.y) {
            u64 end = (c + 1) * COL_CHUNK < rows ? (c + 1) * COL_CHUNK : rows;
            for (u64 r = c * COL_CHUNK + threadIdx.y; r < end; r += 8) {
                T gv = load_c(g[r * d + j]);
                aw += gv * (load_c(x[r * d + j]) - load_c(mean[r])) * load_c(rstd[r]);
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

// out[j] = sum over the `parts` rows of p[parts, d] (in the compute type), in row order.
template <typename S>
__device__ void column_sum_impl(const typename Compute<S>::T* p, S* out, u64 parts, u64 d) {
    typedef typename Compute<S>::T T;
    GRID_STRIDE(j, d) {
        T a = T(0);
        for (u64 k = 0; k < parts; ++k) a += p[k * d + j];
        out[j] = store_c<S>(a);
    }
}

// out[r, :] = w[ids[r], :]. The host validated the ids (before uploading them); an id outside
// 0..vocab all the same reads nothing and gives a zero row.
template <typename S, typename I>
__device__ void embedding_impl(const S* w, const I* ids, S* out, u64 n_ids, u64 vocab, u64 d) {
    typedef typename Compute<S>::T T;
    GRID_STRIDE(i, n_ids * d) {
        u64 r = i / d, j = i % d;
        i64 id = (i64)ids[r];
        out[i] = (id < 0 || (u64)id >= vocab) ? store_c<S>(T(0)) : w[(u64)id * d + j];
    }
}

// table[ids[r], :] += g[r, :] (atomics: repeated ids add up in an unspecified order); an id
// outside 0..vocab (validated away by the host) writes nothing. f32 and f64 only.
template <typename T, typename I>
__device__ void embedding_backward_impl(const I* ids, const T* g, T* table, u64 n_ids, u64 vocab, u64 d) {
    GRID_STRIDE(i, n_ids * d) {
        u64 r = i / d, j = i % d;
        i64 id = (i64)ids[r];
        if (id >= 0 && (u64)id < vocab) atomicAdd(&table[(u64)id * d + j], g[i]);
    }
}

// In place on a contiguous [.., t, s] buffer: key j after query i (j > i + s - t) := value
// (the value's bits, already rounded to S by the host).
template <typename S>
__device__ void causal_fill_impl(S* x, u64 n, u64 t, u64 s, S value) {
    GRID_STRIDE(i, n) {
        u64 j = i % s, q = (i / s) % t;
        if (j > q + (s - t)) x[i] = value;
    }
}

// Per row: probs = softmax(logits), loss_rows[r] = logsumexp - logits[target]. The host
// validated the targets; one outside 0..c all the same gives a NaN loss, never a wild read.
template <typename S, typename I>
__device__ void cross_entropy_rows_impl(const S* logits, const I* targets, S* probs, S* loss_rows, u64 rows,
                                        u64 c) {
    typedef typename Compute<S>::T T;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* row = logits + r * c;
        T m = neg_infinity<T>();
        for (u64 j = threadIdx.x; j < c; j += blockDim.x) m = max_nan<T>(m, load_c(row[j]));
        m = block_max<T>(m);
        T s = T(0);
        for (u64 j = threadIdx.x; j < c; j += blockDim.x) s += exp(load_c(row[j]) - m);
        s = block_sum<T>(s);
        T inv = T(1) / s;
        for (u64 j = threadIdx.x; j < c; j += blockDim.x) probs[r * c + j] = store_c<S>(exp(load_c(row[j]) - m) * inv);
        if (threadIdx.x == 0) {
            i64 t = (i64)targets[r];
            if (t < 0 || (u64)t >= c) {
                loss_rows[r] = store_c<S>(quiet_nan<T>());
            } else {
                loss_rows[r] = store_c<S>(log(s) + m - load_c(row[t]));
            }
        }
    }
}

// out[0] = sum(x) / divisor accumulated in f64, one block: the mean of the per-row
// losses, as the CPU accumulates it.
template <typename S>
__device__ void mean_f64_impl(const S* x, S* out, u64 n, double divisor) {
    typedef typename Compute<S>::T T;
    double acc = 0.0;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) acc += (double)load_c(x[j]);
    acc = block_sum<double>(acc);
    if (threadIdx.x == 0) out[0] = store_c<S>((T)(acc / divisor));
}

// (probs - onehot(targets)) * scale with scale = g[0] / divisor in f64, rounded to the
// compute type (the upstream gradient stays on the device); targets were checked by the host.
template <typename S, typename I>
__device__ void cross_entropy_backward_impl(const S* probs, const I* targets, const S* g, S* out, u64 rows, u64 c,
                                            double divisor) {
    typedef typename Compute<S>::T T;
    T scale = (T)((double)load_c(g[0]) / divisor);
    GRID_STRIDE(i, rows * c) {
        u64 r = i / c, j = i % c;
        T v = load_c(probs[i]);
        if ((i64)j == (i64)targets[r]) v += T(-1);
        out[i] = store_c<S>(v * scale);
    }
}

#define NN_FLOAT(S, SUF)                                                                                           \
    extern "C" __global__ void softmax_rows_##SUF(const S* x, S* out, u64 rows, u64 d, int log_softmax) {          \
        softmax_rows_impl<S>(x, out, rows, d, log_softmax);                                                        \
    }                                                                                                              \
    extern "C" __global__ void softmax_backward_rows_##SUF(const S* y, const S* g, S* out, u64 rows, u64 d, int log_softmax) { \
        softmax_backward_rows_impl<S>(y, g, out, rows, d, log_softmax);                                            \
    }                                                                                                              \
    extern "C" __global__ void layer_norm_rows_##SUF(const S* x, const S* w, const S* b, S* out, S* mean, S* rstd, \
                                                     u64 rows, u64 d, Compute<S>::T eps) {                         \
        layer_norm_rows_impl<S>(x, w, b, out, mean, rstd, rows, d, eps);                                           \
    }                                                                                                              \
    extern "C" __global__ void layer_norm_backward_dx_##SUF(const S* x, const S* w, const S* g, const S* mean,      \
                                                            const S* rstd, S* dx, u64 rows, u64 d) {               \
        layer_norm_backward_dx_impl<S>(x, w, g, mean, rstd, dx, rows, d);                                          \
    }                                                                                                              \
    extern "C" __global__ void layer_norm_dwdb_partial_##SUF(const S* x, const S* g, const S* mean, const S* rstd, \
                                                             Compute<S>::T* pw, Compute<S>::T* pb, u64 rows, u64 d) { \
        layer_norm_dwdb_partial_impl<S>(x, g, mean, rstd, pw, pb, rows, d);                                        \
    }                                                                                                              \
    extern "C" __global__ void column_sum_##SUF(const Compute<S>::T* p, S* out, u64 parts, u64 d) {                \
        column_sum_impl<S>(p, out, parts, d);                                                                      \
    }                                                                                                              \
    extern "C" __global__ void causal_fill_##SUF(S* x, u64 n, u64 t, u64 s, S value) {                             \
        causal_fill_impl<S>(x, n, t, s, value);                                                                    \
    }                                                                                                              \
    extern "C" __global__ void mean_f64_##SUF(const S* x, S* out, u64 n, double divisor) { mean_f64_impl<S>(x, out, n, divisor); }

#define NN_INDEXED(S, SUF, I, ISUF)                                                                                \
    extern "C" __global__ void embedding_##SUF##_##ISUF(const S* w, const I* ids, S* out, u64 n_ids, u64 vocab,   \
                                                        u64 d) {                                                   \
        embedding_impl<S, I>(w, ids, out, n_ids, vocab, d);                                                        \
    }                                                                                                              \
    extern "C" __global__ void cross_entropy_rows_##SUF##_##ISUF(const S* logits, const I* targets, S* probs,     \
                                                                 S* loss_rows, u64 rows, u64 c) {                  \
        cross_entropy_rows_impl<S, I>(logits, targets, probs, loss_rows, rows, c);                                 \
    }                                                                                                              \
    extern "C" __global__ void cross_entropy_backward_##SUF##_##ISUF(const S* probs, const I* targets, const S* g, \
                                                                     S* out, u64 rows, u64 c, double divisor) {     \
        cross_entropy_backward_impl<S, I>(probs, targets, g, out, rows, c, divisor);                                \
    }

#define NN_ACCUMULATE(T, SUF, I, ISUF)                                                                             \
    extern "C" __global__ void embedding_backward_##SUF##_##ISUF(const I* ids, const T* g, T* table, u64 n_ids,   \
                                                                 u64 vocab, u64 d) {                               \
        embedding_backward_impl<T, I>(ids, g, table, n_ids, vocab, d);                                             \
    }

NN_FLOAT(float, f32)
NN_FLOAT(double, f64)
NN_FLOAT(f16_t, f16)
NN_FLOAT(bf16_t, bf16)
NN_INDEXED(float, f32, i64, i64)
NN_INDEXED(float, f32, unsigned char, u8)
NN_INDEXED(double, f64, i64, i64)
NN_INDEXED(double, f64, unsigned char, u8)
NN_INDEXED(f16_t, f16, i64, i64)
NN_INDEXED(f16_t, f16, unsigned char, u8)
NN_INDEXED(bf16_t, bf16, i64, i64)
NN_INDEXED(bf16_t, bf16, unsigned char, u8)
NN_ACCUMULATE(float, f32, i64, i64)
NN_ACCUMULATE(float, f32, unsigned char, u8)
NN_ACCUMULATE(double, f64, i64, i64)
NN_ACCUMULATE(double, f64, unsigned char, u8)
