// The warp-specialised query-side kernel (wgmma path, block 128): the forward and dQ of
// query_kernel.cuh, with the loads taken off the warpgroups that compute.
//
//   warpgroup 0 (producer, 80 registers): walks the key tiles (KeyTileSource, its compaction on
//       named barrier 1), copies each into the next of kStages buffers (TMA for contiguous tiles,
//       cp.async for gathered ones) and publishes the tile in the buffer's slot;
//   warpgroups 1, 2 (consumers, 208 registers): rows 0-63 and 64-127 of the query block; each
//       computes every tile against its own rows and hands the buffer back.
//
//   producer:  [wait empty s] [slot s, copies -> s] [arrive full s-1 once its cp.async landed] ...
//   consumers:                  [wait full s] [S, mask, softmax, P V] [arrive empty s] ...
//
// Each buffer has a "full" mbarrier (129 arrivals: thread 0 arms it, with the TMA bytes when TMA
// copies the tile, and every producer thread arrives once its own cp.async copies of the tile
// landed and were fenced for the tensor cores; the slot is written before those arrivals) and an
// "empty" one (one arrival per consumer thread once its warpgroup's wgmma read the buffer). A producer thread
// arrives one tile late (its cp.async groups finish in order), so the producer never waits for a
// copy it just issued. The end of the tiles is a slot with count kEndOfTiles.
//
// Against query_kernel (two CTAs of one warpgroup per SM, two buffers, CTA barriers around every
// tile) the consumers never wait at a CTA barrier nor issue loads, and four buffers (forward; three
// for dQ, whose Q and dO take more room) stay in flight. ptxas gives the producer 80 registers
// without spills (56 spilled its address arithmetic).
//
// (The consumers taking turns to issue their score products, "ping-pong", measured faster only
// without documents at 5%, and was removed: docs/CUDA_NOTES.md.)
// The arithmetic is query_kernel's, tile by tile and in the same order: results are bit-identical.
#pragma once

#include "query_kernel.cuh"

namespace mtr {

constexpr int kEndOfTiles = -1;  // KeyTile::count of the slot after the last tile

__device__ __forceinline__ void arrive(uint64_t& barrier) { cute::arrive_barrier(barrier); }

// A warpgroup's register budget (sm_90a; the kernel only runs there).
template <int kRegisters>
__device__ __forceinline__ void grow_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void shrink_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

template <typename T, int D, bool kBackward>
struct SpecializedQueryConfig {
    static constexpr int kConsumers = 2;
    static constexpr int kRows = 64 * kConsumers;  // a whole 128-block
    static constexpr int kProducerThreads = ProducerBarrier::kThreads;
    static constexpr int kThreads = kProducerThreads + 128 * kConsumers;
    static constexpr int kStages = kBackward ? 3 : 4;  // Q and dO take a buffer pair's room
    static constexpr int kListCapacity = 2048;
    static constexpr int kKeyTileElements = kKeyTile * D;
    static constexpr int kQueryTiles = kBackward ? 2 : 1;
    static constexpr int kProducerRegisters = 80;
    static constexpr int kConsumerRegisters = 208;
    static_assert(kProducerThreads * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <= 65536,
                  "register split over the SM's file");

    static size_t smem_bytes(int bit_words) {
        return WarpgroupMma::kTileAlignment +
               sizeof(T) * (static_cast<size_t>(kQueryTiles) * kRows * D + 2 * kStages * kKeyTileElements) +
               sizeof(uint64_t) * (2 * kStages + 1) + sizeof(KeyTile) * kStages +
               sizeof(int) * (kStages * kKeyTile + kListCapacity + 32) + sizeof(uint32_t) * bit_words;
    }
};

template <typename T, int D, bool kBackward>
__global__ void __launch_bounds__(SpecializedQueryConfig<T, D, kBackward>::kThreads, 1)
    specialized_query_kernel(const __grid_constant__ AttentionParams p) {
    using Config = SpecializedQueryConfig<T, D, kBackward>;
    using Arch = WarpgroupMma;
    constexpr int BS = 128;
    constexpr int kStages = Config::kStages;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = align_shared<Arch::kTileAlignment>(smem_raw);
    T* q_tile = reinterpret_cast<T*>(smem);
    T* dout_tile = q_tile + Config::kRows * D;  // backward only
    T* key_tiles = q_tile + Config::kQueryTiles * Config::kRows * D;
    T* value_tiles = key_tiles + kStages * Config::kKeyTileElements;
    uint64_t* full = reinterpret_cast<uint64_t*>(value_tiles + kStages * Config::kKeyTileElements);
    uint64_t* empty = full + kStages;
    uint64_t* query_loaded = empty + kStages;
    KeyTile* slots = reinterpret_cast<KeyTile*>(query_loaded + 1);
    int* gathered_keys = reinterpret_cast<int*>(slots + kStages);  // document masking: a slot's gathered keys
    int* key_list = gathered_keys + kStages * kKeyTile;
    int* warp_counts = key_list + Config::kListCapacity;
    uint32_t* bits = reinterpret_cast<uint32_t*>(warp_counts + 32);

    const int query_block = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // late blocks read the most
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (p.heads / p.kv_heads);
    const int bh = batch * p.heads + head;
    const int query_first = query_block * BS;
    const int query_rows = p.seq_q - query_first;
    const size_t q_stride = static_cast<size_t>(p.heads) * D;
    const size_t kv_stride = static_cast<size_t>(p.kv_heads) * D;
    const size_t q_head = static_cast<size_t>(batch) * p.seq_q * q_stride + head * D;
    const size_t kv_head_start = static_cast<size_t>(batch) * p.seq_k * kv_stride + kv_head * D;
    const DocumentLimits<BS> limits(p, batch);
    const int num_blocks = max((p.seq_q + BS - 1) / BS, (p.seq_k + BS - 1) / BS);

    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            cute::initialize_barrier(full[s], Config::kProducerThreads + 1);
            cute::initialize_barrier(empty[s], 128 * Config::kConsumers);
        }
        cute::initialize_barrier(*query_loaded, Config::kProducerThreads);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
    }
    build_offset_bits<Config::kThreads>(bits, (num_blocks + 31) / 32, p.local_offsets + static_cast<size_t>(bh) * p.slash_len,
                                        p.num_offsets[bh]);  // its barriers also publish the mbarriers

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        // ---------------------------------------------------------------- producer
        shrink_registers<Config::kProducerRegisters>();
        const T* q = static_cast<const T*>(p.q) + q_head;
        const T* dout = kBackward ? static_cast<const T*>(p.dout) + q_head : nullptr;
        const T* k = static_cast<const T*>(p.k) + kv_head_start;
        const T* v = static_cast<const T*>(p.v) + kv_head_start;
        constexpr int kThreads = Config::kProducerThreads;
        const size_t query_start = static_cast<size_t>(query_first) * q_stride;
        load_consecutive_rows_async<Arch, Config::kRows, D, kThreads, kBackward>(
            q_tile, dout_tile, q + query_start, kBackward ? dout + query_start : nullptr, q_stride, query_rows);
        cp_async_commit();
        TmaBuffers<kStages> tma{full};
        KeyTileSource<BS, kThreads, Config::kListCapacity, ProducerBarrier> source{
            query_block, query_first + Config::kRows - 1, bh, limits.key_limit(query_first)};
        uint64_t* landed = query_loaded;  // the barrier this thread's newest cp.async group completes
        int stage = 0;
        uint32_t phase = 0;
        bool more = true;
        while (more) {
            KeyTile tile{0, kEndOfTiles, false, false};
            more = source.next(tile, p, bits, key_list, warp_counts);
            if (!more) tile = KeyTile{0, kEndOfTiles, false, false};
            cute::wait_barrier(empty[stage], phase ^ 1u);
            const bool by_tma = more && p.tma && !tile.gathered && tile.first + kKeyTile <= p.seq_k;
            T* key_tile = key_tiles + stage * Config::kKeyTileElements;
            T* value_tile = value_tiles + stage * Config::kKeyTileElements;
            if (threadIdx.x == 0) slots[stage] = tile;
            if (by_tma) {
                tma.template copy_pair<D>(stage, p.k_map, key_tile, p.v_map, value_tile, kv_head, batch * p.seq_k + tile.first);
            } else {
                if (threadIdx.x == 0) arrive(full[stage]);
                if (more && tile.gathered) {
                    if (limits.doc_start != nullptr && threadIdx.x < kKeyTile)
                        gathered_keys[stage * kKeyTile + threadIdx.x] =
                            threadIdx.x < tile.count ? key_list[tile.first + threadIdx.x] : INT_MAX;
                    load_rows_async<Arch, kKeyTile, D, kThreads, true>(key_tile, value_tile, k, v, [&](int row) -> long long {
                        return row < tile.count ? static_cast<long long>(key_list[tile.first + row]) * static_cast<long long>(kv_stride) : -1;
                    });
                } else if (more) {
                    const size_t first = static_cast<size_t>(tile.first) * kv_stride;
                    load_consecutive_rows_async<Arch, kKeyTile, D, kThreads, true>(key_tile, value_tile, k + first, v + first,
                                                                                 kv_stride, p.seq_k - tile.first);
                }
            }
            cp_async_commit();
            cp_async_wait<1>();  // the previous tile's copies (or the query rows') landed
            fence_async_proxy();
            arrive(*landed);
            landed = &full[stage];
            if (++stage == kStages) stage = 0, phase ^= 1u;
        }
        cp_async_wait<0>();
        fence_async_proxy();
        arrive(*landed);
        return;
    }

    // -------------------------------------------------------------------- consumers
    grow_registers<Config::kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int row0 = consumer * 64 + (threadIdx.x / 32 % 4) * 16;  // this warp's 16 rows of the block
    const T* q_rows = q_tile + consumer * 64 * D;                  // the consumer's 64-row block of the tiles
    const T* dout_rows = dout_tile + consumer * 64 * D;

    const float scale_log2 = exponent_scale(p.scale);
    const Logits logits(p.scale, p.softcap);
    float acc[1][D / 8][4];  // forward: unnormalised out; backward: dQ / scale
    zero_fill(acc);
    const size_t lse_row = static_cast<size_t>(bh) * p.seq_q;
    using Softmax = std::conditional_t<kBackward, SavedSoftmax<1>, OnlineSoftmax<1>>;
    Softmax softmax = [&] {
        if constexpr (kBackward) {
            return Softmax(scale_log2, p.lse_in + lse_row, p.delta + lse_row, query_first, row0, Arch::kSliceStride,
                           p.seq_q);
        } else {
            return Softmax(scale_log2);
        }
    }();
    const KeyTileMask<Arch, 1> mask(query_first, row0, p.seq_q, p.seq_k, min(query_first + Config::kRows, p.seq_q) - 1,
                                    limits);

    cute::wait_barrier(*query_loaded, 0);
    int stage = 0;
    uint32_t phase = 0;
    auto next_tile = [&](int st, uint32_t ph) {  // the tile in buffer st, once it landed
        cute::wait_barrier(full[st], ph);
        return slots[st];
    };
    auto advance = [&](int& st, uint32_t& ph) {
        if (++st == kStages) st = 0, ph ^= 1u;
    };
    // Every consumer thread arrives (its own reads of the slot are then ordered before the
    // producer's next write to it, which compute-sanitizer's racecheck can follow).
    auto release = [&](int st) { arrive(empty[st]); };
    auto key_tile = [&](int st) -> const T* { return key_tiles + st * Config::kKeyTileElements; };
    auto value_tile = [&](int st) -> const T* { return value_tiles + st * Config::kKeyTileElements; };
    for (;;) {
        const KeyTile tile = next_tile(stage, phase);
        if (tile.count == kEndOfTiles) break;
        float s[1][8][4];
        float dp[1][8][4];  // backward: dP = dO V^T, in the same batch as S
        if constexpr (kBackward) {
            Arch::template start_scores_pair<1, D>(s, q_rows, key_tile(stage), dp, dout_rows, value_tile(stage));
        } else {
            Arch::template start_scores<1, D>(s, q_rows, key_tile(stage));
        }
        Arch::template finish<0>(s, dp);
        finish_tile<Arch, 1, D, kBackward>(s, dp, acc, softmax, mask, tile, gathered_keys + stage * kKeyTile, logits,
                                           key_tile(stage), value_tile(stage));
        release(stage);
        advance(stage, phase);
    }

    store_query_outputs<Arch, T, 1, D, kBackward>(p, acc, softmax, query_first, row0, q_head, lse_row);
}

template <typename T, int D, bool kBackward>
cudaError_t launch_specialized_query_kernel(const AttentionParams& p, cudaStream_t stream) {
    using Config = SpecializedQueryConfig<T, D, kBackward>;
    constexpr int BS = 128;
    const int query_blocks = (p.seq_q + BS - 1) / BS;
    const int key_blocks = (p.seq_k + BS - 1) / BS;
    const int bit_words = (max(query_blocks, key_blocks) + 31) / 32;
    const size_t smem = Config::smem_bytes(bit_words);
    auto kernel = specialized_query_kernel<T, D, kBackward>;
    cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (status != cudaSuccess) return status;
    const dim3 grid(query_blocks, p.heads, p.batch);
    kernel<<<grid, Config::kThreads, smem, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace mtr
