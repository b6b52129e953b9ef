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
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "mtraining/checks.h"
#include "mtraining/pattern.h"

namespace mtraining {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr const char* kOpName = "mtraining_cpu";

// Vector helpers over head_dim (contiguous; `omp simd` lets the compiler vectorise reductions).
// Four rows per pass share each load of the other operand.

inline float dot(const float* __restrict a, const float* __restrict b, int64_t dim) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < dim; ++d) acc += a[d] * b[d];
    return acc;
}

// out[e] = a . rows[e] for e < n.
inline void dots(const float* __restrict a, const float* const* rows, int64_t n, int64_t dim,
                 float* __restrict out) {
    int64_t e = 0;
    for (; e + 4 <= n; e += 4) {
        const float *__restrict r0 = rows[e], *__restrict r1 = rows[e + 1];
        const float *__restrict r2 = rows[e + 2], *__restrict r3 = rows[e + 3];
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < dim; ++d) {
            s0 += a[d] * r0[d];
            s1 += a[d] * r1[d];
            s2 += a[d] * r2[d];
            s3 += a[d] * r3[d];
        }
        out[e] = s0;
        out[e + 1] = s1;
        out[e + 2] = s2;
        out[e + 3] = s3;
    }
    for (; e < n; ++e) out[e] = dot(a, rows[e], dim);
}

// y += sum over e < n of c[e] * rows[e].
inline void accumulate(float* __restrict y, const float* c, const float* const* rows, int64_t n,
                       int64_t dim) {
    int64_t e = 0;
    for (; e + 4 <= n; e += 4) {
        const float c0 = c[e], c1 = c[e + 1], c2 = c[e + 2], c3 = c[e + 3];
        const float *__restrict r0 = rows[e], *__restrict r1 = rows[e + 1];
        const float *__restrict r2 = rows[e + 2], *__restrict r3 = rows[e + 3];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) y[d] += c0 * r0[d] + c1 * r1[d] + c2 * r2[d] + c3 * r3[d];
    }
    for (; e < n; ++e) {
        const float c0 = c[e];
        const float* __restrict r0 = rows[e];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) y[d] += c0 * r0[d];
    }
}

inline void scale_in_place(float* __restrict y, float alpha, int64_t n) {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) y[e] *= alpha;
}

// exp(x) for x <= 0 (softmax probabilities), branch-free so that loops over it vectorise
// (libm's expf does not without -ffast-math, which would break the -inf of empty rows).
// Cephes' range reduction and polynomial: relative error ~1e-7; exp(-inf) = 0.
inline float exp_nonpositive(float x) {
    constexpr float kLow = -87.33654f, kLog2e = 1.44269504088896341f;
    constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
    const float clamped = std::min(std::max(x, kLow), 0.f);
    const float n = std::floor(clamped * kLog2e + 0.5f);
    const float r = clamped - n * kLn2Hi - n * kLn2Lo;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    poly = poly * r * r + r + 1.f;
    // 2^n from its exponent bits; memcpy rather than std::bit_cast so C++17 builds (torch < 2.12)
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_to_n;
    std::memcpy(&two_to_n, &bits, sizeof two_to_n);
    return x < kLow ? 0.f : poly * two_to_n;
}

// x[e] = exp(scale * x[e] - shift); returns the sum.
inline float exp_shifted(float* __restrict x, int64_t n, float scale, float shift) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t e = 0; e < n; ++e) {
        x[e] = exp_nonpositive(scale * x[e] - shift);
        sum += x[e];
    }
    return sum;
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
    int64_t batch, heads, kv_heads, head_dim, slash_width, vertical_width;
    float scale;
    Geometry geo;

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
};

// Per-thread working memory, sized once for tiles of up to `block` keys and rows.
struct Scratch {
    std::vector<int32_t> keys, columns;
    std::vector<const float*> k_rows, v_rows, q_rows, dout_rows;
    std::vector<int64_t> row_tokens;
    std::vector<float> scores, dscores, running_max, running_sum;
    std::vector<float> p_by_key, ds_by_key;  // [key][row] of one tile, for dK/dV

    explicit Scratch(int64_t block)
        : k_rows(block), v_rows(block), q_rows(block), dout_rows(block), row_tokens(block),
          scores(block), dscores(block), running_max(block), running_sum(block) {
        keys.reserve(block);
        columns.reserve(block);
    }
};

// Keys of a tile that query row t may see: all of them, or for the token-causal diagonal tile
// (ascending keys of the query's own block) those <= t.
inline int64_t visible_keys(const int32_t* keys, int64_t n, bool causal, int64_t t) {
    if (!causal) return n;
    return std::max<int64_t>(0, std::min<int64_t>(n, t - keys[0] + 1));
}

inline void fill_block(std::vector<int32_t>& keys, int64_t first, int64_t n) {
    keys.resize(n);
    for (int64_t e = 0; e < n; ++e) keys[e] = static_cast<int32_t>(first + e);
}

// Points scratch.k_rows / v_rows at the K and V rows of a tile's keys.
inline void gather_key_rows(const Inputs& in, int64_t b, int64_t kvh, const int32_t* keys,
                            int64_t n, Scratch& scratch) {
    for (int64_t e = 0; e < n; ++e) {
        const int64_t offset = in.k_offset(b, keys[e], kvh);
        scratch.k_rows[e] = in.k + offset;
        scratch.v_rows[e] = in.v + offset;
    }
}

// Calls visit(keys, n, causal) for every key tile local query block i of head h reads: the key
// block of each slash diagonal that connects this rank pair, then the vertical columns on the key
// rank that lie in earlier blocks no slash diagonal covers, block_size keys per tile.
template <class Visit>
void for_each_key_tile(const Inputs& in, int64_t b, int64_t h, int64_t i,
                       std::vector<int32_t>& keys, Visit&& visit) {
    const Geometry& geo = in.geo;
    const int32_t* slash = in.slash_of(b, h);
    const int64_t slash_len = in.slash_len(b, h);
    for (int64_t e = 0; e < slash_len; ++e) {
        const int64_t j = geo.key_block_of(i, slash[e]);
        if (j < 0) continue;
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
        keys.push_back(static_cast<int32_t>(geo.local_key_token(column)));
        if (static_cast<int64_t>(keys.size()) == geo.block) {
            visit(keys.data(), geo.block, false);
            keys.clear();
        }
    }
    if (!keys.empty()) visit(keys.data(), static_cast<int64_t>(keys.size()), false);
}

// Online-softmax update of the rows of query block i with one key tile; out rows accumulate
// the unnormalised output, running_max/running_sum the softmax statistics of each row.
void forward_tile(const Inputs& in, float* out, int64_t b, int64_t h, int64_t i,
                  const int32_t* keys, int64_t n, bool causal, Scratch& scratch) {
    const int64_t dim = in.head_dim;
    gather_key_rows(in, b, h / in.group(), keys, n, scratch);
    float* scores = scratch.scores.data();
    const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = first + r;
        const int64_t visible = visible_keys(keys, n, causal, t);
        if (visible == 0) continue;
        dots(in.q + in.q_offset(b, t, h), scratch.k_rows.data(), visible, dim, scores);
        float tile_max = kNegInf;
        for (int64_t e = 0; e < visible; ++e) tile_max = std::max(tile_max, in.scale * scores[e]);
        float& running_max = scratch.running_max[r];
        float& running_sum = scratch.running_sum[r];
        const float new_max = std::max(running_max, tile_max);
        float* out_row = out + in.q_offset(b, t, h);
        const float correction = exp_nonpositive(running_max - new_max);  // 0 for the first tile
        if (correction != 1.f) {
            scale_in_place(out_row, correction, dim);
            running_sum *= correction;
        }
        running_sum += exp_shifted(scores, visible, in.scale, new_max);
        accumulate(out_row, scores, scratch.v_rows.data(), visible, dim);
        running_max = new_max;
    }
}

// Runs work(b, h, i, scratch) once per (batch, head, query block), in parallel, each thread with
// its own scratch; later query blocks read more vertical columns, so they are handed out first.
template <typename Work>
void for_each_query_block(const Inputs& in, Work work) {
    const Geometry& geo = in.geo;
    const int64_t tasks = in.batch * in.heads * geo.q_blocks;
#pragma omp parallel num_threads(at::get_num_threads())
    {
        Scratch scratch(geo.block);
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
        for_each_key_tile(in, b, h, i, scratch.keys, [&](const int32_t* tile, int64_t n, bool causal) {
            forward_tile(in, out, b, h, i, tile, n, causal, scratch);
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

// For query row t of head h and the first `visible` keys of the gathered tile:
// scratch.scores = P = exp(scale q.k - lse), scratch.dscores = scale * P * (dout.v - delta).
inline void probabilities_and_dscores(const Inputs& in, const GradInputs& grad, int64_t b,
                                      int64_t h, int64_t t, int64_t visible, Scratch& scratch) {
    float* p = scratch.scores.data();
    float* ds = scratch.dscores.data();
    dots(in.q + in.q_offset(b, t, h), scratch.k_rows.data(), visible, in.head_dim, p);
    exp_shifted(p, visible, in.scale, grad.lse[in.lse_offset(b, h, t)]);
    dots(grad.dout + in.q_offset(b, t, h), scratch.v_rows.data(), visible, in.head_dim, ds);
    const float delta = grad.delta[in.lse_offset(b, h, t)], scale = in.scale;
#pragma omp simd
    for (int64_t e = 0; e < visible; ++e) ds[e] = scale * p[e] * (ds[e] - delta);
}

// Rows with lse = -inf saw no key in the forward and take no part in the backward.
inline bool row_saw_keys(const Inputs& in, const GradInputs& grad, int64_t b, int64_t h,
                         int64_t t) {
    return grad.lse[in.lse_offset(b, h, t)] != kNegInf;
}

void delta_kernel(const Inputs& in, const float* dout, const float* out, float* delta) {
    const int64_t rows = in.batch * in.geo.q_len * in.heads;
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const int64_t h = row % in.heads, t = row / in.heads % in.geo.q_len;
        const int64_t b = row / in.heads / in.geo.q_len;
        const int64_t offset = row * in.head_dim;
        delta[in.lse_offset(b, h, t)] = dot(dout + offset, out + offset, in.head_dim);
    }
}

void dq_kernel(const Inputs& in, const GradInputs& grad, float* dq) {
    for_each_query_block(in, [&](int64_t b, int64_t h, int64_t i, Scratch& scratch) {
        const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
        for_each_key_tile(in, b, h, i, scratch.keys, [&](const int32_t* tile, int64_t n, bool causal) {
            gather_key_rows(in, b, h / in.group(), tile, n, scratch);
            for (int64_t t = first; t < first + rows; ++t) {
                const int64_t visible = visible_keys(tile, n, causal, t);
                if (visible == 0 || !row_saw_keys(in, grad, b, h, t)) continue;
                probabilities_and_dscores(in, grad, b, h, t, visible, scratch);
                accumulate(dq + in.q_offset(b, t, h), scratch.dscores.data(),
                           scratch.k_rows.data(), visible, in.head_dim);
            }
        });
    });
}

// dK/dV of key tile `keys` from the rows of query block i of head h: P and dS of every
// (row, key) first, then per key one pass over the rows that see it.
void dkdv_tile(const Inputs& in, const GradInputs& grad, float* dk, float* dv, int64_t b,
               int64_t h, int64_t i, const int32_t* keys, int64_t n, bool causal,
               Scratch& scratch) {
    const int64_t kvh = h / in.group(), block = in.geo.block;
    const int64_t first = i * block, rows = in.geo.query_rows(i);
    gather_key_rows(in, b, kvh, keys, n, scratch);
    int64_t active = 0;
    for (int64_t t = first; t < first + rows; ++t) {
        const int64_t visible = visible_keys(keys, n, causal, t);
        if (visible == 0 || !row_saw_keys(in, grad, b, h, t)) continue;
        probabilities_and_dscores(in, grad, b, h, t, visible, scratch);
        for (int64_t e = 0; e < visible; ++e) {
            scratch.p_by_key[e * block + active] = scratch.scores[e];
            scratch.ds_by_key[e * block + active] = scratch.dscores[e];
        }
        scratch.q_rows[active] = in.q + in.q_offset(b, t, h);
        scratch.dout_rows[active] = grad.dout + in.q_offset(b, t, h);
        scratch.row_tokens[active++] = t;
    }
    for (int64_t e = 0; e < n; ++e) {
        // active rows ascend; on the causal tile key e is seen by the rows from its own token on
        const int64_t from = causal ? std::lower_bound(scratch.row_tokens.begin(),
                                                       scratch.row_tokens.begin() + active,
                                                       static_cast<int64_t>(keys[e])) -
                                          scratch.row_tokens.begin()
                                    : 0;
        const int64_t offset = in.k_offset(b, keys[e], kvh);
        accumulate(dv + offset, scratch.p_by_key.data() + e * block + from,
                   scratch.dout_rows.data() + from, active - from, in.head_dim);
        accumulate(dk + offset, scratch.ds_by_key.data() + e * block + from,
                   scratch.q_rows.data() + from, active - from, in.head_dim);
    }
}

void dkdv_kernel(const Inputs& in, const GradInputs& grad, float* dk, float* dv) {
    const Geometry& geo = in.geo;
    const int64_t tasks = in.batch * in.kv_heads * geo.k_blocks;
#pragma omp parallel num_threads(at::get_num_threads())
    {
        Scratch scratch(geo.block);
        scratch.p_by_key.resize(geo.block * geo.block);
        scratch.ds_by_key.resize(geo.block * geo.block);
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
                for (int64_t e = 0; e < slash_len; ++e) {
                    const int64_t i = geo.query_block_of(j, slash[e]);
                    if (i < 0) continue;
                    dkdv_tile(in, grad, dk, dv, b, h, i, scratch.keys.data(),
                              static_cast<int64_t>(scratch.keys.size()), slash[e] == 0, scratch);
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
                for (int64_t i = geo.first_query_block_after(key_global); i < geo.q_blocks; ++i) {
                    if (!column_read_alone(slash, slash_len, key_global, geo.query_block_global(i)))
                        continue;
                    dkdv_tile(in, grad, dk, dv, b, h, i, columns.data(),
                              static_cast<int64_t>(columns.size()), false, scratch);
                }
            }
        }
    }
}

// Fp32 contiguous copies (no copy when the input already is one) and the kernel view.
struct Prepared {
    at::Tensor q, k, v, slash, slash_count, vertical, vertical_count;
    Inputs inputs;
};

Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& slash, const at::Tensor& slash_count,
                 const at::Tensor& vertical, const at::Tensor& vertical_count, int64_t block,
                 double scale, int64_t world, int64_t q_rank, int64_t k_rank) {
    const Geometry geo = check_call(q, k, v, slash, slash_count, vertical, vertical_count, block,
                                    scale, world, q_rank, k_rank, c10::DeviceType::CPU, kOpName);
    check_list_contents(geo, slash, slash_count, vertical, vertical_count, kOpName);
    Prepared p;
    p.q = q.to(at::kFloat).contiguous();
    p.k = k.to(at::kFloat).contiguous();
    p.v = v.to(at::kFloat).contiguous();
    p.slash = slash.contiguous();
    p.slash_count = slash_count.contiguous();
    p.vertical = vertical.contiguous();
    p.vertical_count = vertical_count.contiguous();
    Inputs& in = p.inputs;
    in.q = p.q.data_ptr<float>();
    in.k = p.k.data_ptr<float>();
    in.v = p.v.data_ptr<float>();
    in.slash = p.slash.data_ptr<int32_t>();
    in.slash_count = p.slash_count.data_ptr<int32_t>();
    in.vertical = p.vertical.data_ptr<int32_t>();
    in.vertical_count = p.vertical_count.data_ptr<int32_t>();
    in.batch = q.size(0);
    in.heads = q.size(2);
    in.kv_heads = k.size(2);
    in.head_dim = q.size(3);
    in.slash_width = slash.size(2);
    in.vertical_width = vertical.size(2);
    in.scale = static_cast<float>(scale);
    in.geo = geo;
    return p;
}

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& slash, const at::Tensor& slash_count,
                                const at::Tensor& vertical, const at::Tensor& vertical_count,
                                int64_t block_size, double scale, int64_t world, int64_t q_rank,
                                int64_t k_rank) {
    const Prepared p = prepare(q, k, v, slash, slash_count, vertical, vertical_count, block_size,
                               scale, world, q_rank, k_rank);
    auto out = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
    forward_kernel(p.inputs, out.data_ptr<float>(), lse.data_ptr<float>());
    return {out, lse};
}

std::vector<at::Tensor> backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 const at::Tensor& slash, const at::Tensor& slash_count,
                                 const at::Tensor& vertical, const at::Tensor& vertical_count,
                                 int64_t block_size, double scale, int64_t world, int64_t q_rank,
                                 int64_t k_rank) {
    const Prepared p = prepare(q, k, v, slash, slash_count, vertical, vertical_count, block_size,
                               scale, world, q_rank, k_rank);
    check_backward_tensors(q, dout, out, lse, kOpName);
    const auto dout32 = dout.to(at::kFloat).contiguous();
    const auto out32 = out.to(at::kFloat).contiguous();
    const auto lse32 = lse.contiguous();
    auto delta = at::empty_like(lse32);
    delta_kernel(p.inputs, dout32.data_ptr<float>(), out32.data_ptr<float>(),
                 delta.data_ptr<float>());
    const GradInputs grad{dout32.data_ptr<float>(), lse32.data_ptr<float>(),
                          delta.data_ptr<float>()};
    auto dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    auto dk = at::zeros(k.sizes(), k.options().dtype(at::kFloat));
    auto dv = at::zeros(v.sizes(), v.options().dtype(at::kFloat));
    dq_kernel(p.inputs, grad, dq.data_ptr<float>());
    dkdv_kernel(p.inputs, grad, dk.data_ptr<float>(), dv.data_ptr<float>());
    return {dq, dk, dv};
}

}  // namespace
}  // namespace mtraining

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ds-mtraining vertical-slash sparse attention, C++/OpenMP CPU kernels";
    m.def("forward", &mtraining::forward, "sparse attention forward -> (out fp32, lse fp32)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("slash"), py::arg("slash_count"),
          py::arg("vertical"), py::arg("vertical_count"), py::arg("block_size"), py::arg("scale"),
          py::arg("world"), py::arg("q_rank"), py::arg("k_rank"),
          py::call_guard<py::gil_scoped_release>());
    m.def("backward", &mtraining::backward, "sparse attention backward -> (dq, dk, dv) fp32",
          py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
          py::arg("lse"), py::arg("slash"), py::arg("slash_count"), py::arg("vertical"),
          py::arg("vertical_count"), py::arg("block_size"), py::arg("scale"), py::arg("world"),
          py::arg("q_rank"), py::arg("k_rank"), py::call_guard<py::gil_scoped_release>());
}
