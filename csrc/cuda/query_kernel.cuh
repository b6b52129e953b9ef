// The query-side kernel: one CTA per (query block, head, batch) walks the key tiles its block reads
// (KeyTileSource) with a two-stage pipeline (cp.async; TMA for contiguous key tiles on the wgmma
// path). kBackward = false is the forward (online softmax, out + lse); kBackward = true computes
// dQ from the saved lse and delta. Arch is the tensor-core path: WarpMma (mma.sync) or
// WarpgroupMma (wgmma, sm_90a).
#pragma once

#include <math.h>

#include "step_index.cuh"
#include "warpgroup_mma.cuh"

namespace mtr {

template <typename Arch, typename T, int D, int BS, int MA, bool kBackward>
struct QueryKernelConfig {
    static constexpr int kRows = Arch::template kCtaRows<BS, MA>;  // query rows per CTA: all or part of a block
    static constexpr int kSplits = BS / kRows;                   // CTAs per query block
    static constexpr int kWarps = kRows / (16 * MA);
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kListCapacity = 2048;
    static constexpr int kKeyTileElements = kKeyTile * D;
    static constexpr int kQueryTiles = kBackward ? 2 : 1;  // Q (and dO)
    static_assert(BS % kRows == 0 && kRows % (16 * MA) == 0 && BS % kKeyTile == 0,
                  "block size must split into CTAs, warps and key tiles");

    static size_t smem_bytes(int bit_words) {
        return Arch::kTileAlignment + sizeof(T) * (static_cast<size_t>(kQueryTiles) * kRows * D + 4 * kKeyTileElements) +
               sizeof(uint64_t) * 2 + sizeof(int) * (kListCapacity + 32) + sizeof(uint32_t) * bit_words;
    }
};

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
    T* value_tiles = key_tiles + 2 * Config::kKeyTileElements;
    uint64_t* tile_barriers = reinterpret_cast<uint64_t*>(value_tiles + 2 * Config::kKeyTileElements);
    int* key_list = reinterpret_cast<int*>(tile_barriers + 2);
    int* warp_counts = key_list + Config::kListCapacity;
    uint32_t* bits = reinterpret_cast<uint32_t*>(warp_counts + 32);

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

    KeyTileSource<BS, kThreads, Config::kListCapacity> source{query_block, query_first + Config::kRows - 1, bh};

    auto issue = [&](const KeyTile& tile, int buffer) {
        T* key_tile = key_tiles + buffer * Config::kKeyTileElements;
        T* value_tile = value_tiles + buffer * Config::kKeyTileElements;
        if (by_tma(tile)) {
            tma.template copy_pair<D>(buffer, p.k_map, key_tile, p.v_map, value_tile, kv_head, batch * p.seq_k + tile.first);
        } else if (tile.gathered) {
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
    float acc[MA][D / 8][4];  // forward: unnormalised out; backward: dQ / scale
    zero_fill(acc);
    // Per owned row (ma, half): forward running max (unscaled score) and partial sum; backward lse
    // (log2 units, +inf for rows without keys so that P = 0) and delta.
    float row_a[MA][2];
    float row_b[MA][2];
#pragma unroll
    for (int ma = 0; ma < MA; ++ma)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            if constexpr (kBackward) {
                const int t = query_first + row0 + ma * Arch::kSliceStride + fragment_row(2 * half);
                const float lse = t < p.seq_q ? p.lse_in[static_cast<size_t>(bh) * p.seq_q + t] : -INFINITY;
                row_a[ma][half] = lse == -INFINITY ? INFINITY : lse * kLog2e;
                row_b[ma][half] = t < p.seq_q ? p.delta[static_cast<size_t>(bh) * p.seq_q + t] : 0.f;
            } else {
                row_a[ma][half] = -INFINITY;
                row_b[ma][half] = 0.f;
            }
        }

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
        orient_scores(s, p.scale < 0.f);
        // Only diagonal, partial-last and partly filled gathered tiles need a mask. Scores stay
        // unscaled (orient_scores): |scale| is folded into the exponent.
        const bool masked = tile.gathered ? tile.count < kKeyTile : (tile.causal || tile.first + kKeyTile > p.seq_k);
        if (masked) {
            // Column col of a row is visible iff col < limit: the gathered count, or the keys left in
            // the sequence and, on the diagonal, col <= query - first. One compare per element, no
            // branches (col - fragment_col(0, 0) is a compile-time constant).
            const int tile_limit = tile.gathered ? tile.count : min(kKeyTile, p.seq_k - tile.first);
#pragma unroll
            for (int ma = 0; ma < MA; ++ma)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int query = query_first + row0 + ma * Arch::kSliceStride + fragment_row(2 * half);
                    const int limit = (tile.causal ? min(tile_limit, query - tile.first + 1) : tile_limit) -
                                      fragment_col(0, 0);
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                        for (int odd = 0; odd < 2; ++odd)
                            if (nt * 8 + odd >= limit) s[ma][nt][2 * half + odd] = -INFINITY;
                }
        }
        if constexpr (!kBackward) {
            // Both rows a thread owns (half = 0, 1) go through each step together: independent
            // instructions interleave, and one vote decides the rescale of both.
#pragma unroll
            for (int ma = 0; ma < MA; ++ma) {
                float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) tile_max[c >> 1] = fmaxf(tile_max[c >> 1], s[ma][nt][c]);
                float reference[2], rescale[2];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
                    tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
                    const float new_max = fmaxf(row_a[ma][half], tile_max[half]);  // unscaled
                    reference[half] = new_max == -INFINITY ? 0.f : new_max * scale_log2;  // no -inf - -inf
                    rescale[half] = exp2f(row_a[ma][half] * scale_log2 - reference[half]);
                    row_a[ma][half] = new_max;
                }
                float tile_sum[2] = {0.f, 0.f};
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const float prob = exp2f(fmaf(s[ma][nt][c], scale_log2, -reference[c >> 1]));
                        s[ma][nt][c] = prob;
                        tile_sum[c >> 1] += prob;
                    }
#pragma unroll
                for (int half = 0; half < 2; ++half) row_b[ma][half] = row_b[ma][half] * rescale[half] + tile_sum[half];
                if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {  // most tiles change no row max
#pragma unroll
                    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[ma][nt][c] *= rescale[c >> 1];
                }
            }
            Arch::template accumulate<MA, D>(acc, s, value_tile);
        } else {
#pragma unroll
            for (int ma = 0; ma < MA; ++ma)
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int half = c >> 1;
                        const float prob = exp2f(fmaf(s[ma][nt][c], scale_log2, -row_a[ma][half]));
                        s[ma][nt][c] = prob * (dp[ma][nt][c] - row_b[ma][half]);  // dS / scale
                    }
            Arch::template accumulate<MA, D>(acc, s, key_tile);
        }
    };

    run_two_stage_pipeline<KeyTile, Arch::kAsyncProxy>(
        [&](KeyTile& tile) { return source.next(tile, p, bits, key_list, warp_counts); }, issue, compute);

    auto query_out_row = [&](float* base, int row) -> float* {
        return row < query_rows ? base + q_head + static_cast<size_t>(query_first + row) * q_stride : nullptr;
    };
    if constexpr (!kBackward) {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float sum = row_b[ma][half];
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                const float inverse = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
                for (int nt = 0; nt < D / 8; ++nt) {
                    acc[ma][nt][2 * half] *= inverse;
                    acc[ma][nt][2 * half + 1] *= inverse;
                }
                const int t = query_first + row0 + ma * Arch::kSliceStride + fragment_row(2 * half);
                if ((threadIdx.x & 3) == 0 && t < p.seq_q)
                    p.lse[static_cast<size_t>(bh) * p.seq_q + t] =
                        sum > 0.f ? row_a[ma][half] * fabsf(p.scale) + logf(sum) : -INFINITY;
            }
        store_rows<MA, D>(acc, row0, Arch::kSliceStride, 1.f, [&](int row) { return query_out_row(p.out, row); });
    } else {
        store_rows<MA, D>(acc, row0, Arch::kSliceStride, p.scale, [&](int row) { return query_out_row(p.dq, row); });
    }
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
