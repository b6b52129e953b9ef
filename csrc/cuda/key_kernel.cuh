// The key-side backward kernels: dK and dV without atomics, each key row written by one CTA.
//
//  * Slash pass: one CTA per (local key block or its part, kv head, batch) keeps its K/V rows resident and
//    loops over the query heads of its GQA group and, per head, over the query blocks that read
//    the block through a slash offset (i = j + o), 64 queries at a time.
//  * Vertical pass (runs first): one CTA per (64 consecutive vertical keys of one query head,
//    chunk of kVerticalChunkBlocks query blocks) gathers their K/V and loops over the chunk's
//    query blocks that read them as columns; it writes partial dK/dV per chunk to scratch.
//    Chunking bounds the longest CTA (sink columns are read by every query block).
//  * The slash pass adds the scratch rows of its block's vertical keys head by head and chunk by
//    chunk (a fixed order), after its own rows are written: deterministic, no atomics.
//  * Above head_dim 128 each CTA of either pass owns one column part of dK/dV
//    (kColumns wide) and recomputes S and dP in full: dK and dV over all 256 columns would need
//    256 accumulator registers per thread. The parts are neighbouring CTAs (blockIdx.x % kParts).
#pragma once

#include <math.h>

#include "epilogue.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "step_index.cuh"
#include "warpgroup_mma.cuh"

namespace mtr {

template <typename Arch, typename T, int D, int BS, bool kVertical>
struct KeyKernelConfig {
    static constexpr int kKeyRows = kVertical ? kKeyTile : Arch::template kCtaRows<BS, 1, D>;  // key rows per CTA
    static constexpr int kStages = Arch::template kStages<D>;  // q/dout step buffers
    static constexpr int kSplits = BS / kKeyRows;  // slash pass: CTAs per key block
    static constexpr int kWarps = kKeyRows / 16;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kStepElements = kQueryStep * D;
    static constexpr int kColumns = D > kMaxNarrowHeadDim ? kMaxNarrowHeadDim : D;  // dK/dV columns per CTA
    static constexpr int kParts = D / kColumns;         // CTAs per key row range
    static_assert(kThreads >= kQueryStep && kThreads >= kKeyTile, "too few threads for the per-step loads");

    static size_t smem_bytes(int bit_words) {
        return Arch::kTileAlignment + sizeof(T) * (2 * static_cast<size_t>(kKeyRows) * D + 2 * kStages * kStepElements) +
               sizeof(float) * 2 * kStages * kQueryStep + sizeof(uint64_t) * 2 + sizeof(int) * (kKeyTile + kStages * kQueryStep) +
               sizeof(uint32_t) * bit_words;
    }
};

// Slash pass: the query blocks that read local key block `key_block`, head after head of the group.
template <int BS>
struct SlashStepSource {
    const int* offsets;      // [heads][stride] of this batch
    const int* num_offsets;  // [heads] of this batch
    int stride;
    int first_head;
    int group;
    int key_block;
    int key_first;  // the CTA's first key row (local): earlier diagonal queries are all masked
    int query_end;  // the first query whose document starts after the CTA's last key (query_end_after)
    int query_blocks;
    int seq_q;
    bool same_rank;

    int head_index = 0;
    int offset_index = 0;
    int sub_step = 0;
    int query_block = 0;
    bool causal = false;

    __device__ __forceinline__ bool next(QueryStep& step) {
        while (head_index < group) {
            const int head = first_head + head_index;
            if (sub_step == 0) {
                const bool more = offset_index < num_offsets[head];
                const int o = more ? offsets[static_cast<size_t>(head) * stride + offset_index] : 0;
                query_block = key_block + o;
                if (!more || query_block >= query_blocks) {  // offsets ascend: this head is done
                    ++head_index;
                    offset_index = 0;
                    continue;
                }
                causal = same_rank && o == 0;
            }
            const int first = query_block * BS + sub_step * kQueryStep;
            if (++sub_step == BS / kQueryStep) {
                sub_step = 0;
                ++offset_index;
            }
            if (first >= seq_q || (causal && first + kQueryStep <= key_first)) continue;  // nothing visible
            if (first >= query_end) {  // so are the later queries' documents: this head is done
                ++head_index;
                offset_index = 0;
                sub_step = 0;
                continue;
            }
            step = QueryStep{head, first, query_block, causal};
            return true;
        }
        return false;
    }
};

// Vertical pass: every query block in [query_block, end_block) that reads at least one of the
// tile's keys as a column (a CTA-wide vote per block). end_block is clipped to the end of the
// tile's last key's document.
template <int BS>
struct VerticalStepSource {
    const int* tile_keys;  // shared memory, ascending
    int key_count;
    const uint32_t* bits;
    int head;
    int end_block;
    int seq_q;
    bool query_rank_after;
    int query_block;

    int sub_step = 0;

    __device__ __forceinline__ bool next(QueryStep& step) {
        while (true) {
            if (sub_step == 0) {
                if (query_block >= end_block) return false;
                const bool reads = threadIdx.x < key_count &&
                                   reads_as_column(query_block, tile_keys[threadIdx.x] / BS, query_rank_after, bits);
                if (!__syncthreads_or(reads)) {
                    ++query_block;
                    continue;
                }
            }
            const int first = query_block * BS + sub_step * kQueryStep;
            step = QueryStep{head, first, query_block, false};
            if (++sub_step == BS / kQueryStep) {
                sub_step = 0;
                ++query_block;
            }
            if (first >= seq_q) continue;
            return true;
        }
    }
};

template <typename Arch, typename T, int D, int BS, bool kVertical>
__global__ void __launch_bounds__(KeyKernelConfig<Arch, T, D, BS, kVertical>::kThreads)
    key_kernel(const __grid_constant__ AttentionParams p) {
    using Config = KeyKernelConfig<Arch, T, D, BS, kVertical>;
    constexpr int kThreads = Config::kThreads;
    constexpr int kKeyRows = Config::kKeyRows;
    constexpr int kColumns = Config::kColumns;
    const int part = blockIdx.x % Config::kParts;  // this CTA's dK/dV columns: part * kColumns ..
    const int cta = blockIdx.x / Config::kParts;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = align_shared<Arch::kTileAlignment>(smem_raw);
    T* key_tile = reinterpret_cast<T*>(smem);
    T* value_tile = key_tile + kKeyRows * D;
    T* query_tiles = value_tile + kKeyRows * D;
    T* dout_tiles = query_tiles + Config::kStages * Config::kStepElements;
    float* lse_tiles = reinterpret_cast<float*>(dout_tiles + Config::kStages * Config::kStepElements);
    float* delta_tiles = lse_tiles + Config::kStages * kQueryStep;
    uint64_t* step_barriers = reinterpret_cast<uint64_t*>(delta_tiles + Config::kStages * kQueryStep);
    int* tile_keys = reinterpret_cast<int*>(step_barriers + 2);
    int* step_start_tiles = tile_keys + kKeyTile;  // document masking: each step query's document start
    uint32_t* bits = reinterpret_cast<uint32_t*>(step_start_tiles + Config::kStages * kQueryStep);

    const int group = p.heads / p.kv_heads;
    const int query_blocks = (p.seq_q + BS - 1) / BS;
    const int bit_words = (max(query_blocks, (p.seq_k + BS - 1) / BS) + 31) / 32;
    const size_t q_stride = static_cast<size_t>(p.heads) * D;
    const size_t kv_stride = static_cast<size_t>(p.kv_heads) * D;
    const int row0 = Arch::template first_row<1>();  // this warp's 16 key rows
    TmaBuffers<2> tma{step_barriers};
    if (Arch::kTma && p.tma) tma.init();  // thread 0 also starts the first copies; the others wait after a barrier
    // Full 64-query steps are contiguous rows of q and dout: TMA copies them (wgmma path).
    auto by_tma = [&](const QueryStep& step) { return Arch::kTma && p.tma && step.first + kQueryStep <= p.seq_q; };

    int batch, kv_head, key_count, key_first = 0, first_entry = 0, bh_vertical = 0, chunk = 0;
    if constexpr (kVertical) {
        const int rows = p.batch * p.heads;
        const int chunks = vertical_chunks(query_blocks);
        chunk = cta % chunks;
        const int tile = cta / chunks / rows;
        bh_vertical = cta / chunks % rows;
        batch = bh_vertical / p.heads;
        kv_head = (bh_vertical % p.heads) / group;
        first_entry = tile * kKeyTile;
        const int num_keys = p.num_keys[bh_vertical];
        if (first_entry >= num_keys) return;  // uniform over the CTA
        key_count = min(kKeyTile, num_keys - first_entry);
        if (threadIdx.x < kKeyTile) {
            tile_keys[threadIdx.x] = threadIdx.x < key_count
                ? p.local_keys[static_cast<size_t>(bh_vertical) * p.vertical_len + first_entry + threadIdx.x] : 0;
        }
        __syncthreads();
    } else {
        batch = blockIdx.z;
        kv_head = blockIdx.y;
        key_first = cta / Config::kSplits * BS + cta % Config::kSplits * kKeyRows;
        key_count = min(kKeyRows, p.seq_k - key_first);
        if (key_count <= 0) return;  // the empty part of a partial last block (uniform)
    }
    const DocumentLimits<BS> limits(p, batch);
    // Document bounds of the walk, once per CTA so that no step waits on a doc_start load: the
    // walk ends at query_end; only steps reaching masked_from can hold queries that some key row
    // must not see (every earlier query's document starts at or before the CTA's first key).
    const int query_end =
        limits.query_end_after(kVertical ? tile_keys[key_count - 1] : key_first + key_count - 1);
    int first_block = 0, end_block = 0;  // vertical pass: the chunk's query blocks the walk may visit
    if constexpr (kVertical) {
        const int chunk_first = chunk * kVerticalChunkBlocks;
        first_block = max(chunk_first, tile_keys[0] / BS);
        end_block = min(chunk_first + kVerticalChunkBlocks, (min(query_end, p.seq_q) + BS - 1) / BS);
    }
    // A vertical CTA without query blocks only stores its zero partials (uniform).
    const bool idle = kVertical && first_block >= end_block;
    // K/V rows of this CTA's kv head, and the query rows of the batch (heads vary per step).
    const size_t kv_head_start = static_cast<size_t>(batch) * p.seq_k * kv_stride + kv_head * D;
    const size_t batch_start = static_cast<size_t>(batch) * p.seq_q * q_stride;
    if (!idle) {
        load_rows_async<Arch, kKeyRows, D, kThreads, true>(
            key_tile, value_tile, static_cast<const T*>(p.k) + kv_head_start, static_cast<const T*>(p.v) + kv_head_start,
            [&](int row) -> long long {
                if (row >= key_count) return -1;
                return static_cast<long long>(kVertical ? tile_keys[row] : key_first + row) * kv_stride;
            });
    }
    cp_async_commit();
    const int masked_from = idle ? INT_MAX : limits.query_end_after(kVertical ? tile_keys[0] : key_first);
    auto straddles = [&](const QueryStep& step) { return step.first + kQueryStep > masked_from; };

    auto issue = [&](const QueryStep& step, int buffer) {
        const size_t head_start = batch_start + step.head * D;
        const int query_rows = p.seq_q - step.first;
        const size_t first = head_start + static_cast<size_t>(step.first) * q_stride;
        T* query_tile = query_tiles + buffer * Config::kStepElements;
        T* dout_tile = dout_tiles + buffer * Config::kStepElements;
        if (by_tma(step)) {
            tma.template copy_pair<D>(buffer, p.q_map, query_tile, p.dout_map, dout_tile, step.head, batch * p.seq_q + step.first);
        } else {
            load_consecutive_rows_async<Arch, kQueryStep, D, kThreads, true>(
                query_tile, dout_tile, static_cast<const T*>(p.q) + first, static_cast<const T*>(p.dout) + first,
                q_stride, query_rows);
        }
        if (threadIdx.x < kQueryStep) {
            const size_t bh = static_cast<size_t>(batch) * p.heads + step.head;
            const bool valid = threadIdx.x < query_rows;
            const size_t at = bh * p.seq_q + (valid ? step.first + threadIdx.x : 0);
            cp_async_4(lse_tiles + buffer * kQueryStep + threadIdx.x, p.lse_in + at, valid);
            cp_async_4(delta_tiles + buffer * kQueryStep + threadIdx.x, p.delta + at, valid);
            if (straddles(step)) {
                const int query = valid ? step.first + threadIdx.x : 0;
                cp_async_4(step_start_tiles + buffer * kQueryStep + threadIdx.x,
                           limits.doc_start + limits.query_global(query), valid);
            }
        }
    };

    const bool query_rank_after = p.q_rank > p.k_rank;
    const TransposedSoftmax softmax{exponent_scale(p.scale)};
    const Logits logits(p.scale, p.softcap);
    float dk[1][kColumns / 8][4];
    float dv[1][kColumns / 8][4];
    const int part_offset = Arch::template chunk_step_offset<D>(part * kColumns / 8);  // of the part's columns in a tile
    zero_fill(dk);
    zero_fill(dv);

    auto compute = [&](const QueryStep& step, int buffer) {
        const T* query_tile = query_tiles + buffer * Config::kStepElements;
        const T* dout_tile = dout_tiles + buffer * Config::kStepElements;
        const float* lse = lse_tiles + buffer * kQueryStep;
        const float* delta = delta_tiles + buffer * kQueryStep;
        if (by_tma(step)) tma.wait(buffer);
        const QueryStepMask<BS, kVertical> mask(step, row0, key_first, key_count, tile_keys, query_rank_after, bits,
                                                limits);
        float s[1][8][4];
        float dp[1][8][4];
        // S^T = K Q^T and dP^T = V dO^T
        Arch::template scores_pair<1, D>(s, key_tile, query_tile, dp, value_tile, dout_tile, row0);
        logits.prepare(s);
        mask.apply(s, step, key_first, row0, p.seq_q, straddles(step) ? step_start_tiles + buffer * kQueryStep : nullptr);
        softmax.template dscores<Arch::kBranchPerTile>(s, dp, lse, delta, logits);
        // dV += P^T dO, dK += dS^T Q (this part's columns)
        Arch::template accumulate_pair<1, kColumns, D>(dv, s, dout_tile + part_offset, dk, dp, query_tile + part_offset);
    };

    if constexpr (kVertical) {
        if (!idle) {  // else no step: the partials are 0
            const int head = bh_vertical % p.heads;
            build_offset_bits<kThreads>(bits, bit_words,
                                        p.local_offsets + static_cast<size_t>(bh_vertical) * p.slash_len,
                                        p.num_offsets[bh_vertical]);
            VerticalStepSource<BS> source{tile_keys, key_count, bits, head, end_block, p.seq_q, query_rank_after, first_block};
            run_pipeline<QueryStep, Arch::kAsyncProxy, Config::kStages>([&](QueryStep& step) { return source.next(step); },
                                                                        issue, compute);
        }
        const size_t entry0 =
            (static_cast<size_t>(chunk) * p.batch * p.heads + bh_vertical) * p.vertical_len + first_entry;
        auto scratch_row = [&](float* base, int row) -> float* {
            return row < key_count ? base + (entry0 + row) * D + part * kColumns : nullptr;
        };
        store_rows<1, kColumns>(dk, row0, Arch::kSliceStride, p.scale, [&](int row) { return scratch_row(p.vertical_dk, row); });
        store_rows<1, kColumns>(dv, row0, Arch::kSliceStride, 1.f, [&](int row) { return scratch_row(p.vertical_dv, row); });
    } else {
        const size_t batch_heads = static_cast<size_t>(batch) * p.heads;
        SlashStepSource<BS> source{p.local_offsets + batch_heads * p.slash_len, p.num_offsets + batch_heads,
                                   p.slash_len, kv_head * group, group, key_first / BS, key_first,
                                   query_end, query_blocks, p.seq_q, p.q_rank == p.k_rank};
        run_pipeline<QueryStep, Arch::kAsyncProxy, Config::kStages>([&](QueryStep& step) { return source.next(step); },
                                                                    issue, compute);
        auto key_out_row = [&](float* base, int row) -> float* {
            return row < key_count
                ? base + ((static_cast<size_t>(batch) * p.seq_k + key_first + row) * p.kv_heads + kv_head) * D + part * kColumns
                : nullptr;
        };
        store_rows<1, kColumns>(dk, row0, Arch::kSliceStride, p.scale, [&](int row) { return key_out_row(p.dk, row); });
        store_rows<1, kColumns>(dv, row0, Arch::kSliceStride, 1.f, [&](int row) { return key_out_row(p.dv, row); });
        __syncthreads();  // this CTA's dk/dv rows are visible to all its threads from here
        add_vertical_partials<D, kColumns, kThreads>(p, batch, kv_head, group, key_first, key_count, query_blocks,
                                                     part * kColumns);
    }
}

template <typename Arch, typename T, int D, int BS, bool kVertical>
cudaError_t launch_key_kernel(const AttentionParams& p, cudaStream_t stream) {
    using Config = KeyKernelConfig<Arch, T, D, BS, kVertical>;
    const int query_blocks = (p.seq_q + BS - 1) / BS;
    const int key_blocks = (p.seq_k + BS - 1) / BS;
    const size_t smem = Config::smem_bytes((max(query_blocks, key_blocks) + 31) / 32);
    auto kernel = key_kernel<Arch, T, D, BS, kVertical>;
    cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (status != cudaSuccess) return status;
    dim3 grid;
    if (kVertical) {
        const long long ctas = static_cast<long long>((p.vertical_len + kKeyTile - 1) / kKeyTile) * p.batch * p.heads *
                               vertical_chunks(query_blocks);
        if (ctas == 0) return cudaSuccess;
        grid = dim3(static_cast<unsigned>(ctas * Config::kParts));
    } else {
        grid = dim3(key_blocks * Config::kSplits * Config::kParts, p.kv_heads, p.batch);
    }
    kernel<<<grid, Config::kThreads, smem, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace mtr
