// C++/OpenMP CPU kernels of vertical-slash sparse attention (docs/KERNEL_CONTRACT.md).
//
// FlashAttention-style online softmax in fp32 over the key tiles each query block reads: first
// the key blocks on its slash diagonals, then the vertical columns not already inside one of
// those blocks, gathered into tiles of block_size keys. Everything is derived from the compact
// per-head lists (pattern.h); no dense mask or per-row list is ever built.
//
// Parallelism and determinism: forward and dq own one (batch, head, query block) each; dk/dv own
// one (batch, kv head, key block) each and loop over the query heads of its GQA group. Every
// output element is written by one task in a fixed order, so results are bit-identical run to
// run, with no atomics. Tasks are handed out dynamically, longest first.

// ATen and torch's pybind11 casters, not torch/extension.h: its C++ frontend (nn, optim, ...) took
// 20 s of this file's 45 s compile on one core of the CI machine.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "mtraining/checks.h"
#include "mtraining/op_index.h"
#include "mtraining/pattern.h"

namespace mtraining {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr const char* kOpName = "mtraining_cpu";

inline float dot(const float* __restrict a, const float* __restrict b, int64_t dim) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < dim; ++d) acc += a[d] * b[d];
    return acc;
}

// Register-blocked micro-kernels. The tile products are small GEMMs (<= block rows x block keys
// x head_dim); each inner iteration updates kRowBlock rows x 2 vectors of 16 fp32 lanes held in
// registers, so every loaded vector feeds kRowBlock FMAs. GCC vector extensions make the
// blocking explicit and portable (on CPUs without AVX-512 GCC splits a vector in two). The
// summation order depends only on the tile, never on threads: results stay bit-identical.
typedef float Vec __attribute__((vector_size(64)));
typedef int32_t IntVec __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int kRowBlock = 8;  // 8 rows x 2 vectors: 16 accumulators of the 32 AVX-512 registers

// Calls block(std::integral_constant<int, R>(), r) for row blocks [r, r + R) covering `rows`
// rows: R = kRowBlock, then 4, 2, 1 for the rest.
template <class Block>
inline void for_each_row_block(int64_t rows, Block&& block) {
    int64_t r = 0;
    for (; r + kRowBlock <= rows; r += kRowBlock) block(std::integral_constant<int, kRowBlock>(), r);
    if (rows - r >= 4) {
        block(std::integral_constant<int, 4>(), r);
        r += 4;
    }
    if (rows - r >= 2) {
        block(std::integral_constant<int, 2>(), r);
        r += 2;
    }
    if (rows - r >= 1) block(std::integral_constant<int, 1>(), r);
}

inline Vec load_vec(const float* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store_vec(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// Keys per packed chunk: the score kernel's two vectors.
constexpr int64_t kChunk = 2 * kLanes;

inline int64_t padded_keys(int64_t n) { return (n + kChunk - 1) / kChunk * kChunk; }

// A key tile transposed into chunks of kChunk keys, each [head_dim][kChunk] and contiguous:
// packed[(e / kChunk) * dim * kChunk + d * kChunk + e % kChunk] = rows[e][d], zero for padding
// keys. The score kernel then streams one 16 KB (D = 128) chunk sequentially, from L1.
inline void pack_transposed(const float* const* rows, int64_t n, int64_t dim, float* packed) {
    const int64_t n_pad = padded_keys(n);
    for (int64_t e = 0; e < n; ++e) {
        const float* __restrict row = rows[e];
        float* __restrict column = packed + e / kChunk * dim * kChunk + e % kChunk;
        for (int64_t d = 0; d < dim; ++d) column[d * kChunk] = row[d];
    }
    for (int64_t e = n; e < n_pad; ++e) {
        float* column = packed + e / kChunk * dim * kChunk + e % kChunk;
        for (int64_t d = 0; d < dim; ++d) column[d * kChunk] = 0.f;
    }
}

// out[r * ld + e] = a[r] . key e for R rows and the kChunk keys of one packed chunk.
template <int R>
void row_block_products(const float* const* a, const float* __restrict chunk, int64_t dim,
                        float* __restrict out, int64_t ld) {
    Vec acc[R][2] = {};
    for (int64_t d = 0; d < dim; ++d) {
        const Vec k0 = load_vec(chunk + d * kChunk), k1 = load_vec(chunk + d * kChunk + kLanes);
        for (int r = 0; r < R; ++r) {
            const float x = a[r][d];
            acc[r][0] += x * k0;
            acc[r][1] += x * k1;
        }
    }
    for (int r = 0; r < R; ++r) {
        store_vec(out + r * ld, acc[r][0]);
        store_vec(out + r * ld + kLanes, acc[r][1]);
    }
}

// Sum of the lanes of v, pairwise (a fixed order, so results stay bit-identical).
inline float lane_sum(const Vec& v) {
    typedef float Half __attribute__((vector_size(32)));
    Half low, high;
    std::memcpy(&low, &v, sizeof low);
    std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
    const Half sum = low + high;
    return ((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7]));
}

// out[r * ld + e] = a[r] . b[e] for R rows and n keys, as dot products over head_dim: for tiles
// of few keys (a key block's vertical columns in dK/dV), which a padded chunk would mostly waste.
template <int R>
void row_block_dots(const float* const* a, const float* const* b, int64_t n, int64_t dim,
                    float* __restrict out, int64_t ld) {
    for (int64_t e = 0; e < n; ++e) {
        const float* __restrict key = b[e];
        Vec acc[R] = {};
        int64_t d = 0;
        for (; d + kLanes <= dim; d += kLanes) {
            const Vec k0 = load_vec(key + d);
            for (int r = 0; r < R; ++r) acc[r] += load_vec(a[r] + d) * k0;
        }
        for (int r = 0; r < R; ++r) {
            float tail = 0.f;  // head_dim not a multiple of 16
            for (int64_t t = d; t < dim; ++t) tail += a[r][t] * key[t];
            out[r * ld + e] = lane_sum(acc[r]) + tail;
        }
    }
}

// Tiles of at most this many keys take the dot-product path (no packing).
inline bool narrow_tile(int64_t n) { return n <= kLanes; }

// out[r * n_pad + e] = a[r] . key e for `rows` rows (row pointers a) and the n keys of a tile
// (rows `keys`, packed by pack_transposed unless narrow_tile(n)); padding keys give 0. Packed
// tiles go chunk by chunk, so that each chunk serves all rows while it is in L1.
inline void tile_products(const float* const* a, int64_t rows, const float* packed,
                          const float* const* keys, int64_t n, int64_t dim, float* out) {
    const int64_t n_pad = padded_keys(n);
    if (narrow_tile(n)) {
        for_each_row_block(rows, [&](auto block, int64_t r) {
            row_block_dots<decltype(block)::value>(a + r, keys, n, dim, out + r * n_pad, n_pad);
        });
        return;
    }
    for (int64_t e = 0; e < n_pad; e += kChunk) {
        const float* chunk = packed + e * dim;
        for_each_row_block(rows, [&](auto block, int64_t r) {
            row_block_products<decltype(block)::value>(a + r, chunk, dim, out + r * n_pad + e, n_pad);
        });
    }
}

// y[o] += sum over i < n of c[o * out_stride + i * in_stride] * b[i], for R output rows y[o]:
// P.V and dS.K (coefficients by row) as well as P^T.dO and dS^T.Q (coefficients by key).
template <int R>
void row_block_accumulate(float* const* y, const float* __restrict c, int64_t out_stride,
                          int64_t in_stride, const float* const* b, int64_t n, int64_t dim) {
    int64_t d = 0;
    for (; d + 2 * kLanes <= dim; d += 2 * kLanes) {
        Vec acc[R][2];
        for (int o = 0; o < R; ++o) {
            acc[o][0] = load_vec(y[o] + d);
            acc[o][1] = load_vec(y[o] + d + kLanes);
        }
        for (int64_t i = 0; i < n; ++i) {
            const Vec b0 = load_vec(b[i] + d), b1 = load_vec(b[i] + d + kLanes);
            for (int o = 0; o < R; ++o) {
                const float x = c[o * out_stride + i * in_stride];
                acc[o][0] += x * b0;
                acc[o][1] += x * b1;
            }
        }
        for (int o = 0; o < R; ++o) {
            store_vec(y[o] + d, acc[o][0]);
            store_vec(y[o] + d + kLanes, acc[o][1]);
        }
    }
    if (d + kLanes <= dim) {
        Vec acc[R];
        for (int o = 0; o < R; ++o) acc[o] = load_vec(y[o] + d);
        for (int64_t i = 0; i < n; ++i) {
            const Vec b0 = load_vec(b[i] + d);
            for (int o = 0; o < R; ++o) acc[o] += c[o * out_stride + i * in_stride] * b0;
        }
        for (int o = 0; o < R; ++o) store_vec(y[o] + d, acc[o]);
        d += kLanes;
    }
    for (; d < dim; ++d)  // head_dim not a multiple of 16
        for (int o = 0; o < R; ++o) {
            float acc = y[o][d];
            for (int64_t i = 0; i < n; ++i) acc += c[o * out_stride + i * in_stride] * b[i][d];
            y[o][d] = acc;
        }
}

// row_block_accumulate over `rows` output rows.
inline void tile_accumulate(float* const* y, int64_t rows, const float* c, int64_t out_stride,
                            int64_t in_stride, const float* const* b, int64_t n, int64_t dim) {
    for_each_row_block(rows, [&](auto block, int64_t o) {
        row_block_accumulate<decltype(block)::value>(y + o, c + o * out_stride, out_stride, in_stride,
                                                     b, n, dim);
    });
}

inline void scale_in_place(float* __restrict y, float alpha, int64_t n) {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) y[e] *= alpha;
}

// exp(x) for x <= 0 (softmax probabilities), lane-wise on 16 lanes: libm's expf does not
// vectorise without -ffast-math, which would break the -inf of empty rows. Cephes' range
// reduction and polynomial: relative error ~1e-7; exp(-inf) = 0.
inline Vec exp_nonpositive(const Vec& x) {
    constexpr float kLow = -87.33654f, kLog2e = 1.44269504088896341f;
    constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
    const Vec zero = {};
    Vec clamped = x < kLow ? zero + kLow : x;
    clamped = clamped > 0.f ? zero : clamped;
    // n = floor(y): conversion truncates towards zero, i.e. rounds y <= 0.5 up when inexact
    const Vec y = clamped * kLog2e + 0.5f;
    const Vec truncated = __builtin_convertvector(__builtin_convertvector(y, IntVec), Vec);
    const Vec n = truncated > y ? truncated - 1.f : truncated;
    const Vec r = clamped - n * kLn2Hi - n * kLn2Lo;
    Vec poly = zero + 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    poly = poly * r * r + r + 1.f;
    const IntVec bits = (__builtin_convertvector(n, IntVec) + 127) << 23;  // 2^n
    Vec two_to_n;
    std::memcpy(&two_to_n, &bits, sizeof two_to_n);
    return x < kLow ? zero : poly * two_to_n;
}

inline float exp_nonpositive(float x) {
    const Vec lanes = Vec{} + x;
    return exp_nonpositive(lanes)[0];
}

// Up to kLanes floats of p (n of them), the other lanes `fill`.
inline Vec load_partial(const float* p, int64_t n, float fill) {
    Vec v = Vec{} + fill;
    std::memcpy(&v, p, n * sizeof(float));
    return v;
}

// x[e] = exp(scale * x[e] - shift) for e < n; returns the sum (lane-wise, then pairwise).
inline float exp_shifted(float* __restrict x, int64_t n, float scale, float shift) {
    Vec sum = {};
    int64_t e = 0;
    for (; e + kLanes <= n; e += kLanes) {
        const Vec p = exp_nonpositive(load_vec(x + e) * scale - shift);
        store_vec(x + e, p);
        sum += p;
    }
    if (e < n) {
        const IntVec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const Vec p = exp_nonpositive(load_partial(x + e, n - e, 0.f) * scale - shift);
        std::memcpy(x + e, &p, (n - e) * sizeof(float));
        sum += lane < static_cast<int32_t>(n - e) ? p : Vec{};  // padding lanes add nothing
    }
    return lane_sum(sum);
}

// max over e < n of scale * x[e] (-inf for n = 0).
inline float max_scaled(const float* x, int64_t n, float scale) {
    Vec best = Vec{} + kNegInf;
    for (int64_t e = 0; e < n; e += kLanes) {
        const Vec v = load_partial(x + e, std::min<int64_t>(kLanes, n - e), kNegInf) * scale;
        best = v > best ? v : best;
    }
    float result = kNegInf;
    for (int64_t lane = 0; lane < kLanes; ++lane) result = std::max(result, best[lane]);
    return result;
}

// Logit soft-capping of raw scores x[e] = q.k, e < n: x[e] = cap * tanh(scale x[e] / cap), the
// logits themselves (the softmax then takes them with scale 1).
inline void soft_cap(float* x, int64_t n, float scale, float cap) {
    const float to_tanh = scale / cap;
    for (int64_t e = 0; e < n; ++e) x[e] = cap * std::tanh(x[e] * to_tanh);
}

// Read-only view of one call's fp32 inputs in layout [batch, seq, heads, head_dim].
struct Inputs {
    const float* q;
    const float* k;
    const float* v;
    const int32_t* slash;
    const int32_t* slash_count;
    const int32_t* vertical;
    const int32_t* vertical_count;
    const int32_t* doc_start;  // [batch][global positions] (document masking), or nullptr: none
    int64_t batch, heads, kv_heads, head_dim, slash_width, vertical_width;
    float scale;
    float softcap;  // > 0: the logits are softcap * tanh(scale q.k / softcap) (soft_cap)
    Geometry geo;

    // The factor exp_shifted and max_scaled take: scale on raw q.k, 1 on soft-capped logits.
    float exponent_scale() const { return softcap > 0.f ? 1.f : scale; }

    int64_t group() const { return heads / kv_heads; }
    int64_t q_offset(int64_t b, int64_t t, int64_t h) const {
        return ((b * geo.q_len + t) * heads + h) * head_dim;
    }
    int64_t k_offset(int64_t b, int64_t t, int64_t kvh) const {
        return ((b * geo.k_len + t) * kv_heads + kvh) * head_dim;
    }
    int64_t lse_offset(int64_t b, int64_t h, int64_t t) const {
        return (b * heads + h) * geo.q_len + t;
    }
    const int32_t* slash_of(int64_t b, int64_t h) const {
        return slash + (b * heads + h) * slash_width;
    }
    int64_t slash_len(int64_t b, int64_t h) const { return slash_count[b * heads + h]; }
    const int32_t* vertical_of(int64_t b, int64_t h) const {
        return vertical + (b * heads + h) * vertical_width;
    }
    int64_t vertical_len(int64_t b, int64_t h) const { return vertical_count[b * heads + h]; }
    // First local key that local query t of batch b may see under document masking.
    int64_t key_limit(int64_t b, int64_t t) const {
        return geo.first_key_at(doc_start[b * geo.q_len * geo.world + geo.query_global_token(t)]);
    }
};

// Per-thread working memory, sized once for tiles of up to `block` keys and rows.
struct Scratch {
    std::vector<int32_t> keys, columns;
    std::vector<const float*> k_rows, v_rows, q_rows, dout_rows;  // rows read by a tile product
    std::vector<float*> query_out_rows, dk_rows, dv_rows;         // rows a tile accumulates into
    std::vector<float> k_packed, v_packed;  // [head_dim][padded keys]: the tile transposed
    std::vector<float> scores, dscores;     // [query row][padded keys]: S or P, and dP or dS
    std::vector<float> running_max, running_sum;
    std::vector<int64_t> key_limits;  // per row of a query block: its first visible key (load_key_limits)

    Scratch(int64_t block, int64_t dim)
        : k_rows(block), v_rows(block), q_rows(block), dout_rows(block), query_out_rows(block),
          dk_rows(block), dv_rows(block), k_packed(dim * padded_keys(block)),
          v_packed(dim * padded_keys(block)), scores(block * padded_keys(block)),
          dscores(block * padded_keys(block)), running_max(block), running_sum(block), key_limits(block, 0) {
        keys.reserve(block);
        columns.reserve(block);
    }
};

// Fills scratch.key_limits with the first local key each row of query block i may see under
// document masking and returns the lowest; without masking they stay 0.
inline int64_t load_key_limits(const Inputs& in, int64_t b, int64_t i, Scratch& scratch) {
    if (in.doc_start == nullptr) return 0;
    const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
    for (int64_t r = 0; r < rows; ++r) scratch.key_limits[r] = in.key_limit(b, first + r);
    return *std::min_element(scratch.key_limits.begin(), scratch.key_limits.begin() + rows);
}

// Keys [begin, end) of a tile (ascending local keys) that query row t may see: those at or after
// its document's first key `key_limit`, and on the token-causal diagonal tile (keys of the
// query's own block) those <= t. The lower bound is searched only when it cuts into the tile.
struct KeyRange {
    int64_t begin, end;
};

inline KeyRange visible_keys(const int32_t* keys, int64_t n, bool causal, int64_t t, int64_t key_limit) {
    const int64_t end = causal ? std::max<int64_t>(0, std::min<int64_t>(n, t - keys[0] + 1)) : n;
    const int64_t begin = key_limit > keys[0] ? std::min(end, sorted_lower_bound(keys, n, key_limit)) : 0;
    return {begin, end};
}

inline void fill_block(std::vector<int32_t>& keys, int64_t first, int64_t n) {
    keys.resize(n);
    for (int64_t e = 0; e < n; ++e) keys[e] = static_cast<int32_t>(first + e);
}

// Points scratch.k_rows / v_rows at the K and V rows of a tile's keys and packs K transposed
// (and V too when `pack_values`: the backward's dP = dO.V^T) unless the tile is narrow.
inline void load_key_tile(const Inputs& in, int64_t b, int64_t kvh, const int32_t* keys, int64_t n,
                          bool pack_values, Scratch& scratch) {
    for (int64_t e = 0; e < n; ++e) {
        const int64_t offset = in.k_offset(b, keys[e], kvh);
        scratch.k_rows[e] = in.k + offset;
        scratch.v_rows[e] = in.v + offset;
    }
    if (narrow_tile(n)) return;
    pack_transposed(scratch.k_rows.data(), n, in.head_dim, scratch.k_packed.data());
    if (pack_values) pack_transposed(scratch.v_rows.data(), n, in.head_dim, scratch.v_packed.data());
}

// Points scratch.q_rows and query_out_rows (rows of `query_out`, and dout_rows when `dout` is
// given) at the rows of local query block i of head h; returns the row count.
inline int64_t load_query_rows(const Inputs& in, const float* dout, float* query_out, int64_t b,
                               int64_t h, int64_t i, Scratch& scratch) {
    const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t offset = in.q_offset(b, first + r, h);
        scratch.q_rows[r] = in.q + offset;
        if (dout != nullptr) scratch.dout_rows[r] = dout + offset;
        if (query_out != nullptr) scratch.query_out_rows[r] = query_out + offset;
    }
    return rows;
}

// Calls visit(keys, n, causal) for every key tile local query block i of head h reads: the key
// block of each slash diagonal that connects this rank pair, then the vertical columns on the key
// rank that lie in earlier blocks no slash diagonal covers, block_size keys per tile. Keys before
// min_key (the block's lowest document limit) are seen by no row: skipped.
template <class Visit>
void for_each_key_tile(const Inputs& in, int64_t b, int64_t h, int64_t i, int64_t min_key,
                       std::vector<int32_t>& keys, Visit&& visit) {
    const Geometry& geo = in.geo;
    const int32_t* slash = in.slash_of(b, h);
    const int64_t slash_len = in.slash_len(b, h);
    for (int64_t e = 0; e < slash_len; ++e) {
        const int64_t j = geo.key_block_of(i, slash[e]);
        if (j < 0 || j * geo.block + geo.key_rows(j) <= min_key) continue;
        fill_block(keys, j * geo.block, geo.key_rows(j));
        visit(keys.data(), static_cast<int64_t>(keys.size()), slash[e] == 0);
    }
    const int64_t g = geo.query_block_global(i);
    const int32_t* columns = in.vertical_of(b, h);
    const int64_t vertical_len = in.vertical_len(b, h);
    keys.clear();
    for (int64_t e = 0; e < vertical_len; ++e) {
        const int64_t column = columns[e];
        const int64_t column_block = column / geo.block;
        if (column_block >= g) break;  // ascending: the rest are not before this block
        if (!geo.column_on_key_rank(column) ||
            !column_read_alone(slash, slash_len, column_block, g))
            continue;
        const int64_t key = geo.local_key_token(column);
        if (key < min_key) continue;
        keys.push_back(static_cast<int32_t>(key));
        if (static_cast<int64_t>(keys.size()) == geo.block) {
            visit(keys.data(), geo.block, false);
            keys.clear();
        }
    }
    if (!keys.empty()) visit(keys.data(), static_cast<int64_t>(keys.size()), false);
}

// Online-softmax update of the rows of query block i (loaded by load_query_rows, outputs in
// query_out_rows, document limits by load_key_limits) with one key tile: S = Q.K^T for the whole
// tile, then per row the softmax statistics, then out += P.V. Out rows accumulate the
// unnormalised output.
void forward_tile(const Inputs& in, int64_t b, int64_t h, int64_t i, const int32_t* keys, int64_t n,
                  bool causal, Scratch& scratch) {
    const int64_t dim = in.head_dim, n_pad = padded_keys(n);
    const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
    load_key_tile(in, b, h / in.group(), keys, n, false, scratch);
    float* scores = scratch.scores.data();
    tile_products(scratch.q_rows.data(), rows, scratch.k_packed.data(), scratch.k_rows.data(), n, dim,
                  scores);
    for (int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * n_pad;
        const KeyRange seen = visible_keys(keys, n, causal, first + r, scratch.key_limits[r]);
        std::fill(row, row + seen.begin, 0.f);  // P of the keys this row may not see
        std::fill(row + seen.end, row + n, 0.f);
        if (seen.begin == seen.end) continue;
        if (in.softcap > 0.f) soft_cap(row + seen.begin, seen.end - seen.begin, in.scale, in.softcap);
        const float tile_max = max_scaled(row + seen.begin, seen.end - seen.begin, in.exponent_scale());
        float& running_max = scratch.running_max[r];
        float& running_sum = scratch.running_sum[r];
        const float new_max = std::max(running_max, tile_max);
        const float correction = exp_nonpositive(running_max - new_max);  // 0 for the first tile
        if (correction != 1.f) {
            scale_in_place(scratch.query_out_rows[r], correction, dim);
            running_sum *= correction;
        }
        running_sum += exp_shifted(row + seen.begin, seen.end - seen.begin, in.exponent_scale(), new_max);
        running_max = new_max;
    }
    tile_accumulate(scratch.query_out_rows.data(), rows, scores, n_pad, 1, scratch.v_rows.data(), n,
                    dim);
}

// Runs work(b, h, i, scratch) once per (batch, head, query block), in parallel, each thread with
// its own scratch; later query blocks read more vertical columns, so they are handed out first.
template <typename Work>
void for_each_query_block(const Inputs& in, Work work) {
    const Geometry& geo = in.geo;
    const int64_t tasks = in.batch * in.heads * geo.q_blocks;
#pragma omp parallel num_threads(at::get_num_threads())
    {
        Scratch scratch(geo.block, in.head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t i = geo.q_blocks - 1 - task % geo.q_blocks;
            const int64_t h = task / geo.q_blocks % in.heads, b = task / geo.q_blocks / in.heads;
            work(b, h, i, scratch);
        }
    }
}

void forward_kernel(const Inputs& in, float* out, float* lse) {
    for_each_query_block(in, [&](int64_t b, int64_t h, int64_t i, Scratch& scratch) {
        std::fill(scratch.running_max.begin(), scratch.running_max.end(), kNegInf);
        std::fill(scratch.running_sum.begin(), scratch.running_sum.end(), 0.f);
        load_query_rows(in, nullptr, out, b, h, i, scratch);
        const int64_t min_key = load_key_limits(in, b, i, scratch);
        for_each_key_tile(in, b, h, i, min_key, scratch.keys, [&](const int32_t* tile, int64_t n, bool causal) {
            forward_tile(in, b, h, i, tile, n, causal, scratch);
        });
        const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = first + r;
            const float sum = scratch.running_sum[r];
            if (sum > 0.f) {
                scale_in_place(out + in.q_offset(b, t, h), 1.f / sum, in.head_dim);
                lse[in.lse_offset(b, h, t)] = scratch.running_max[r] + std::log(sum);
            } else {  // no visible key: out stays 0
                lse[in.lse_offset(b, h, t)] = kNegInf;
            }
        }
    });
}

// Read-only view of the extra backward inputs.
struct GradInputs {
    const float* dout;
    const float* lse;
    const float* delta;  // rowsum(dout * out), layout of lse
};

// For the rows of query block i (loaded by load_query_rows with dout, document limits by
// load_key_limits) and a key tile loaded by
// load_key_tile with values: scratch.scores = P = exp(logit - lse) and scratch.dscores = dS =
// d logit / d(q.k) * P * (dout.v - delta), [row][padded keys], zero where a row may not see a key
// and on rows with lse = -inf (they saw no key in the forward and take no part in the backward).
// d logit / d(q.k) is scale, or with soft-capping scale * (1 - tanh^2).
void probabilities_and_dscores(const Inputs& in, const GradInputs& grad, int64_t b, int64_t h,
                               int64_t i, const int32_t* keys, int64_t n, bool causal,
                               Scratch& scratch) {
    const int64_t dim = in.head_dim, n_pad = padded_keys(n);
    const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
    float* p = scratch.scores.data();
    float* ds = scratch.dscores.data();
    tile_products(scratch.q_rows.data(), rows, scratch.k_packed.data(), scratch.k_rows.data(), n,
                  dim, p);
    tile_products(scratch.dout_rows.data(), rows, scratch.v_packed.data(), scratch.v_rows.data(), n,
                  dim, ds);
    const float scale = in.scale;
    for (int64_t r = 0; r < rows; ++r) {
        float* __restrict p_row = p + r * n_pad;
        float* __restrict ds_row = ds + r * n_pad;
        const int64_t t = first + r;
        const float lse = grad.lse[in.lse_offset(b, h, t)];
        const KeyRange seen =
            lse == kNegInf ? KeyRange{0, 0} : visible_keys(keys, n, causal, t, scratch.key_limits[r]);
        for (float* row : {p_row, ds_row}) {
            std::fill(row, row + seen.begin, 0.f);
            std::fill(row + seen.end, row + n, 0.f);
        }
        if (seen.begin == seen.end) continue;
        const float delta = grad.delta[in.lse_offset(b, h, t)];
        if (in.softcap > 0.f) {  // the logits in p_row, the chain rule's (dP - delta) * slope in ds_row
            const float cap = in.softcap, to_tanh = scale / cap;
            for (int64_t e = seen.begin; e < seen.end; ++e) {
                const float tanh_value = std::tanh(p_row[e] * to_tanh);
                p_row[e] = cap * tanh_value;
                ds_row[e] = scale * (1.f - tanh_value * tanh_value) * (ds_row[e] - delta);
            }
            exp_shifted(p_row + seen.begin, seen.end - seen.begin, 1.f, lse);
#pragma omp simd
            for (int64_t e = seen.begin; e < seen.end; ++e) ds_row[e] *= p_row[e];
            continue;
        }
        exp_shifted(p_row + seen.begin, seen.end - seen.begin, scale, lse);
#pragma omp simd
        for (int64_t e = seen.begin; e < seen.end; ++e) ds_row[e] = scale * p_row[e] * (ds_row[e] - delta);
    }
}

// delta [B, H, S] = rowsum(dout * out) of float32 [B, S, H, D] dout and out.
void delta_kernel(const float* dout, const float* out, int64_t batch, int64_t seq, int64_t heads, int64_t dim,
                  float* delta) {
    const int64_t rows = batch * seq * heads;
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const int64_t h = row % heads, t = row / heads % seq, b = row / heads / seq;
        delta[(b * heads + h) * seq + t] = dot(dout + row * dim, out + row * dim, dim);
    }
}

void dq_kernel(const Inputs& in, const GradInputs& grad, float* dq) {
    for_each_query_block(in, [&](int64_t b, int64_t h, int64_t i, Scratch& scratch) {
        const int64_t rows = load_query_rows(in, grad.dout, dq, b, h, i, scratch);
        const int64_t min_key = load_key_limits(in, b, i, scratch);
        for_each_key_tile(in, b, h, i, min_key, scratch.keys, [&](const int32_t* tile, int64_t n, bool causal) {
            load_key_tile(in, b, h / in.group(), tile, n, true, scratch);
            probabilities_and_dscores(in, grad, b, h, i, tile, n, causal, scratch);
            tile_accumulate(scratch.query_out_rows.data(), rows, scratch.dscores.data(),
                            padded_keys(n), 1, scratch.k_rows.data(), n, in.head_dim);
        });
    });
}

// Loads key tile `keys` of kv head kvh for dkdv_tile: K/V rows packed, dK/dV rows to write.
void load_dkdv_tile(const Inputs& in, float* dk, float* dv, int64_t b, int64_t kvh,
                    const int32_t* keys, int64_t n, Scratch& scratch) {
    load_key_tile(in, b, kvh, keys, n, true, scratch);
    for (int64_t e = 0; e < n; ++e) {
        const int64_t offset = in.k_offset(b, keys[e], kvh);
        scratch.dk_rows[e] = dk + offset;
        scratch.dv_rows[e] = dv + offset;
    }
}

// dK += dS^T.Q and dV += P^T.dO of the loaded key tile (ascending keys) from the rows of query
// block i of head h; nothing when every key lies before the rows' documents.
void dkdv_tile(const Inputs& in, const GradInputs& grad, int64_t b, int64_t h, int64_t i,
               const int32_t* keys, int64_t n, bool causal, Scratch& scratch) {
    if (keys[n - 1] < load_key_limits(in, b, i, scratch)) return;
    const int64_t rows = load_query_rows(in, grad.dout, nullptr, b, h, i, scratch);
    probabilities_and_dscores(in, grad, b, h, i, keys, n, causal, scratch);
    const int64_t n_pad = padded_keys(n);
    tile_accumulate(scratch.dv_rows.data(), n, scratch.scores.data(), 1, n_pad,
                    scratch.dout_rows.data(), rows, in.head_dim);
    tile_accumulate(scratch.dk_rows.data(), n, scratch.dscores.data(), 1, n_pad,
                    scratch.q_rows.data(), rows, in.head_dim);
}

void dkdv_kernel(const Inputs& in, const GradInputs& grad, float* dk, float* dv) {
    const Geometry& geo = in.geo;
    const int64_t tasks = in.batch * in.kv_heads * geo.k_blocks;
#pragma omp parallel num_threads(at::get_num_threads())
    {
        Scratch scratch(geo.block, in.head_dim);
        std::vector<int32_t>& columns = scratch.columns;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            // earlier key blocks are read by more query blocks: they come first
            const int64_t j = task % geo.k_blocks;
            const int64_t kvh = task / geo.k_blocks % in.kv_heads;
            const int64_t b = task / geo.k_blocks / in.kv_heads;
            const int64_t key_global = geo.key_block_global(j);
            for (int64_t h = kvh * in.group(); h < (kvh + 1) * in.group(); ++h) {
                const int32_t* slash = in.slash_of(b, h);
                const int64_t slash_len = in.slash_len(b, h);
                fill_block(scratch.keys, j * geo.block, geo.key_rows(j));
                const int64_t n = static_cast<int64_t>(scratch.keys.size());
                load_dkdv_tile(in, dk, dv, b, kvh, scratch.keys.data(), n, scratch);
                for (int64_t e = 0; e < slash_len; ++e) {
                    const int64_t i = geo.query_block_of(j, slash[e]);
                    if (i < 0) continue;
                    dkdv_tile(in, grad, b, h, i, scratch.keys.data(), n, slash[e] == 0, scratch);
                }
                // this block's vertical columns, read alone by the later query blocks that no
                // slash diagonal connects to it (all columns of one block share that set)
                const int32_t* vertical = in.vertical_of(b, h);
                const int64_t vertical_len = in.vertical_len(b, h);
                const int64_t lo = sorted_lower_bound(vertical, vertical_len, key_global * geo.block);
                const int64_t hi =
                    sorted_lower_bound(vertical, vertical_len, (key_global + 1) * geo.block);
                if (lo == hi) continue;
                columns.clear();
                for (int64_t e = lo; e < hi; ++e)
                    columns.push_back(static_cast<int32_t>(geo.local_key_token(vertical[e])));
                const int64_t n_columns = static_cast<int64_t>(columns.size());
                load_dkdv_tile(in, dk, dv, b, kvh, columns.data(), n_columns, scratch);
                for (int64_t i = geo.first_query_block_after(key_global); i < geo.q_blocks; ++i) {
                    if (!column_read_alone(slash, slash_len, key_global, geo.query_block_global(i)))
                        continue;
                    dkdv_tile(in, grad, b, h, i, columns.data(), n_columns, false, scratch);
                }
            }
        }
    }
}

// Fp32 contiguous copies (no copy when the input already is one) and the kernel view.
struct Prepared {
    at::Tensor q, k, v;
    OpIndex index;
    Inputs inputs;
};

Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OpIndex& index,
                 double scale, double softcap) {
    const Geometry geo = check_call(q, k, v, index, scale, softcap, c10::DeviceType::CPU, kOpName);
    Prepared p;
    p.index = index.contiguous();
    check_list_contents(geo, p.index, kOpName);
    p.q = q.to(at::kFloat).contiguous();
    p.k = k.to(at::kFloat).contiguous();
    p.v = v.to(at::kFloat).contiguous();
    Inputs& in = p.inputs;
    in.q = p.q.data_ptr<float>();
    in.k = p.k.data_ptr<float>();
    in.v = p.v.data_ptr<float>();
    in.slash = p.index.slash.data_ptr<int32_t>();
    in.slash_count = p.index.slash_count.data_ptr<int32_t>();
    in.vertical = p.index.vertical.data_ptr<int32_t>();
    in.vertical_count = p.index.vertical_count.data_ptr<int32_t>();
    in.doc_start = p.index.doc_start.numel() == 0 ? nullptr : p.index.doc_start.data_ptr<int32_t>();
    in.batch = q.size(0);
    in.heads = q.size(2);
    in.kv_heads = k.size(2);
    in.head_dim = q.size(3);
    in.slash_width = index.slash.size(2);
    in.vertical_width = index.vertical.size(2);
    in.scale = static_cast<float>(scale);
    in.softcap = static_cast<float>(softcap);
    in.geo = geo;
    return p;
}

// Merges a call's (out, lse) into the running ones, row by row: lse = log(exp(a) + exp(b)), each
// output weighted by exp(its lse - the merged one). A row no call has seen a key for stays 0/-inf.
void merge_into_running(const at::Tensor& out, const at::Tensor& lse, at::Tensor& running_out,
                        at::Tensor& running_lse) {
    const int64_t seq = out.size(1), heads = out.size(2), dim = out.size(3);
    const float* step_out = out.data_ptr<float>();
    const float* step_lse = lse.data_ptr<float>();
    float* run_out = running_out.data_ptr<float>();
    float* run_lse = running_lse.data_ptr<float>();
    at::parallel_for(0, out.size(0) * seq, 1, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {
            const int64_t b = row / seq, t = row % seq;
            for (int64_t h = 0; h < heads; ++h) {
                float& merged = run_lse[(b * heads + h) * seq + t];
                const float a = merged, c = step_lse[(b * heads + h) * seq + t];
                const float high = std::max(a, c), low = std::min(a, c);
                if (high == kNegInf) continue;
                merged = high + std::log1p(std::exp(low - high));
                const float keep = std::exp(a - merged), add = std::exp(c - merged);
                float* y = run_out + (row * heads + h) * dim;
                const float* x = step_out + (row * heads + h) * dim;
                for (int64_t d = 0; d < dim; ++d) y[d] = y[d] * keep + x[d] * add;
            }
        }
    });
}

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const OpIndex& index, double scale, double softcap,
                                const std::optional<at::Tensor>& running_out,
                                const std::optional<at::Tensor>& running_lse, bool input_dtype) {
    const Prepared p = prepare(q, k, v, index, scale, softcap);
    const bool merge = check_running_output(q, running_out, running_lse, kOpName);
    auto out = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
    forward_kernel(p.inputs, out.data_ptr<float>(), lse.data_ptr<float>());
    if (!merge) return {input_dtype ? out.to(q.scalar_type()) : out, lse};
    // input_dtype: the merged out in q's dtype, the running one left as it was
    at::Tensor merged_out = input_dtype ? running_out->clone() : *running_out, merged_lse = *running_lse;
    merge_into_running(out, lse, merged_out, merged_lse);
    return {input_dtype ? merged_out.to(q.scalar_type()) : merged_out, merged_lse};
}

// delta(dout, out): rowsum(dout * out), float32 [B, H, S].
at::Tensor row_delta(const at::Tensor& dout, const at::Tensor& out) {
    check_delta_inputs(dout, out, c10::DeviceType::CPU, kOpName);
    const auto dout32 = dout.to(at::kFloat).contiguous();
    const auto out32 = out.to(at::kFloat).contiguous();
    auto delta = at::empty({dout.size(0), dout.size(2), dout.size(1)}, dout32.options());
    delta_kernel(dout32.data_ptr<float>(), out32.data_ptr<float>(), dout.size(0), dout.size(1), dout.size(2),
                 dout.size(3), delta.data_ptr<float>());
    return delta;
}

std::vector<at::Tensor> backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 const OpIndex& index, double scale, double softcap,
                                 const std::optional<at::Tensor>& running_dq,
                                 const std::optional<at::Tensor>& given_delta, bool input_dtype) {
    const Prepared p = prepare(q, k, v, index, scale, softcap);
    check_backward_tensors(q, dout, out, lse, kOpName);
    if (running_dq.has_value()) check_accumulator(q, *running_dq, q.sizes(), "the running dq", kOpName);
    if (given_delta.has_value()) check_accumulator(q, *given_delta, lse.sizes(), "delta", kOpName);
    const auto dout32 = dout.to(at::kFloat).contiguous();
    const auto lse32 = lse.contiguous();
    const at::Tensor delta = given_delta.has_value() ? *given_delta : row_delta(dout32, out);
    const GradInputs grad{dout32.data_ptr<float>(), lse32.data_ptr<float>(),
                          delta.data_ptr<float>()};
    // dq_kernel adds into its rows: the running dq when given (a copy of it with input_dtype, which
    // leaves the running one as it was)
    auto dq = running_dq.has_value() ? (input_dtype ? running_dq->clone() : *running_dq)
                                     : at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    auto dk = at::zeros(k.sizes(), k.options().dtype(at::kFloat));
    auto dv = at::zeros(v.sizes(), v.options().dtype(at::kFloat));
    dq_kernel(p.inputs, grad, dq.data_ptr<float>());
    dkdv_kernel(p.inputs, grad, dk.data_ptr<float>(), dv.data_ptr<float>());
    return {input_dtype ? dq.to(q.scalar_type()) : dq, dk, dv};
}

}  // namespace
}  // namespace mtraining

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ds-mtraining vertical-slash sparse attention, C++/OpenMP CPU kernels";
    mtraining::define_attention_ops(m, mtraining::kOpName, &mtraining::forward, &mtraining::backward,
                                    &mtraining::row_delta);
}
