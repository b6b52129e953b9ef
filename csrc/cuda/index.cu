// build_step_index: the per-call lists, one CTA per (batch, head), O(|slash| + |vertical|).
#include "step_index.cuh"

namespace mtr {
namespace {

constexpr int kIndexThreads = 256;

__global__ void __launch_bounds__(kIndexThreads) build_step_index_kernel(const AttentionParams p) {
    __shared__ int warp_counts[kIndexThreads / 32];
    const int bh = blockIdx.x;
    const int world = p.world;
    const int rank_gap = p.q_rank - p.k_rank;
    const int block = p.block_size;
    bool done = false;

    // Diagonal d joins query rank r to key rank s iff (d - (r - s)) % W == 0; local offset (d - (r - s)) / W.
    static_assert(kSkip == -1, "stripe_local_distance returns -1 for a diagonal to drop");
    int cursor = 0;
    const int num_slash = min(p.slash_count[bh], p.slash_len);
    const int offsets = compact_in_order<kIndexThreads>(
        p.slash + static_cast<size_t>(bh) * p.slash_len, num_slash, cursor,
        p.local_offsets + static_cast<size_t>(bh) * p.slash_len, num_slash + kIndexThreads, warp_counts, done,
        [=](int d) { return mtraining::stripe_local_distance(d, rank_gap, world); });

    // Global token c lies in global block c / bs, held by rank (c / bs) % W as local block (c / bs) / W.
    cursor = 0;
    const int num_vertical = min(p.vertical_count[bh], p.vertical_len);
    const int k_rank = p.k_rank;
    const int seq_k = p.seq_k;
    const int keys = compact_in_order<kIndexThreads>(
        p.vertical + static_cast<size_t>(bh) * p.vertical_len, num_vertical, cursor,
        p.local_keys + static_cast<size_t>(bh) * p.vertical_len, num_vertical + kIndexThreads, warp_counts, done,
        [=](int c) {
            if (c < 0 || !mtraining::stripe_column_on_rank(c, block, world, k_rank)) return kSkip;
            const int key = mtraining::stripe_local_token(c, block, world);
            return key < seq_k ? key : kSkip;
        });

    if (threadIdx.x == 0) {
        p.num_offsets[bh] = offsets;
        p.num_keys[bh] = keys;
    }
}

}  // namespace

cudaError_t build_step_index(const AttentionParams& p, cudaStream_t stream) {
    const int rows = p.batch * p.heads;
    if (rows == 0) return cudaSuccess;
    build_step_index_kernel<<<rows, kIndexThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace mtr
