// The host check of indexing.cu run by scripts/emulate-kernels.sh.
#include "prelude.h"
#include "indexing.cu"
#include <cstdio>
#include <algorithm>
#include <random>

// CPU reference: stable order, NaN largest, -0 == 0, reversed for descending, ties by position
template <typename T> int cmpv(T a, T b) {
    bool an = a != a, bn = b != b;
    if (an || bn) return (int)an - (int)bn;
    return a < b ? -1 : (b < a ? 1 : 0);
}
template <typename T>
bool check_sort(u64 rows, u64 n, u64 k, int desc, unsigned blocks, std::mt19937& rng) {
    const double pool[] = {-1.5, -0.0, 0.0, 2.0, 3.25, NAN, INFINITY, -INFINITY};
    std::vector<T> x(rows * n);
    for (auto& v : x) v = (T)pool[rng() % 8];
    std::vector<T> vals(rows * k);
    std::vector<i64> ids(rows * k);
    // the launches of CudaStorage::sort_rows (crates/tensor/src/cuda/ops/indexing.rs)
    u64 tiles = (n + SORT_TILE - 1) / SORT_TILE, keep = std::min<u64>(k, SORT_TILE);
    u64 len = (tiles - 1) * keep + std::min<u64>(n - (tiles - 1) * SORT_TILE, keep);
    std::vector<T> va(rows * len), vb(rows * len);
    std::vector<i64> ia(rows * len), ib(rows * len);
    run_grid(blocks, [&] { sort_tiles_impl<T>(x.data(), va.data(), ia.data(), rows, n, len, keep, desc); });
    for (u64 w = keep; len > w;) {
        u64 next = std::min<u64>(2 * w, k), pairs = (len + 2 * w - 1) / (2 * w);
        u64 out = (pairs - 1) * next + std::min<u64>(len - (pairs - 1) * 2 * w, next);
        run_grid(blocks, [&] { merge_runs_impl<T>(va.data(), ia.data(), vb.data(), ib.data(), rows, len, w, next, out, desc); });
        std::swap(va, vb);
        std::swap(ia, ib);
        len = out;
        w = next;
    }
    if (len != k) {
        printf("sort FAIL: %llu left a row, want %llu\n", len, k);
        return false;
    }
    std::copy(va.begin(), va.begin() + rows * k, vals.begin());
    std::copy(ia.begin(), ia.begin() + rows * k, ids.begin());
    for (u64 r = 0; r < rows; ++r) {
        std::vector<i64> p(n);
        for (u64 i = 0; i < n; ++i) p[i] = i;
        const T* row = x.data() + r * n;
        std::stable_sort(p.begin(), p.end(), [&](i64 a, i64 b) { int o = cmpv(row[a], row[b]); return (desc ? -o : o) < 0; });
        for (u64 j = 0; j < k; ++j) {
            T want = row[p[j]], got = vals[r * k + j];
            bool same = memcmp(&want, &got, sizeof(T)) == 0;
            if (ids[r * k + j] != p[j] || !same) {
                printf("sort FAIL rows %llu n %llu k %llu desc %d at row %llu j %llu: id %lld want %lld\n", rows, n, k, desc, r, j, ids[r * k + j], p[j]);
                return false;
            }
        }
    }
    return true;
}

// gather and scatter-add over shape x (rank 3) along dim with an index of shape is
bool check_index(unsigned int dim, std::vector<u64> xs, std::vector<u64> is, bool bcast, unsigned blocks, std::mt19937& rng) {
    StridedLayout lx{}, li{};
    lx.rank = li.rank = xs.size();
    u64 xn = 1, in = 1;
    for (int d = xs.size() - 1; d >= 0; --d) { lx.shape[d] = xs[d]; lx.strides[d] = xn; xn *= xs[d]; }
    for (int d = is.size() - 1; d >= 0; --d) { li.shape[d] = is[d]; li.strides[d] = in; in *= is[d]; }
    // a broadcast index: one value per position along dim (index_add's spread index), stride 0 elsewhere
    std::vector<i64> idv;
    if (bcast) {
        for (u64 d = 0; d < is.size(); ++d) li.strides[d] = d == dim ? 1 : 0;
        idv.resize(is[dim]);
    } else {
        idv.resize(in);
    }
    li.offset = 3;  // the index starts at an offset in its storage
    std::vector<i64> store(idv.size() + 3, 999);
    for (auto& v : idv) v = rng() % xs[dim];
    std::copy(idv.begin(), idv.end(), store.begin() + 3);
    std::vector<float> x(xn), src(in), out(xn), g(in);
    for (auto& v : x) v = (float)(rng() % 1000) / 7.0f;
    for (auto& v : src) v = (float)(rng() % 1000) / 13.0f - 30.0f;
    out = x;
    u64 lines = in / is[dim];
    run_grid(blocks, [&] { scatter_add_lines_impl<float, i64>(out.data(), src.data(), store.data(), lx, li, dim, lines); });
    run_grid(blocks, [&] { gather_along_impl<unsigned int, i64>((const unsigned int*)x.data(), store.data(), (unsigned int*)g.data(), lx, li, dim, in); });
    // reference: row-major over the index
    std::vector<float> want = x;
    for (u64 e = 0; e < in; ++e) {
        u64 c[8], r = e, io = 0, xo = 0;
        for (int d = is.size() - 1; d >= 0; --d) { c[d] = r % is[d]; r /= is[d]; }
        for (u64 d = 0; d < is.size(); ++d) io += c[d] * li.strides[d];
        i64 id = store[3 + io];
        for (u64 d = 0; d < is.size(); ++d) xo += (d == dim ? (u64)id : c[d]) * lx.strides[d];
        want[xo] += src[e];
        if (memcmp(&g[e], &x[xo], 4) != 0) { printf("gather FAIL dim %u at %llu\n", dim, e); return false; }
    }
    if (memcmp(want.data(), out.data(), 4 * xn) != 0) { printf("scatter FAIL dim %u\n", dim); return false; }
    return true;
}

int main() {
    std::mt19937 rng(5);
    bool ok = true;
    for (int desc = 0; desc < 2; ++desc) {
        ok &= check_sort<float>(3, 11, 11, desc, 2, rng);
        ok &= check_sort<float>(3, 11, 4, desc, 1, rng);
        ok &= check_sort<double>(2, 2048, 2048, desc, 1, rng);
        ok &= check_sort<double>(2, 2600, 2600, desc, 3, rng);
        ok &= check_sort<float>(1, 9000, 100, desc, 4, rng);
        ok &= check_sort<float>(2, 9000, 3000, desc, 4, rng);
        ok &= check_sort<double>(1, 20000, 1, desc, 7, rng);
        ok &= check_sort<float>(3, 6200, 5000, desc, 4, rng);
        ok &= check_sort<float>(2, 2049, 2048, desc, 2, rng);
        ok &= check_sort<float>(2, 4097, 4097, desc, 5, rng);
        ok &= check_sort<float>(1, 1, 1, desc, 1, rng);
    }
    for (unsigned dim = 0; dim < 3; ++dim) {
        std::vector<u64> xs = {5, 6, 7}, is = {4, 5, 6};
        is[dim] = 600;  // longer than a block: chunks, repeats across and within chunks
        ok &= check_index(dim, xs, is, false, 3, rng);
        ok &= check_index(dim, xs, {xs[0], xs[1], xs[2]}, false, 2, rng);
        std::vector<u64> bs = xs; bs[dim] = 300;
        ok &= check_index(dim, xs, bs, true, 2, rng);
    }
    ok &= check_index(0, {50}, {3000}, false, 1, rng);
    printf(ok ? "ALL OK\n" : "FAILED\n");
    return ok ? 0 : 1;
}
