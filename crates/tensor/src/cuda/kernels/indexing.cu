// Sorting rows and moving elements by integer index: the sort behind sort, argsort and topk,
// gather, and scatter-add (index_add). The CPU's crates/tensor/src/cpu/indexing.rs is the
// reference: the sort's order and the scatter's order of additions are the same here, so
// every result equals the CPU's bit for bit.

// A row of at most SORT_TILE elements is sorted in shared memory by one block (bitonic); a
// longer row is sorted in tiles of SORT_TILE, then the sorted runs are merged pairwise in
// global memory, one pass per doubling (merge_runs). Only the first k of a row are asked
// for, and they are among the first k of any run holding them: each tile and each merged
// run keeps its first k only, so top-k of a long row moves less with each pass once runs
// outgrow k. Two arrays of 2048 elements (values in the compute type, positions as i64)
// take 32 KiB of shared memory for f64.
#define SORT_TILE 2048
// The position of a padding slot of a tile: after every element.
#define SORT_PAD 0x7fffffffffffffffLL

// The sort's total order (the CPU's): numbers as < orders them (-0.0 == 0.0), NaN above
// every number and equal to another NaN, reversed when descending; equal values by lower
// position in both directions. Positions are distinct, so the order is strict.
template <typename T>
__device__ __forceinline__ bool sorts_before(T a, i64 pa, T b, i64 pb, int descending) {
    if (pa == SORT_PAD) return false;
    if (pb == SORT_PAD) return true;
    bool an = a != a, bn = b != b;
    int o;
    if (an || bn) {
        o = (int)an - (int)bn;
    } else {
        o = (a < b) ? -1 : ((b < a) ? 1 : 0);
    }
    if (descending) o = -o;
    return o < 0 || (o == 0 && pa < pb);
}

// Rows [rows, n] of x cut into tiles of SORT_TILE: one block sorts one tile (row r, tile t)
// in shared memory and writes its first `keep` elements (the values' own bits, and their
// positions in the row) at vals/ids + r * out_len + t * keep: runs of `keep` (the last one
// maybe shorter), out_len of them a row. A row of one tile gives the answer with out_len =
// keep = k. Launched with BRIGADE_BLOCK threads.
template <typename S>
__device__ void sort_tiles_impl(const S* x, S* vals, i64* ids, u64 rows, u64 n, u64 out_len, u64 keep,
                                int descending) {
    typedef typename Compute<S>::T T;
    __shared__ T sv[SORT_TILE];
    __shared__ i64 si[SORT_TILE];
    u64 tiles = (n + SORT_TILE - 1) / SORT_TILE;
    for (u64 b = blockIdx.x; b < rows * tiles; b += gridDim.x) {
        u64 r = b / tiles, start = (b % tiles) * SORT_TILE;
        u64 len = n - start < SORT_TILE ? n - start : SORT_TILE;
        unsigned int p = 1;
        while (p < len) p <<= 1;
        const S* row = x + r * n;
        for (unsigned int i = threadIdx.x; i < p; i += blockDim.x) {
            if (i < len) {
                sv[i] = load_c(row[start + i]);
                si[i] = (i64)(start + i);
            } else {
                sv[i] = T(0);
                si[i] = SORT_PAD;
            }
        }
        __syncthreads();
        for (unsigned int size = 2; size <= p; size <<= 1) {
            for (unsigned int stride = size >> 1; stride > 0; stride >>= 1) {
                for (unsigned int i = threadIdx.x; i < p; i += blockDim.x) {
                    unsigned int l = i ^ stride;
                    if (l > i) {
                        bool up = (i & size) == 0;
                        bool swap = up ? sorts_before<T>(sv[l], si[l], sv[i], si[i], descending)
                                       : sorts_before<T>(sv[i], si[i], sv[l], si[l], descending);
                        if (swap) {
                            T tv = sv[i];
                            sv[i] = sv[l];
                            sv[l] = tv;
                            i64 ti = si[i];
                            si[i] = si[l];
                            si[l] = ti;
                        }
                    }
                }
                __syncthreads();
            }
        }
        u64 w = len < keep ? len : keep;
        for (u64 i = threadIdx.x; i < w; i += blockDim.x) {
            u64 o = r * out_len + (b % tiles) * keep + i;
            vals[o] = row[si[i]];
            ids[o] = si[i];
        }
        __syncthreads();
    }
}

// One merge pass over rows [rows, n] of sorted runs of w elements (the last run of a row may
// be shorter): runs 2j and 2j+1 become run j of the output, of which the first `keep` are
// written, at vout/iout + r * n_out + j * keep. Each element's place in the merged run is
// its rank in its own run plus the number of elements of the other run that sort before it
// (a binary search: the order is strict, so no two elements claim one place).
template <typename S>
__device__ void merge_runs_impl(const S* vin, const i64* iin, S* vout, i64* iout, u64 rows, u64 n, u64 w,
                                u64 keep, u64 n_out, int descending) {
    typedef typename Compute<S>::T T;
    GRID_STRIDE(e, rows * n) {
        u64 r = e / n, p = e % n;
        u64 q = p / w;
        u64 other = (q ^ 1ULL) * w;
        const S* rv = vin + r * n;
        const i64* ri = iin + r * n;
        T v = load_c(rv[p]);
        i64 pos = ri[p];
        u64 before = 0;
        if (other < n) {
            u64 lo = other, hi = other + w < n ? other + w : n;
            while (lo < hi) {
                u64 mid = lo + (hi - lo) / 2;
                if (sorts_before<T>(load_c(rv[mid]), ri[mid], v, pos, descending)) {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            before = lo - other;
        }
        u64 rank = (p - q * w) + before;
        if (rank < keep) {
            u64 dst = r * n_out + (q >> 1) * keep + rank;
            vout[dst] = rv[p];
            iout[dst] = pos;
        }
    }
}

// Offsets of element e (row-major) of an index of layout li, for a tensor x of contiguous
// layout lx and the same rank: the index element's own offset (returned), and in *base the
// offset in x of e's coordinates with the one along dim left out.
__device__ __forceinline__ u64 index_offsets(const StridedLayout& li, const StridedLayout& lx, unsigned int dim, u64 e,
                                             u64* base) {
    u64 o = li.offset, b = 0;
    for (int d = (int)li.rank - 1; d >= 0; --d) {
        u64 s = li.shape[d];
        u64 c = e % s;
        e /= s;
        o += c * li.strides[d];
        if ((unsigned int)d != dim) b += c * lx.strides[d];
    }
    *base = b;
    return o;
}

// out[e] = x[e's coordinates with ids[e] along dim], for the n elements of the index (any
// layout; out contiguous of its shape). Moves bits: one kernel per element size. The host
// validated the ids; one outside 0..shape[dim] all the same reads nothing and gives zero bits.
template <typename B, typename I>
__device__ void gather_along_impl(const B* x, const I* ids, B* out, StridedLayout lx, StridedLayout li,
                                  unsigned int dim, u64 n) {
    GRID_STRIDE(e, n) {
        u64 base;
        i64 id = (i64)ids[index_offsets(li, lx, dim, e, &base)];
        out[e] = (id < 0 || (u64)id >= lx.shape[dim]) ? B(0) : x[base + (u64)id * lx.strides[dim]];
    }
}

// out[e's coordinates with ids[e] along dim] += src[e] in place, in the index's row-major
// order, as the CPU adds: bit for bit the CPU's sums, and the same on every run (no atomics).
// The elements of the index that differ only along dim (a "line", `lines` of them) are the
// only ones that can name one target, so one block takes one line, in chunks of blockDim.x
// elements in order: each target of a chunk is summed by the thread of its first occurrence,
// which adds the chunk's occurrences in order. f32 and f64 (16-bit storages are widened by
// the host and rounded once, as the CPU does). src is contiguous of the index's shape.
template <typename T, typename I>
__device__ void scatter_add_lines_impl(T* out, const T* src, const I* ids, StridedLayout lx, StridedLayout li,
                                       unsigned int dim, u64 lines) {
    __shared__ u64 target[BRIGADE_BLOCK];
    __shared__ T value[BRIGADE_BLOCK];
    const u64 none = ~0ULL;
    u64 m = li.shape[dim], inner = 1;
    for (unsigned int d = dim + 1; d < li.rank; ++d) inner *= li.shape[d];
    for (u64 line = blockIdx.x; line < lines; line += gridDim.x) {
        u64 outer = line / inner, in = line % inner;
        for (u64 j0 = 0; j0 < m; j0 += blockDim.x) {
            u64 j = j0 + threadIdx.x;
            u64 count = m - j0 < blockDim.x ? m - j0 : blockDim.x;
            if (j < m) {
                u64 e = (outer * m + j) * inner + in, base;
                i64 id = (i64)ids[index_offsets(li, lx, dim, e, &base)];
                bool ok = id >= 0 && (u64)id < lx.shape[dim];
                target[threadIdx.x] = ok ? base + (u64)id * lx.strides[dim] : none;
                value[threadIdx.x] = src[e];
            }
            __syncthreads();
            if (j < m && target[threadIdx.x] != none) {
                u64 mine = target[threadIdx.x];
                bool first = true;
                for (unsigned int u = 0; u < threadIdx.x && first; ++u) first = target[u] != mine;
                if (first) {
                    T acc = out[mine];
                    for (u64 u = threadIdx.x; u < count; ++u) {
                        if (target[u] == mine) acc += value[u];
                    }
                    out[mine] = acc;
                }
            }
            __syncthreads();
        }
    }
}

#define SORT_KERNELS(S, SUF)                                                                                     \
    extern "C" __global__ void sort_tiles_##SUF(const S* x, S* vals, i64* ids, u64 rows, u64 n, u64 out_len,     \
                                                u64 keep, int descending) {                                      \
        sort_tiles_impl<S>(x, vals, ids, rows, n, out_len, keep, descending);                                    \
    }                                                                                                            \
    extern "C" __global__ void merge_runs_##SUF(const S* vin, const i64* iin, S* vout, i64* iout, u64 rows,      \
                                                u64 n, u64 w, u64 keep, u64 n_out, int descending) {             \
        merge_runs_impl<S>(vin, iin, vout, iout, rows, n, w, keep, n_out, descending);                           \
    }

#define GATHER_ALONG(BYTES, B, I, ISUF)                                                                          \
    extern "C" __global__ void gather_along_b##BYTES##_##ISUF(const B* x, const I* ids, B* out, StridedLayout lx, \
                                                              StridedLayout li, unsigned int dim, u64 n) {       \
        gather_along_impl<B, I>(x, ids, out, lx, li, dim, n);                                                    \
    }

#define SCATTER_ADD(T, SUF, I, ISUF)                                                                             \
    extern "C" __global__ void scatter_add_lines_##SUF##_##ISUF(T* out, const T* src, const I* ids,              \
                                                                StridedLayout lx, StridedLayout li,              \
                                                                unsigned int dim, u64 lines) {                   \
        scatter_add_lines_impl<T, I>(out, src, ids, lx, li, dim, lines);                                         \
    }

SORT_KERNELS(float, f32)
SORT_KERNELS(double, f64)
SORT_KERNELS(f16_t, f16)
SORT_KERNELS(bf16_t, bf16)
GATHER_ALONG(2, u16, i64, i64)
GATHER_ALONG(2, u16, unsigned char, u8)
GATHER_ALONG(4, unsigned int, i64, i64)
GATHER_ALONG(4, unsigned int, unsigned char, u8)
GATHER_ALONG(8, u64, i64, i64)
GATHER_ALONG(8, u64, unsigned char, u8)
SCATTER_ADD(float, f32, i64, i64)
SCATTER_ADD(float, f32, unsigned char, u8)
SCATTER_ADD(double, f64, i64, i64)
SCATTER_ADD(double, f64, unsigned char, u8)
