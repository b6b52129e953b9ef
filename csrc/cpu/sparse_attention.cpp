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
#include <limits>
#include <vector>

#include "mtraining/checks.h"
#include "mtraining/pattern.h"

namespace mtraining {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr const char* kOpName = "mtraining_cpu";

// Inner loops over head_dim: contiguous, and `omp simd` lets the compiler vectorise the reduction.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t x = 0; x < n; ++x) acc += a[x] * b[x];
    return acc;
}

inline void axpy(float* __restrict y, float alpha, const float* __restrict x, int64_t n) {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) y[e] += alpha * x[e];
}

inline void scale_in_place(float* __restrict y, float alpha, int64_t n) {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) y[e] *= alpha;
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
                  const int32_t* keys, int64_t n, bool causal, float* running_max,
                  float* running_sum, float* scores) {
    const int64_t kvh = h / in.group(), dim = in.head_dim;
    const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = first + r;
        const int64_t visible = visible_keys(keys, n, causal, t);
        if (visible == 0) continue;
        const float* q_row = in.q + in.q_offset(b, t, h);
        float tile_max = kNegInf;
        for (int64_t e = 0; e < visible; ++e) {
            scores[e] = in.scale * dot(q_row, in.k + in.k_offset(b, keys[e], kvh), dim);
            tile_max = std::max(tile_max, scores[e]);
        }
        const float new_max = std::max(running_max[r], tile_max);
        float* out_row = out + in.q_offset(b, t, h);
        const float correction = std::exp(running_max[r] - new_max);  // 0 for the first tile
        if (correction != 1.f) {
            scale_in_place(out_row, correction, dim);
            running_sum[r] *= correction;
        }
        float tile_sum = 0.f;
        for (int64_t e = 0; e < visible; ++e) {
            const float p = std::exp(scores[e] - new_max);
            tile_sum += p;
            axpy(out_row, p, in.v + in.k_offset(b, keys[e], kvh), dim);
        }
        running_sum[r] += tile_sum;
        running_max[r] = new_max;
    }
}

void forward_kernel(const Inputs& in, float* out, float* lse) {
    const Geometry& geo = in.geo;
    const int64_t tasks = in.batch * in.heads * geo.q_blocks;
#pragma omp parallel num_threads(at::get_num_threads())
    {
        std::vector<int32_t> keys;
        keys.reserve(geo.block);
        std::vector<float> running_max(geo.block), running_sum(geo.block), scores(geo.block);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            // later query blocks read more vertical columns: hand them out first
            const int64_t i = geo.q_blocks - 1 - task % geo.q_blocks;
            const int64_t h = task / geo.q_blocks % in.heads, b = task / geo.q_blocks / in.heads;
            std::fill(running_max.begin(), running_max.end(), kNegInf);
            std::fill(running_sum.begin(), running_sum.end(), 0.f);
            for_each_key_tile(in, b, h, i, keys, [&](const int32_t* tile, int64_t n, bool causal) {
                forward_tile(in, out, b, h, i, tile, n, causal, running_max.data(),
                             running_sum.data(), scores.data());
            });
            const int64_t first = i * geo.block, rows = geo.query_rows(i);
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t t = first + r;
                if (running_sum[r] > 0.f) {
                    scale_in_place(out + in.q_offset(b, t, h), 1.f / running_sum[r], in.head_dim);
                    lse[in.lse_offset(b, h, t)] = running_max[r] + std::log(running_sum[r]);
                } else {  // no visible key: out stays 0
                    lse[in.lse_offset(b, h, t)] = kNegInf;
                }
            }
        }
    }
}

// Read-only view of the extra backward inputs.
struct GradInputs {
    const float* dout;
    const float* lse;
    const float* delta;  // rowsum(dout * out), layout of lse
};

// P and dS of one (query row, key) entry: P = exp(scale q.k - lse), dS = P (dout.v - delta).
inline void probability_and_dscore(const Inputs& in, const float* q_row, const float* dout_row,
                                   const float* k_row, const float* v_row, float lse_t,
                                   float delta_t, float& p, float& ds) {
    p = std::exp(in.scale * dot(q_row, k_row, in.head_dim) - lse_t);
    ds = p * (dot(dout_row, v_row, in.head_dim) - delta_t);
}

// Calls visit(t, q_row, dout_row, lse_t, delta_t, visible) for each row of query block i of head
// h that saw some key (rows with lse = -inf are skipped: they took no part in the forward).
template <class Visit>
void for_each_grad_row(const Inputs& in, const GradInputs& grad, int64_t b, int64_t h, int64_t i,
                       const int32_t* keys, int64_t n, bool causal, Visit&& visit) {
    const int64_t first = i * in.geo.block, rows = in.geo.query_rows(i);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = first + r;
        const float lse_t = grad.lse[in.lse_offset(b, h, t)];
        const int64_t visible = visible_keys(keys, n, causal, t);
        if (lse_t == kNegInf || visible == 0) continue;
        visit(t, in.q + in.q_offset(b, t, h), grad.dout + in.q_offset(b, t, h), lse_t,
              grad.delta[in.lse_offset(b, h, t)], visible);
    }
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
    const Geometry& geo = in.geo;
    const int64_t tasks = in.batch * in.heads * geo.q_blocks;
#pragma omp parallel num_threads(at::get_num_threads())
    {
        std::vector<int32_t> keys;
        keys.reserve(geo.block);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t i = geo.q_blocks - 1 - task % geo.q_blocks;
            const int64_t h = task / geo.q_blocks % in.heads, b = task / geo.q_blocks / in.heads;
            const int64_t kvh = h / in.group();
            for_each_key_tile(in, b, h, i, keys, [&](const int32_t* tile, int64_t n, bool causal) {
                for_each_grad_row(in, grad, b, h, i, tile, n, causal,
                                  [&](int64_t t, const float* q_row, const float* dout_row,
                                      float lse_t, float delta_t, int64_t visible) {
                    float* dq_row = dq + in.q_offset(b, t, h);
                    for (int64_t e = 0; e < visible; ++e) {
                        const float* k_row = in.k + in.k_offset(b, tile[e], kvh);
                        float p, ds;
                        probability_and_dscore(in, q_row, dout_row, k_row,
                                               in.v + in.k_offset(b, tile[e], kvh), lse_t, delta_t,
                                               p, ds);
                        axpy(dq_row, in.scale * ds, k_row, in.head_dim);
                    }
                });
            });
        }
    }
}

// dK/dV of key tile `keys` from the rows of query block i of head h.
void dkdv_tile(const Inputs& in, const GradInputs& grad, float* dk, float* dv, int64_t b,
               int64_t h, int64_t i, const int32_t* keys, int64_t n, bool causal) {
    const int64_t kvh = h / in.group(), dim = in.head_dim;
    for_each_grad_row(in, grad, b, h, i, keys, n, causal,
                      [&](int64_t, const float* q_row, const float* dout_row, float lse_t,
                          float delta_t, int64_t visible) {
        for (int64_t e = 0; e < visible; ++e) {
            const int64_t offset = in.k_offset(b, keys[e], kvh);
            float p, ds;
            probability_and_dscore(in, q_row, dout_row, in.k + offset, in.v + offset, lse_t,
                                   delta_t, p, ds);
            axpy(dv + offset, p, dout_row, dim);
            axpy(dk + offset, in.scale * ds, q_row, dim);
        }
    });
}

void dkdv_kernel(const Inputs& in, const GradInputs& grad, float* dk, float* dv) {
    const Geometry& geo = in.geo;
    const int64_t tasks = in.batch * in.kv_heads * geo.k_blocks;
#pragma omp parallel num_threads(at::get_num_threads())
    {
        std::vector<int32_t> keys, columns;
        keys.reserve(geo.block);
        columns.reserve(geo.block);
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
                fill_block(keys, j * geo.block, geo.key_rows(j));
                for (int64_t e = 0; e < slash_len; ++e) {
                    const int64_t i = geo.query_block_of(j, slash[e]);
                    if (i < 0) continue;
                    dkdv_tile(in, grad, dk, dv, b, h, i, keys.data(),
                              static_cast<int64_t>(keys.size()), slash[e] == 0);
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
                              static_cast<int64_t>(columns.size()), false);
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
