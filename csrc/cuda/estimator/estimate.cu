// Launchers of the fused vertical-slash estimator kernels (estimate_kernels.cuh); raw pointers and
// a stream in, no ATen (the binding is estimate_binding.cpp).
#include <type_traits>

#include "../kernel_instances.h"
#include "estimate_kernels.cuh"

namespace mtr {
namespace est {
namespace {

// run(element, head_dim) for the head dims the estimator is built for, the attention kernels' own
// (kernel_instances.h, which the binding's head_dim check reads too).
template <typename Run>
cudaError_t dispatch(Elem elem, int head_dim, Run run) {
    auto with_element = [&](auto element) {
        switch (head_dim) {
#define MTR_HEAD_DIM_CASE(D) \
    case D: return run(element, std::integral_constant<int, D>{});
            MTR_FOR_EACH_HEAD_DIM(MTR_HEAD_DIM_CASE)
#undef MTR_HEAD_DIM_CASE
            default: return cudaErrorInvalidValue;
        }
    };
    return elem == Elem::kBF16 ? with_element(__nv_bfloat16{}) : with_element(__half{});
}

bool valid_scores(const ScoreParams& p) {
    const bool layout = p.stats_rows >= 1 && p.split_stride >= 1 && p.columns_stride >= 1;
    if (p.documents != nullptr)  // the documents' own fields are the host's (estimate_binding.cpp)
        return layout && p.num_documents >= 1 && p.document_ctas >= p.num_documents && p.row_documents != nullptr &&
               p.row_first != nullptr && p.batch >= 1 && p.kv_heads >= 1 && p.heads % p.kv_heads == 0 &&
               p.chunks >= 1 && p.chunks <= kMaxChunks && p.seq_len >= 1 && p.world == 1 && p.block % kTile == 0;
    return layout && p.split_stride == p.splits && p.batch >= 1 && p.kv_heads >= 1 && p.heads % p.kv_heads == 0 &&
           p.lq >= 1 && p.lq <= kTile * kMaxChunks && p.chunks == (p.lq + kTile - 1) / kTile && p.sk >= 1 &&
           p.num_tiles == (p.sk + kTile - 1) / kTile && p.splits >= 1 && p.tiles_per_split >= 1 &&
           (p.splits - 1) * p.tiles_per_split < p.num_tiles && p.splits * p.tiles_per_split >= p.num_tiles &&
           p.block % kTile == 0 && p.world >= 1 && p.rank >= 0 && p.rank < p.world && p.seq_len >= 1;
}

unsigned score_grid(const ScoreParams& p) {
    if (p.documents != nullptr) return static_cast<unsigned>(p.document_ctas);
    return static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.heads) * static_cast<unsigned>(p.splits);
}

}  // namespace

int score_smem_bytes(int head_dim, int chunks, bool masses) {
    constexpr int kElementBytes = 2;  // bf16 and fp16
    return (chunks + 2) * kTile * head_dim * kElementBytes +
           (masses ? kTile * kProbStride * static_cast<int>(sizeof(float)) : 0);
}

int select_smem_bytes() { return kRadixBins * 32 * static_cast<int>(sizeof(unsigned long long)); }

// Launches a score pass (row statistics, or masses with the probability tile) for p's dtype and
// head dim, after granting it the dynamic shared memory it needs.
template <bool kMasses>
cudaError_t launch_score_pass(const ScoreParams& p, Elem elem, cudaStream_t stream) {
    return dispatch(elem, p.head_dim, [&](auto element, auto dim) {
        using T = decltype(element);
        constexpr int D = decltype(dim)::value;
        const auto kernel = kMasses ? masses_kernel<T, D> : row_stats_kernel<T, D>;
        const int smem = score_smem_bytes(D, p.chunks, kMasses);
        cudaError_t s = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (s != cudaSuccess) return s;
        kernel<<<score_grid(p), kScoreThreads, smem, stream>>>(p);
        return cudaGetLastError();
    });
}

cudaError_t run_row_stats(const ScoreParams& p, Elem elem, cudaStream_t stream) {
    if (!valid_scores(p)) return cudaErrorInvalidValue;
    cudaError_t status = launch_score_pass<false>(p, elem, stream);
    if (status != cudaSuccess) return status;
    combine_row_stats_kernel<<<static_cast<unsigned>((p.stats_rows + kStatsThreads - 1) / kStatsThreads),
                               kStatsThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

cudaError_t run_masses(const ScoreParams& p, Elem elem, cudaStream_t stream) {
    if (!valid_scores(p)) return cudaErrorInvalidValue;
    cudaError_t status = launch_score_pass<true>(p, elem, stream);
    if (status != cudaSuccess) return status;
    const dim3 grid(static_cast<unsigned>((p.seq_len + kGatherThreads - 1) / kGatherThreads),
                    static_cast<unsigned>(p.batch * p.heads));
    if (p.documents != nullptr) gather_document_diagonals_kernel<<<grid, kGatherThreads, 0, stream>>>(p);
    else gather_diagonals_kernel<<<grid, kGatherThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

namespace {

struct SelectLayout {
    long long histogram, states, records, total;  // byte offsets and size
};

SelectLayout select_layout(int rows, int n) {
    const auto align = [](long long bytes) { return (bytes + 255) / 256 * 256; };
    const long long chunks = (static_cast<long long>(n) + kSelectChunk - 1) / kSelectChunk;
    SelectLayout l;
    l.histogram = 0;
    l.states = align(static_cast<long long>(kSelectLevels) * rows * kRadixBins * sizeof(unsigned long long));
    l.records = l.states + align(static_cast<long long>(kSelectLevels - 1) * rows * sizeof(SelectState));
    l.total = l.records + align(static_cast<long long>(rows) * chunks * kRecordWords * sizeof(uint32_t));
    return l;
}

bool valid_segment(const SelectSegment& s) {
    return s.rows >= 1 && s.n >= 1 && s.n <= kMaxSelectLen && s.cap >= 1 && s.width == (s.cap < s.n ? s.cap : s.n) &&
           s.mass != nullptr && s.indices != nullptr && s.count != nullptr && s.row_stride >= s.n;
}

}  // namespace

long long select_scratch_bytes(int rows, int n) { return select_layout(rows, n).total; }

cudaError_t run_select(const SelectParams& params, cudaStream_t stream) {
    if (params.segments < 1 || params.segments > 2 || params.scratch == nullptr) return cudaErrorInvalidValue;
    SelectParams p = params;
    long long rows = 0;
    int n = 0;
    for (int i = 0; i < p.segments; ++i) {
        if (!valid_segment(p.segment[i])) return cudaErrorInvalidValue;
        rows += p.segment[i].rows;
        n = p.segment[i].n > n ? p.segment[i].n : n;
    }
    p.max_chunks = (n + kSelectChunk - 1) / kSelectChunk;
    if (rows * p.max_chunks >= (1ll << 31)) return cudaErrorInvalidValue;
    p.total_rows = static_cast<int>(rows);
    const SelectLayout layout = select_layout(p.total_rows, n);
    unsigned char* base = static_cast<unsigned char*>(p.scratch);
    p.histogram = reinterpret_cast<unsigned long long*>(base + layout.histogram);
    p.states = base + layout.states;
    p.records = reinterpret_cast<uint32_t*>(base + layout.records);
    cudaError_t s = cudaMemsetAsync(p.histogram, 0, static_cast<size_t>(layout.states), stream);
    if (s != cudaSuccess) return s;
    const unsigned grid = static_cast<unsigned>(rows * p.max_chunks);
    const int smem = select_smem_bytes();
    auto histogram_pass = [&](auto kernel) {
        cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (status != cudaSuccess) return status;
        kernel<<<grid, kSelectThreads, smem, stream>>>(p);
        return cudaGetLastError();
    };
    if ((s = histogram_pass(select_histogram_kernel<0>)) != cudaSuccess) return s;
    if ((s = histogram_pass(select_histogram_kernel<1>)) != cudaSuccess) return s;
    if ((s = histogram_pass(select_histogram_kernel<2>)) != cudaSuccess) return s;
    if ((s = histogram_pass(select_histogram_kernel<3>)) != cudaSuccess) return s;
    select_write_kernel<<<grid, kSelectThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

cudaError_t run_merge(const MergeParams& p, cudaStream_t stream) {
    if (p.rows < 1 || p.heads < 1 || p.rows % p.heads != 0 || p.selected_width < 1 || p.extra_width < 1 ||
        p.selected == nullptr || p.selected_count == nullptr || p.extra == nullptr || p.merged == nullptr ||
        p.merged_count == nullptr)
        return cudaErrorInvalidValue;
    merge_kernel<<<p.rows, kFinalizeThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

cudaError_t run_finalize(const FinalizeParams& p, cudaStream_t stream) {
    if (p.rows < 1 || p.num_blocks < 1 || p.block < 1 || p.slash_width < 1 || p.vertical_width < 1)
        return cudaErrorInvalidValue;
    const int smem = (p.num_blocks + 15) / 16 * 16;
    if (smem > 48 * 1024) {
        cudaError_t s = cudaFuncSetAttribute(finalize_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (s != cudaSuccess) return s;
    }
    finalize_kernel<<<p.rows, kFinalizeThreads, smem, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace est
}  // namespace mtr
