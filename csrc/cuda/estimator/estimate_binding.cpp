// Torch binding of the fused vertical-slash estimator (estimate_api.cuh): checks, output and
// scratch allocation on the caller's stream (no host synchronisation anywhere), then the launchers.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <cstdint>
#include <limits>
#include <vector>

#include "estimate_api.cuh"
#include "kernel_instances.h"
#include "mtraining/checks.h"
#include "estimate.h"

namespace mtraining {
namespace {

namespace est = mtr::est;
constexpr const char* kName = "mtraining_cuda estimator";
constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

void check_launch(cudaError_t status, const char* what) {
    TORCH_CHECK(status == cudaSuccess, kName, ": ", what, " failed: ", cudaGetErrorString(status));
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// A [B, n, heads, D] view the kernels can read with cp.async: head and element dims packed,
// strides multiples of 8 elements and a 16-byte aligned start; copied when it is not.
at::Tensor readable_rows(const at::Tensor& t) {
    const auto ok = [](const at::Tensor& x) {
        return x.stride(3) == 1 && x.stride(2) == x.size(3) && x.stride(1) % 8 == 0 && x.stride(0) % 8 == 0 &&
               reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
    };
    if (ok(t)) return t;
    at::Tensor c = t.contiguous();
    return ok(c) ? c : c.clone();
}

struct ScoreCall {
    at::Tensor q, k;
    est::ScoreParams p;
    est::Elem elem;
};

// Checks q [B, n, H, D] and k [B, sk, Hkv, D] (what every score pass takes) and returns them
// readable by the kernels, with their pointers, strides, head counts and element type in p.
ScoreCall checked_pair(const at::Tensor& q_in, const at::Tensor& k_in) {
    TORCH_CHECK_VALUE(q_in.dim() == 4 && k_in.dim() == 4, kName,
                      ": q and k must be [batch, seq, heads, head_dim], got ", text(q_in.sizes()), " and ",
                      text(k_in.sizes()));
    TORCH_CHECK_VALUE(q_in.is_cuda() && k_in.device() == q_in.device(), kName,
                      ": q and k must be on the same CUDA device, got ", text(q_in.device()), " and ",
                      text(k_in.device()));
    TORCH_CHECK_TYPE(q_in.scalar_type() == k_in.scalar_type() &&
                         (q_in.scalar_type() == at::kBFloat16 || q_in.scalar_type() == at::kHalf),
                     kName, ": q and k must both be bfloat16 or both float16, got ", text(q_in.scalar_type()),
                     " and ", text(k_in.scalar_type()));
    const int64_t batch = q_in.size(0), lq = q_in.size(1), heads = q_in.size(2), dim = q_in.size(3);
    const int64_t sk = k_in.size(1), kv_heads = k_in.size(2);
    TORCH_CHECK_VALUE(k_in.size(0) == batch && k_in.size(3) == dim, kName, ": q ", text(q_in.sizes()), " and k ",
                      text(k_in.sizes()), " must share batch and head_dim");
    TORCH_CHECK_VALUE(std::find(std::begin(mtr::kKernelHeadDims), std::end(mtr::kKernelHeadDims), dim) !=
                          std::end(mtr::kKernelHeadDims),
                      kName, ": head_dim must be one the attention kernels take (kernel_instances.h), got ", text(dim));
    {  // the score kernels hold the query chunks and two key tiles: at head_dim 256 and last_q 256, 210 KB
        const int limit = static_cast<int>(at::cuda::getDeviceProperties(q_in.get_device())->sharedMemPerBlockOptin);
        const int chunks = static_cast<int>(std::min<int64_t>(est::kMaxChunks, (lq + est::kTile - 1) / est::kTile));
        const int need = est::score_smem_bytes(static_cast<int>(dim), chunks, true);
        TORCH_CHECK_VALUE(need <= limit, kName, ": head_dim ", text(dim), " over ", text(lq), " query rows (last_q) "
                          "needs ", text(need / 1024), " KB of shared memory per block, this GPU gives ",
                          text(limit / 1024), " KB; lower sparse.last_q");
    }
    TORCH_CHECK_VALUE(kv_heads >= 1 && heads % kv_heads == 0, kName, ": query heads (", text(heads),
                      ") must be a multiple of key/value heads (", text(kv_heads), ")");
    TORCH_CHECK_VALUE(sk >= 1 && batch >= 1 && lq >= 1, kName, ": empty batch, query rows or key sequence");
    ScoreCall call{readable_rows(q_in), readable_rows(k_in), {}, est::Elem::kBF16};
    call.elem = q_in.scalar_type() == at::kBFloat16 ? est::Elem::kBF16 : est::Elem::kFP16;
    est::ScoreParams& p = call.p;
    p.q = call.q.data_ptr();
    p.k = call.k.data_ptr();
    p.q_batch_stride = call.q.stride(0);
    p.q_row_stride = call.q.stride(1);
    p.k_batch_stride = call.k.stride(0);
    p.k_row_stride = call.k.stride(1);
    p.batch = static_cast<int>(batch);
    p.heads = static_cast<int>(heads);
    p.kv_heads = static_cast<int>(kv_heads);
    p.head_dim = static_cast<int>(dim);
    return call;
}

// About six CTAs per SM over all the launch's (three fit at once): a function of the shape and
// the device only, so the split-order reductions are reproducible.
int64_t wanted_ctas(const at::Tensor& on) {
    int sms = 0;
    check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, on.get_device()),
                 "reading the SM count");
    return 6 * static_cast<int64_t>(sms);
}

// Checks q_last [B, lq, H, D] and k [B, sk, Hkv, D] and fills the geometry; outputs are set by
// the caller.
ScoreCall score_call(const at::Tensor& q_in, const at::Tensor& k_in, int64_t q_start, int64_t seq_len,
                     int64_t world, int64_t rank, int64_t block, double scale) {
    ScoreCall call = checked_pair(q_in, k_in);
    const int64_t batch = q_in.size(0), lq = q_in.size(1), heads = q_in.size(2), sk = k_in.size(1);
    TORCH_CHECK_VALUE(lq >= 1 && lq <= est::kTile * est::kMaxChunks, kName, ": last_q rows must be in [1, ",
                      text(est::kTile * est::kMaxChunks), "], got ", text(lq));
    TORCH_CHECK_VALUE(block == 64 || block == 128, kName, ": block_size must be 64 or 128, got ", text(block));
    TORCH_CHECK_VALUE(world >= 1 && rank >= 0 && rank < world, kName, ": need world >= 1 and 0 <= rank < world");
    TORCH_CHECK_VALUE(seq_len >= 1 && seq_len < kIntMax / 2 && q_start >= 0 && q_start + lq <= seq_len, kName,
                      ": query rows [", text(q_start), ", ", text(q_start + lq), ") must lie in [0, seq_len=",
                      text(seq_len), ")");
    const int64_t last_key = mtraining::stripe_global_token<int64_t>(sk - 1, block, world, rank);
    TORCH_CHECK_VALUE(last_key < kIntMax / 2, kName, ": key positions overflow int32");
    TORCH_CHECK_VALUE(batch * heads * std::max<int64_t>(sk, seq_len) < (int64_t{1} << 40), kName,
                      ": the mass outputs are too large");

    est::ScoreParams& p = call.p;
    p.lq = static_cast<int>(lq);
    p.chunks = static_cast<int>((lq + est::kTile - 1) / est::kTile);
    p.sk = static_cast<int>(sk);
    p.q_start = static_cast<int>(q_start);
    p.seq_len = static_cast<int>(seq_len);
    p.world = static_cast<int>(world);
    p.rank = static_cast<int>(rank);
    p.block = static_cast<int>(block);
    p.scale = static_cast<float>(scale);
    p.num_tiles = static_cast<int>((sk + est::kTile - 1) / est::kTile);
    const int64_t wanted = (wanted_ctas(q_in) + batch * heads - 1) / (batch * heads);
    const int64_t splits = std::clamp<int64_t>(wanted, 1, p.num_tiles);
    p.tiles_per_split = static_cast<int>((p.num_tiles + splits - 1) / splits);
    p.splits = (p.num_tiles + p.tiles_per_split - 1) / p.tiles_per_split;
    TORCH_CHECK_VALUE(batch * heads * p.splits < kIntMax, kName, ": too many CTAs");
    p.stats_rows = batch * heads * lq;
    p.split_stride = p.splits;
    p.columns_stride = sk;
    return call;
}

// Pass A: (row_max, row_sum) float32 [B, H, lq]: the max logit of each query row over the local
// keys and the sum of exp(logit - row_max) (-inf and 0 for a row that sees no local key).
std::vector<at::Tensor> row_stats(const at::Tensor& q_last, const at::Tensor& k, int64_t q_start, int64_t seq_len,
                                  int64_t world, int64_t rank, int64_t block, double scale) {
    const c10::cuda::OptionalCUDAGuard guard(q_last.device());
    ScoreCall call = score_call(q_last, k, q_start, seq_len, world, rank, block, scale);
    est::ScoreParams& p = call.p;
    const auto options = q_last.options().dtype(at::kFloat);
    at::Tensor part_max = at::empty({p.batch, p.heads, p.lq, p.splits}, options);
    at::Tensor part_sum = at::empty({p.batch, p.heads, p.lq, p.splits}, options);
    at::Tensor row_max = at::empty({p.batch, p.heads, p.lq}, options);
    at::Tensor row_sum = at::empty({p.batch, p.heads, p.lq}, options);
    p.part_max = part_max.data_ptr<float>();
    p.part_sum = part_sum.data_ptr<float>();
    p.row_max = row_max.data_ptr<float>();
    p.row_sum = row_sum.data_ptr<float>();
    check_launch(est::run_row_stats(p, call.elem, current_stream()), "estimate_row_stats");
    return {row_max, row_sum};
}

// Pass B: (columns [B, H, sk], diagonals [B, H, seq_len]) float32, given the (global) row
// statistics: column masses of the local keys and token-diagonal masses of the local keys'
// entries, both divided by lq.
std::vector<at::Tensor> masses(const at::Tensor& q_last, const at::Tensor& k, const at::Tensor& row_max_in,
                               const at::Tensor& row_sum_in, int64_t q_start, int64_t seq_len, int64_t world,
                               int64_t rank, int64_t block, double scale) {
    const c10::cuda::OptionalCUDAGuard guard(q_last.device());
    ScoreCall call = score_call(q_last, k, q_start, seq_len, world, rank, block, scale);
    est::ScoreParams& p = call.p;
    for (const at::Tensor* t : {&row_max_in, &row_sum_in})
        TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->device() == q_last.device() && t->dim() == 3 &&
                              t->size(0) == p.batch && t->size(1) == p.heads && t->size(2) == p.lq,
                          kName, ": row_max and row_sum must be float32 [", text(p.batch), ", ", text(p.heads), ", ",
                          text(p.lq), "] on q_last's device, got ", text(t->scalar_type()), " ", text(t->sizes()));
    const at::Tensor row_max = row_max_in.contiguous(), row_sum = row_sum_in.contiguous();
    const auto options = q_last.options().dtype(at::kFloat);
    at::Tensor partials = at::empty({p.batch, p.heads, p.chunks, p.num_tiles, est::kDiagSlots}, options);
    at::Tensor columns = at::empty({p.batch, p.heads, p.sk}, options);
    at::Tensor diagonals = at::empty({p.batch, p.heads, p.seq_len}, options);
    p.row_max = const_cast<float*>(row_max.data_ptr<float>());
    p.row_sum = const_cast<float*>(row_sum.data_ptr<float>());
    p.diag_partials = partials.data_ptr<float>();
    p.columns = columns.data_ptr<float>();
    p.diagonals = diagonals.data_ptr<float>();
    check_launch(est::run_masses(p, call.elem, current_stream()), "estimate_masses");
    return {columns, diagonals};
}

// The document-aware masses of packed documents, passes A and B of all of them in the same
// launches (ScoreParams::documents). Document d is the keys [starts[d], starts[d] + lengths[d])
// of batch row rows[d] of k [B, S, Hkv, D]; its last lq = min(last_q, n) queries are rows
// q_rows[d] .. q_rows[d] + lq - 1 of q [B, Sq, H, D]; its masses (each divided by its lq) are
// weighted by weights[d]. Returns (columns [B, H, S], diagonals [B, H, S]) float32: column masses
// at the documents' keys, token-diagonal masses summed over each row's documents (0 where no
// document is that long). The document table goes to the device by an asynchronous copy from
// pinned memory: no host synchronisation.
std::vector<at::Tensor> document_masses(const at::Tensor& q_in, const at::Tensor& k_in,
                                        const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths,
                                        const std::vector<int64_t>& rows, const std::vector<int64_t>& q_rows,
                                        const std::vector<double>& weights, int64_t last_q, double scale) {
    const c10::cuda::OptionalCUDAGuard guard(q_in.device());
    ScoreCall call = checked_pair(q_in, k_in);
    est::ScoreParams& p = call.p;
    const int64_t batch = p.batch, heads = p.heads, q_len = q_in.size(1), seq_len = k_in.size(1);
    const size_t count = starts.size();
    TORCH_CHECK_VALUE(count >= 1 && lengths.size() == count && rows.size() == count && q_rows.size() == count &&
                          weights.size() == count,
                      kName, ": estimate_document_masses takes one start, length, row, q row and weight per document, "
                      "got ", text(starts.size()), ", ", text(lengths.size()), ", ", text(rows.size()), ", ",
                      text(q_rows.size()), " and ", text(weights.size()));
    TORCH_CHECK_VALUE(last_q >= 1 && last_q <= est::kTile * est::kMaxChunks, kName, ": last_q must be in [1, ",
                      text(est::kTile * est::kMaxChunks), "], got ", text(last_q));
    TORCH_CHECK_VALUE(seq_len < kIntMax / 2 && count < static_cast<size_t>(kIntMax) &&
                          batch * heads * seq_len < (int64_t{1} << 40),
                      kName, ": the mass outputs are too large");
    std::vector<est::ScoreDocument> docs(count);
    int64_t total_tiles = 0;
    for (size_t d = 0; d < count; ++d) {
        const int64_t n = lengths[d], lq = std::min(last_q, n);
        TORCH_CHECK_VALUE(rows[d] >= 0 && rows[d] < batch && n >= 1 && starts[d] >= 0 && starts[d] + n <= seq_len &&
                              q_rows[d] >= 0 && q_rows[d] + lq <= q_len,
                          kName, ": document ", text(d), " (row ", text(rows[d]), ", keys [", text(starts[d]), ", ",
                          text(starts[d] + n), "), query rows from ", text(q_rows[d]), ") does not lie in q ",
                          text(q_in.sizes()), " and k ", text(k_in.sizes()));
        est::ScoreDocument& doc = docs[d];
        doc.row = static_cast<int>(rows[d]);
        doc.q_row = static_cast<int>(q_rows[d]);
        doc.key_first = static_cast<int>(starts[d]);
        doc.length = static_cast<int>(n);
        doc.lq = static_cast<int>(lq);
        doc.chunks = static_cast<int>((lq + est::kTile - 1) / est::kTile);
        doc.num_tiles = static_cast<int>((n + est::kTile - 1) / est::kTile);
        doc.weight = static_cast<float>(weights[d]);
        total_tiles += doc.num_tiles;
    }
    // one split length for every document, about wanted_ctas over the launch
    const int64_t wanted = wanted_ctas(q_in);
    const int64_t tiles_per_split = std::max<int64_t>(1, (heads * total_tiles + wanted - 1) / wanted);
    int64_t ctas = 0, stats_rows = 0, partials = 0;
    int split_stride = 1, chunks = 1;
    for (est::ScoreDocument& doc : docs) {
        doc.tiles_per_split = static_cast<int>(tiles_per_split);
        doc.splits = static_cast<int>((doc.num_tiles + tiles_per_split - 1) / tiles_per_split);
        doc.cta_first = static_cast<int>(ctas);
        doc.stats_first = stats_rows;
        doc.partial_first = partials;
        ctas += heads * doc.splits;
        stats_rows += heads * doc.lq;
        partials += heads * doc.chunks * static_cast<int64_t>(doc.num_tiles) * est::kDiagSlots;
        split_stride = std::max(split_stride, doc.splits);
        chunks = std::max(chunks, doc.chunks);
        TORCH_CHECK_VALUE(ctas < kIntMax, kName, ": too many CTAs");
    }
    // each row's documents, longest first (the diagonal gather stops at the first too short)
    std::vector<int32_t> order(count), row_first(batch + 1, 0);
    for (size_t d = 0; d < count; ++d) order[d] = static_cast<int32_t>(d);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return docs[a].row != docs[b].row ? docs[a].row < docs[b].row : docs[a].length > docs[b].length;
    });
    for (const est::ScoreDocument& doc : docs) ++row_first[doc.row + 1];
    for (int64_t b = 0; b < batch; ++b) row_first[b + 1] += row_first[b];

    const size_t table_bytes = count * sizeof(est::ScoreDocument), order_bytes = count * sizeof(int32_t);
    at::Tensor host = at::empty({static_cast<int64_t>(table_bytes + order_bytes + row_first.size() * sizeof(int32_t))},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    unsigned char* bytes = host.data_ptr<unsigned char>();
    std::memcpy(bytes, docs.data(), table_bytes);
    std::memcpy(bytes + table_bytes, order.data(), order_bytes);
    std::memcpy(bytes + table_bytes + order_bytes, row_first.data(), row_first.size() * sizeof(int32_t));
    const at::Tensor table = host.to(q_in.device(), /*non_blocking=*/true);
    const unsigned char* device_bytes = table.data_ptr<unsigned char>();
    p.documents = reinterpret_cast<const est::ScoreDocument*>(device_bytes);
    p.row_documents = reinterpret_cast<const int*>(device_bytes + table_bytes);
    p.row_first = reinterpret_cast<const int*>(device_bytes + table_bytes + order_bytes);
    p.num_documents = static_cast<int>(count);
    p.document_ctas = static_cast<int>(ctas);
    p.chunks = chunks;
    p.seq_len = static_cast<int>(seq_len);
    p.block = est::kTile;
    p.scale = static_cast<float>(scale);
    p.stats_rows = stats_rows;
    p.split_stride = split_stride;
    p.columns_stride = seq_len;

    const auto options = q_in.options().dtype(at::kFloat);
    at::Tensor part_max = at::empty({stats_rows * split_stride}, options);
    at::Tensor part_sum = at::empty({stats_rows * split_stride}, options);
    at::Tensor row_max = at::empty({stats_rows}, options);
    at::Tensor row_sum = at::empty({stats_rows}, options);
    at::Tensor diag_partials = at::empty({partials}, options);
    at::Tensor columns = at::zeros({batch, heads, seq_len}, options);  // keys outside every document stay 0
    at::Tensor diagonals = at::empty({batch, heads, seq_len}, options);
    p.part_max = part_max.data_ptr<float>();
    p.part_sum = part_sum.data_ptr<float>();
    p.row_max = row_max.data_ptr<float>();
    p.row_sum = row_sum.data_ptr<float>();
    p.diag_partials = diag_partials.data_ptr<float>();
    p.columns = columns.data_ptr<float>();
    p.diagonals = diagonals.data_ptr<float>();
    check_launch(est::run_row_stats(p, call.elem, current_stream()), "estimate_document_masses (row statistics)");
    check_launch(est::run_masses(p, call.elem, current_stream()), "estimate_document_masses (masses)");
    return {columns, diagonals};
}

// One select segment: checks mass [..., n] (float32 CUDA, >= 0), allocates (indices [..., min(cap, n)]
// int32 ascending, PAD padded; count [...] int32).
struct SelectList {
    at::Tensor mass, indices, count;
    est::SelectSegment segment;
};

SelectList select_list(const at::Tensor& mass_in, double p_top, int64_t cap, const char* name) {
    TORCH_CHECK_VALUE(mass_in.is_cuda() && mass_in.scalar_type() == at::kFloat && mass_in.dim() >= 1, kName, ": ",
                      name, " takes a float32 CUDA tensor [..., n], got ", text(mass_in.scalar_type()), " ",
                      text(mass_in.sizes()), " on ", text(mass_in.device()));
    TORCH_CHECK_VALUE(p_top > 0.0 && p_top <= 1.0 && cap >= 1, kName, ": need 0 < p <= 1 and cap >= 1, got p=", text(p_top),
                      " cap=", text(cap));
    const int64_t n = mass_in.size(-1);
    TORCH_CHECK_VALUE(n >= 1 && n <= est::kMaxSelectLen, kName, ": rows must hold 1 .. ", text(est::kMaxSelectLen),
                      " entries, got ", text(n));
    SelectList list;
    list.mass = mass_in.contiguous();
    const int64_t rows = list.mass.numel() / n;
    TORCH_CHECK_VALUE(rows >= 1 && rows < kIntMax, kName, ": no rows to select from");
    const int64_t width = std::min(cap, n);
    std::vector<int64_t> index_shape(list.mass.sizes().begin(), list.mass.sizes().end());
    index_shape.back() = width;
    std::vector<int64_t> count_shape(list.mass.sizes().begin(), list.mass.sizes().end() - 1);
    list.indices = at::empty(index_shape, list.mass.options().dtype(at::kInt));
    list.count = at::empty(count_shape, list.mass.options().dtype(at::kInt));
    est::SelectSegment& seg = list.segment;
    seg.mass = list.mass.data_ptr<float>();
    seg.row_stride = n;
    seg.rows = static_cast<int>(rows);
    seg.n = static_cast<int>(n);
    seg.p = static_cast<float>(p_top);
    seg.cap = static_cast<int>(std::min<int64_t>(cap, kIntMax));
    seg.width = static_cast<int>(width);
    seg.indices = list.indices.data_ptr<int32_t>();
    seg.count = list.count.data_ptr<int32_t>();
    return list;
}

void run_select_lists(std::initializer_list<const SelectList*> lists, const at::Tensor& like) {
    est::SelectParams p;
    p.segments = 0;
    int64_t rows = 0, n = 0;
    for (const SelectList* list : lists) {
        p.segment[p.segments++] = list->segment;  // at most two lists
        rows += list->segment.rows;
        n = std::max<int64_t>(n, list->segment.n);
    }
    TORCH_CHECK_VALUE(rows < kIntMax && rows * ((n + est::kSelectChunk - 1) / est::kSelectChunk) < kIntMax, kName,
                      ": too many rows to select from");
    at::Tensor scratch =
        at::empty({est::select_scratch_bytes(static_cast<int>(rows), static_cast<int>(n))}, like.options().dtype(at::kByte));
    p.scratch = scratch.data_ptr();
    check_launch(est::run_select(p, current_stream()), "estimate_select");
}

// Top-p of each row of mass [..., n] (float32, >= 0): (indices [..., min(cap, n)] int32 ascending,
// PAD padded; count [...] int32).
std::vector<at::Tensor> select(const at::Tensor& mass_in, double p_top, int64_t cap) {
    TORCH_CHECK_VALUE(mass_in.is_cuda(), kName, ": estimate_select takes a float32 CUDA tensor, got one on ",
                      text(mass_in.device()));
    const c10::cuda::OptionalCUDAGuard guard(mass_in.device());
    const SelectList list = select_list(mass_in, p_top, cap, "estimate_select");
    run_select_lists({&list}, list.mass);
    return {list.indices, list.count};
}

// Two selections in the same launches (the vertical and slash lists of the estimator):
// (indices_a, count_a, indices_b, count_b) as two select calls would return them.
std::vector<at::Tensor> select_pair(const at::Tensor& mass_a, double p_a, int64_t cap_a, const at::Tensor& mass_b,
                                    double p_b, int64_t cap_b) {
    TORCH_CHECK_VALUE(mass_a.is_cuda() && mass_b.device() == mass_a.device(), kName,
                      ": estimate_select_pair takes float32 tensors on one CUDA device, got ", text(mass_a.device()),
                      " and ", text(mass_b.device()));
    const c10::cuda::OptionalCUDAGuard guard(mass_a.device());
    const SelectList a = select_list(mass_a, p_a, cap_a, "estimate_select_pair");
    const SelectList b = select_list(mass_b, p_b, cap_b, "estimate_select_pair");
    TORCH_CHECK_VALUE(static_cast<int64_t>(a.segment.rows) + b.segment.rows < kIntMax, kName,
                      ": too many rows to select from");
    run_select_lists({&a, &b}, a.mass);
    return {a.indices, a.count, b.indices, b.count};
}

void check_list(const at::Tensor& list, const at::Tensor& count, const char* name, const at::Tensor& like) {
    TORCH_CHECK_VALUE(list.scalar_type() == at::kInt && count.scalar_type() == at::kInt && list.dim() == 3 &&
                          count.dim() == 2 && list.size(0) == like.size(0) && list.size(1) == like.size(1) &&
                          count.size(0) == like.size(0) && count.size(1) == like.size(1) && list.size(2) >= 1 &&
                          list.device() == like.device() && count.device() == like.device(),
                      kName, ": ", name, " must be int32 [B, H, n >= 1] with int32 counts [B, H] on one device, got ",
                      text(list.scalar_type()), " ", text(list.sizes()), " and ", text(count.scalar_type()), " ",
                      text(count.sizes()));
}

// The union of each row's selected columns [B, H, a] (int32 ascending, the first count [B, H]
// read) and its batch row's extra columns [B, e] (int32 ascending, PAD padded): (merged
// [B, H, a + e] ascending without repeats, PAD padded; count [B, H]) int32.
std::vector<at::Tensor> merge(const at::Tensor& selected_in, const at::Tensor& count_in, const at::Tensor& extra_in) {
    TORCH_CHECK_VALUE(selected_in.is_cuda(), kName, ": estimate_merge_columns takes CUDA tensors");
    const c10::cuda::OptionalCUDAGuard guard(selected_in.device());
    check_list(selected_in, count_in, "selected columns", selected_in);
    TORCH_CHECK_VALUE(extra_in.scalar_type() == at::kInt && extra_in.dim() == 2 &&
                          extra_in.size(0) == selected_in.size(0) && extra_in.size(1) >= 1 &&
                          extra_in.device() == selected_in.device(),
                      kName, ": extra columns must be int32 [B, e >= 1] on the selected columns' device, got ",
                      text(extra_in.scalar_type()), " ", text(extra_in.sizes()), " for selected columns ",
                      text(selected_in.sizes()));
    const at::Tensor selected = selected_in.contiguous(), count_all = count_in.contiguous(),
                     extra = extra_in.contiguous();
    const int64_t batch = selected.size(0), heads = selected.size(1);
    const int64_t width = selected.size(2) + extra.size(1);
    TORCH_CHECK_VALUE(batch * heads < kIntMax && batch * heads * width < (int64_t{1} << 40), kName,
                      ": too many columns to merge");
    at::Tensor merged = at::empty({batch, heads, width}, selected.options());
    at::Tensor merged_count = at::empty({batch, heads}, selected.options());
    est::MergeParams p;
    p.selected = selected.data_ptr<int32_t>();
    p.selected_count = count_all.data_ptr<int32_t>();
    p.selected_width = static_cast<int>(selected.size(2));
    p.extra = extra.data_ptr<int32_t>();
    p.extra_width = static_cast<int>(extra.size(1));
    p.rows = static_cast<int>(batch * heads);
    p.heads = static_cast<int>(heads);
    p.merged = merged.data_ptr<int32_t>();
    p.merged_count = merged_count.data_ptr<int32_t>();
    check_launch(est::run_merge(p, current_stream()), "estimate_merge_columns");
    return {merged, merged_count};
}

// The compact index from selected token diagonals [B, H, a] (counts [B, H]) and selected
// columns [B, H, c] (ascending, counts [B, H]): (slash, slash_count, vertical, vertical_count)
// as SparseIndex.from_vertical_slash builds them, in fixed widths.
std::vector<at::Tensor> finalize(const at::Tensor& slash_tokens_in, const at::Tensor& slash_token_count_in,
                                 const at::Tensor& columns_in, const at::Tensor& column_count_in, int64_t seq_len,
                                 int64_t block, int64_t local_blocks, int64_t sink_tokens) {
    TORCH_CHECK_VALUE(slash_tokens_in.is_cuda(), kName, ": estimate_finalize takes CUDA tensors");
    const c10::cuda::OptionalCUDAGuard guard(slash_tokens_in.device());
    check_list(slash_tokens_in, slash_token_count_in, "slash tokens", slash_tokens_in);
    check_list(columns_in, column_count_in, "columns", slash_tokens_in);
    TORCH_CHECK_VALUE(block == 64 || block == 128, kName, ": block_size must be 64 or 128, got ", text(block));
    TORCH_CHECK_VALUE(seq_len >= 1 && seq_len < kIntMax / 2 && local_blocks >= 1 && sink_tokens >= 0, kName,
                      ": need seq_len >= 1, local_blocks >= 1, sink_tokens >= 0");
    const at::Tensor slash_tokens = slash_tokens_in.contiguous(), slash_token_count = slash_token_count_in.contiguous();
    const at::Tensor columns = columns_in.contiguous(), column_count = column_count_in.contiguous();
    const int64_t batch = slash_tokens.size(0), heads = slash_tokens.size(1);
    const int64_t num_blocks = (seq_len + block - 1) / block;
    const int64_t slash_width =
        std::max<int64_t>(1, std::min<int64_t>(num_blocks, std::min(local_blocks, num_blocks) + 2 * slash_tokens.size(2)));
    const int64_t vertical_width = std::max<int64_t>(1, std::min(sink_tokens, seq_len) + columns.size(2));
    const auto options = slash_tokens.options();
    at::Tensor slash = at::empty({batch, heads, slash_width}, options);
    at::Tensor slash_count = at::empty({batch, heads}, options);
    at::Tensor vertical = at::empty({batch, heads, vertical_width}, options);
    at::Tensor vertical_count = at::empty({batch, heads}, options);
    est::FinalizeParams p;
    p.slash_tokens = slash_tokens.data_ptr<int32_t>();
    p.slash_token_count = slash_token_count.data_ptr<int32_t>();
    p.slash_token_width = static_cast<int>(slash_tokens.size(2));
    p.columns = columns.data_ptr<int32_t>();
    p.column_count = column_count.data_ptr<int32_t>();
    p.column_width = static_cast<int>(columns.size(2));
    p.rows = static_cast<int>(batch * heads);
    p.seq_len = static_cast<int>(seq_len);
    p.block = static_cast<int>(block);
    p.num_blocks = static_cast<int>(num_blocks);
    p.local_blocks = static_cast<int>(std::min(local_blocks, num_blocks));
    p.sink_tokens = static_cast<int>(std::min(sink_tokens, seq_len));
    p.slash = slash.data_ptr<int32_t>();
    p.slash_count = slash_count.data_ptr<int32_t>();
    p.slash_width = static_cast<int>(slash_width);
    p.vertical = vertical.data_ptr<int32_t>();
    p.vertical_count = vertical_count.data_ptr<int32_t>();
    p.vertical_width = static_cast<int>(vertical_width);
    check_launch(est::run_finalize(p, current_stream()), "estimate_finalize");
    return {slash, slash_count, vertical, vertical_count};
}

}  // namespace

void register_estimator(pybind11::module_& m) {
    namespace py = pybind11;
    m.def("estimate_row_stats", &row_stats,
          "estimator pass A -> (row_max, row_sum) float32 [B, H, lq] over the local keys", py::arg("q_last"),
          py::arg("k"), py::arg("q_start"), py::arg("seq_len"), py::arg("world"), py::arg("rank"),
          py::arg("block_size"), py::arg("scale"));
    m.def("estimate_masses", &masses,
          "estimator pass B -> (columns [B, H, sk], diagonals [B, H, seq_len]) float32 masses / lq",
          py::arg("q_last"), py::arg("k"), py::arg("row_max"), py::arg("row_sum"), py::arg("q_start"),
          py::arg("seq_len"), py::arg("world"), py::arg("rank"), py::arg("block_size"), py::arg("scale"));
    m.def("estimate_document_masses", &document_masses,
          "the document-aware masses of packed documents -> (columns, diagonals) float32 [B, H, S]",
          py::arg("q"), py::arg("k"), py::arg("starts"), py::arg("lengths"), py::arg("rows"), py::arg("q_rows"),
          py::arg("weights"), py::arg("last_q"), py::arg("scale"));
    m.def("estimate_select", &select,
          "top-p of each row of mass [..., n] -> (indices [..., min(cap, n)] ascending PAD padded, count) int32",
          py::arg("mass"), py::arg("p"), py::arg("cap"));
    m.def("estimate_select_pair", &select_pair,
          "estimate_select on two mass lists in the same launches -> (indices_a, count_a, indices_b, count_b)",
          py::arg("mass_a"), py::arg("p_a"), py::arg("cap_a"), py::arg("mass_b"), py::arg("p_b"), py::arg("cap_b"));
    m.def("estimate_merge_columns", &merge,
          "selected columns [B, H, a] (+ counts) and each row's extra columns [B, e] -> (merged [B, H, a + e], count)",
          py::arg("selected"), py::arg("count"), py::arg("extra"));
    m.def("estimate_finalize", &finalize,
          "selected token diagonals and columns -> (slash, slash_count, vertical, vertical_count) int32",
          py::arg("slash_tokens"), py::arg("slash_token_count"), py::arg("columns"), py::arg("column_count"),
          py::arg("seq_len"), py::arg("block_size"), py::arg("local_blocks"), py::arg("sink_tokens"));
}

}  // namespace mtraining
