// The query-side kernel: one CTA per (query block, head, batch) walks the key tiles its block reads
// (KeyTileSource) with a two-stage pipeline (cp.async; TMA for contiguous key tiles on the wgmma
// path). kBackward = false is the forward (online softmax, out + lse); kBackward = true computes
// dQ from the saved lse and delta. Arch is the tensor-core path: WarpMma (mma.sync) or
// WarpgroupMma (wgmma, sm_90a).
#pragma once

#include <math.h>

#include <type_traits>

#include "epilogue.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "step_index.cuh"
#include "warpgroup_mma.cuh"

namespace mtr {

template <typename Arch, typename T, int D, int BS, int MA, bool kBackward>
struct QueryKernelConfig {
    static constexpr int kRows = Arch::template kCtaRows<BS, MA, D>;  // query rows per CTA: all or part of a block
    static constexpr int kStages = Arch::template kStages<D>;  // K/V tile buffers
    static constexpr int kSplits = BS / kRows;                   // CTAs per query block
    static constexpr int kWarps = kRows / (16 * MA);
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kListCapacity = 2048;
    static constexpr int kKeyTileElements = kKeyTile * D;
    static constexpr int kQueryTiles = kBackward ? 2 : 1;  // Q (and dO)
    static_assert(BS % kRows == 0 && kRows % (16 * MA) == 0 && BS % kKeyTile == 0,
                  "block size must split into CTAs, warps and key tiles");
    static_assert(kThreads >= kKeyTile, "too few threads to copy a gathered tile's keys");

    static size_t smem_bytes(int bit_words) {
        return Arch::kTileAlignment +
               sizeof(T) * (static_cast<size_t>(kQueryTiles) * kRows * D + 2 * kStages * kKeyTileElements) +
               sizeof(uint64_t) * 2 + sizeof(int) * (kListCapacity + 32 + kStages * kKeyTile) + sizeof(uint32_t) * bit_words;
    }
};

// A key tile's scores S (and dP) -> the running result: logits, masked, then the forward's online
// softmax and O += P V, or dQ's dS = P (dP - delta) and dQ += dS K.
template <typename Arch, int MA, int D, bool kBackward, typename T, typename Softmax, typename Mask>
__device__ __forceinline__ void finish_tile(float (&s)[MA][8][4], const float (&dp)[kBackward ? MA : 1][8][4],
                                            float (&acc)[MA][D / 8][4], Softmax& softmax, const Mask& mask,
                                            const KeyTile& tile, const int* gathered_keys, const Logits& logits,
                                            const T* key_tile, const T* value_tile) {
    logits.prepare(s);
    mask.apply(s, tile, gathered_keys);
    if constexpr (!kBackward) {
        softmax.template update<D>(s, acc);
        Arch::template accumulate<MA, D>(acc, s, value_tile);
    } else {
        softmax.dscores(s, dp, logits);
        Arch::template accumulate<MA, D>(acc, s, key_tile);
    }
}

template <typename Arch, typename T, int D, int BS, int MA, bool kBackward>
__global__ void __launch_bounds__(QueryKernelConfig<Arch, T, D, BS, MA, kBackward>::kThreads)
    query_kernel(const __grid_constant__ AttentionParams p) {
    using Config = QueryKernelConfig<Arch, T, D, BS, MA, kBackward>;
    constexpr int kThreads = Config::kThreads;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = align_shared<Arch::kTileAlignment>(smem_raw);
    T* q_tile = reinterpret_cast<T*>(smem);
    T* dout_tile = q_tile + Config::kRows * D;  // backward only
    T* key_tiles = q_tile + Config::kQueryTiles * Config::kRows * D;
    T* value_tiles = key_tiles + Config::kStages * Config::kKeyTileElements;
    uint64_t* tile_barriers = reinterpret_cast<uint64_t*>(value_tiles + Config::kStages * Config::kKeyTileElements);
    int* key_list = reinterpret_cast<int*>(tile_barriers + 2);
    int* warp_counts = key_list + Config::kListCapacity;
    // document masking: each buffer's gathered keys, copied at issue (key_list may be refilled
    // for the next tile before this one is computed)
    int* gathered_keys = warp_counts + 32;
    uint32_t* bits = reinterpret_cast<uint32_t*>(gathered_keys + Config::kStages * kKeyTile);

    const int cta = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // late blocks read the most: start them first
    const int query_block = cta / Config::kSplits;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (p.heads / p.kv_heads);
    const int bh = batch * p.heads + head;
    const int row0 = Arch::template first_row<MA>();  // this warp's rows: row0 + ma * kSliceStride + 0..15
    const int query_first = query_block * BS + cta % Config::kSplits * Config::kRows;
    if (query_first >= p.seq_q) return;  // the empty part of a partial last block (uniform)
    const size_t q_stride = static_cast<size_t>(p.heads) * D;
    const size_t kv_stride = static_cast<size_t>(p.kv_heads) * D;
    // This CTA's rows of q/dout and its kv head's rows of k/v start at these pointers.
    const size_t q_head = static_cast<size_t>(batch) * p.seq_q * q_stride + head * D;
    const size_t kv_head_start = static_cast<size_t>(batch) * p.seq_k * kv_stride + kv_head * D;
    const T* q = static_cast<const T*>(p.q) + q_head;
    const T* dout = kBackward ? static_cast<const T*>(p.dout) + q_head : nullptr;
    const T* k = static_cast<const T*>(p.k) + kv_head_start;
    const T* v = static_cast<const T*>(p.v) + kv_head_start;

    const int query_rows = p.seq_q - query_first;
    const size_t query_start = static_cast<size_t>(query_first) * q_stride;
    load_consecutive_rows_async<Arch, Config::kRows, D, kThreads, kBackward>(
        q_tile, dout_tile, q + query_start, kBackward ? dout + query_start : nullptr, q_stride, query_rows);
    cp_async_commit();

    const int* offsets = p.local_offsets + static_cast<size_t>(bh) * p.slash_len;
    const int num_offsets = p.num_offsets[bh];
    const int num_blocks = max((p.seq_q + BS - 1) / BS, (p.seq_k + BS - 1) / BS);
    TmaBuffers<2> tma{tile_barriers};
    if (Arch::kTma && p.tma) tma.init();  // build_offset_bits' barriers order it before the first copy
    build_offset_bits<kThreads>(bits, (num_blocks + 31) / 32, offsets, num_offsets);
    // Slash tiles wholly inside the keys are 64 contiguous rows: TMA copies them (wgmma path).
    auto by_tma = [&](const KeyTile& tile) {
        return Arch::kTma && p.tma && !tile.gathered && tile.first + kKeyTile <= p.seq_k;
    };

    const DocumentLimits<BS> limits(p, batch);
    KeyTileSource<BS, kThreads, Config::kListCapacity> source{query_block, query_first + Config::kRows - 1, bh,
                                                               limits.key_limit(query_first)};

    auto issue = [&](const KeyTile& tile, int buffer) {
        T* key_tile = key_tiles + buffer * Config::kKeyTileElements;
        T* value_tile = value_tiles + buffer * Config::kKeyTileElements;
        if (by_tma(tile)) {
            tma.template copy_pair<D>(buffer, p.k_map, key_tile, p.v_map, value_tile, kv_head, batch * p.seq_k + tile.first);
        } else if (tile.gathered) {
            if (limits.doc_start != nullptr && threadIdx.x < kKeyTile)
                gathered_keys[buffer * kKeyTile + threadIdx.x] =
                    threadIdx.x < tile.count ? key_list[tile.first + threadIdx.x] : INT_MAX;
            load_rows_async<Arch, kKeyTile, D, kThreads, true>(key_tile, value_tile, k, v, [&](int row) -> long long {
                return row < tile.count ? static_cast<long long>(key_list[tile.first + row]) * static_cast<long long>(kv_stride) : -1;
            });
        } else {
            const size_t first = static_cast<size_t>(tile.first) * kv_stride;
            load_consecutive_rows_async<Arch, kKeyTile, D, kThreads, true>(key_tile, value_tile, k + first, v + first,
                                                                         kv_stride, p.seq_k - tile.first);
        }
    };

    const float scale_log2 = exponent_scale(p.scale);
    const Logits logits(p.scale, p.softcap);
    float acc[MA][D / 8][4];  // forward: unnormalised out; backward: dQ / scale
    zero_fill(acc);
    const size_t lse_row = static_cast<size_t>(bh) * p.seq_q;  // this head's row of lse and delta
    using Softmax = std::conditional_t<kBackward, SavedSoftmax<MA>, OnlineSoftmax<MA>>;
    Softmax softmax = [&] {
        if constexpr (kBackward) {
            return Softmax(scale_log2, p.lse_in + lse_row, p.delta + lse_row, query_first, row0, Arch::kSliceStride,
                           p.seq_q);
        } else {
            return Softmax(scale_log2);
        }
    }();
    const KeyTileMask<Arch, MA> mask(query_first, row0, p.seq_q, p.seq_k,
                                     min(query_first + Config::kRows, p.seq_q) - 1, limits);

    auto compute = [&](const KeyTile& tile, int buffer) {
        const T* key_tile = key_tiles + buffer * Config::kKeyTileElements;
        const T* value_tile = value_tiles + buffer * Config::kKeyTileElements;
        if (by_tma(tile)) tma.wait(buffer);
        float s[MA][8][4];
        float dp[kBackward ? MA : 1][8][4];  // backward: dP = dO V^T, in the same batch as S
        if constexpr (kBackward) {
            Arch::template scores_pair<MA, D>(s, q_tile, key_tile, dp, dout_tile, value_tile, row0);
        } else {
            Arch::template scores<MA, D>(s, q_tile, row0, key_tile);
        }
        finish_tile<Arch, MA, D, kBackward>(s, dp, acc, softmax, mask, tile, gathered_keys + buffer * kKeyTile, logits,
                                            key_tile, value_tile);
    };

    run_pipeline<KeyTile, Arch::kAsyncProxy, Config::kStages>(
        [&](KeyTile& tile) { return source.next(tile, p, bits, key_list, warp_counts); }, issue, compute);

    store_query_outputs<Arch, T, MA, D, kBackward>(p, acc, softmax, query_first, row0, q_head, lse_row);
}

// Launches the query-side kernel for one (tensor-core path, dtype, head dim, block size).
template <typename Arch, typename T, int D, int BS, int MA, bool kBackward>
cudaError_t launch_query_kernel(const AttentionParams& p, cudaStream_t stream) {
    using Config = QueryKernelConfig<Arch, T, D, BS, MA, kBackward>;
    const int query_blocks = (p.seq_q + BS - 1) / BS;
    const int key_blocks = (p.seq_k + BS - 1) / BS;
    const int bit_words = (max(query_blocks, key_blocks) + 31) / 32;
    const size_t smem = Config::smem_bytes(bit_words);
    auto kernel = query_kernel<Arch, T, D, BS, MA, kBackward>;
    cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (status != cudaSuccess) return status;
    const dim3 grid(query_blocks * Config::kSplits, p.heads, p.batch);
    kernel<<<grid, Config::kThreads, smem, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace mtr
