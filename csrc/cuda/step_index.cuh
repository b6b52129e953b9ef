// Index work on the GPU: from the compact per-head lists (slash block diagonals, vertical key
// tokens) to what one call (one ring step: query rank r, key rank s, W ranks) reads.
//
//  * build_step_index (index.cu) keeps, per (batch, head), the diagonals d with
//    (d - (r - s)) % W == 0 as local block offsets o = (d - (r - s)) / W (query block i reads key
//    block i - o), and the vertical tokens of rank s as local key indices: O(|slash| + |vertical|).
//  * Each CTA turns its offsets into a bitmap in shared memory and walks the lists itself:
//    KeyTileSource yields the key tiles of one query block (forward, dQ), and the dK/dV kernels
//    walk the transposed direction (key_kernel.cuh). No per-row list is ever materialised.
#pragma once

#include <stdint.h>

#include "warp_mma.cuh"

namespace mtr {

constexpr int kKeyTile = 64;   // keys per tile in every kernel
constexpr int kQueryStep = 64;  // queries per step of the key-side kernels
constexpr int kSkip = -1;      // classify(): drop this value
constexpr int kStop = -2;      // classify(): this value and every later one are past the end

// The barrier among the threads that walk a list together: the whole CTA (CtaBarrier), or the
// producer warpgroup of a warp-specialised kernel (ProducerBarrier, named barrier 1, threads 0-127).
struct CtaBarrier {
    static __device__ __forceinline__ void sync() { __syncthreads(); }
    static __device__ __forceinline__ bool sync_or(bool value) { return __syncthreads_or(value); }
};

struct ProducerBarrier {
    static constexpr int kId = 1;
    static constexpr int kThreads = 128;
    static __device__ __forceinline__ void sync() {
        asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
    }
    static __device__ __forceinline__ bool sync_or(bool value) {
        int any;
        asm volatile(
            "{\n .reg .pred p, q;\n setp.ne.b32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.b32 %0, 1, 0, q;\n}\n"
            : "=r"(any)
            : "r"(static_cast<int>(value)), "n"(kId), "n"(kThreads)
            : "memory");
        return any != 0;
    }
};

// Order-preserving stream compaction of src[cursor..n) by the kThreads threads of a Barrier
// (threads 0..kThreads-1): appends classify(value) for the kept values to out, until fewer than
// kThreads free slots remain in `capacity` or classify says kStop (done = true). Returns how many
// were appended. Deterministic: the output order is the input order. Every thread must call it
// with the same arguments.
template <int kThreads, typename Barrier = CtaBarrier, typename Classify>
__device__ __forceinline__ int compact_in_order(const int* src, int n, int& cursor, int* out, int capacity,
                                                int* warp_counts, bool& done, Classify classify) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    int count = 0;
    done = false;
    while (count + kThreads <= capacity) {
        const int index = cursor + threadIdx.x;
        const int value = index < n ? classify(src[index]) : kStop;
        const bool keep = value >= 0;
        const unsigned ballot = __ballot_sync(0xffffffffu, keep);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        Barrier::sync();
        int base = count;
        int total = 0;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) {
            const int c = warp_counts[w];
            base += w < warp ? c : 0;
            total += c;
        }
        if (keep) out[base + __popc(ballot & ((1u << lane) - 1u))] = value;
        count += total;
        cursor += kThreads;
        // Also the barrier that lets the next round overwrite warp_counts.
        if (Barrier::sync_or(value == kStop)) {
            done = true;
            break;
        }
    }
    return count;
}

// Bit o of `bits` is set iff local block offset o is in this head's list.
template <int kThreads>
__device__ __forceinline__ void build_offset_bits(uint32_t* bits, int words, const int* offsets, int count) {
    for (int w = threadIdx.x; w < words; w += kThreads) bits[w] = 0u;
    __syncthreads();
    for (int e = threadIdx.x; e < count; e += kThreads) {
        const int o = offsets[e];
        if (o < words * 32) atomicOr(&bits[o >> 5], 1u << (o & 31));  // order-free: bit sets commute
    }
    __syncthreads();
}

__device__ __forceinline__ bool has_offset(const uint32_t* bits, int o) { return (bits[o >> 5] >> (o & 31)) & 1u; }

// Whether the queries of local block `query_block` read vertical key tokens of local key block
// `key_block` as gathered columns: the key block lies strictly before the query block globally
// (g > c) and no slash diagonal already reads it (g - c not in slash, i.e. offset not in bits).
__device__ __forceinline__ bool reads_as_column(int query_block, int key_block, bool query_rank_after,
                                                const uint32_t* bits) {
    const bool earlier = key_block < query_block || (key_block == query_block && query_rank_after);
    return earlier && !has_offset(bits, query_block - key_block);
}

// One key tile of a query block: 64 contiguous keys from `first` (a slash block, or half of one),
// or `count` gathered vertical keys at key_list[first..first+count).
struct KeyTile {
    int first;
    int count;
    bool gathered;
    bool causal;  // the diagonal block of the same rank: token-causal mask
};

// Yields, in a fixed order, the key tiles one query block reads: its slash blocks (ascending
// offset), then its vertical columns gathered 64 at a time into key_list (compacted in windows of
// up to kListCapacity). next() must be called by every thread of the Barrier (the CTA, or a
// producer warpgroup) with the same state. Only the cursor lives in registers; the lists and
// sizes are read from the params each call.
template <int BS, int kThreads, int kListCapacity, typename Barrier = CtaBarrier>
struct KeyTileSource {
    int query_block;
    int last_query;  // the CTA's last query row (local): later diagonal keys are all masked
    int bh;
    int min_key;     // document masking: the CTA's lowest first visible key (0: none); earlier keys are skipped

    int offset_index = 0;
    int sub_tile = 0;
    int key_block = 0;
    bool causal = false;
    bool in_slash = true;
    int key_cursor = 0;
    int list_count = 0;
    int list_position = 0;
    bool keys_done = false;

    __device__ __forceinline__ bool next(KeyTile& tile, const AttentionParams& p, const uint32_t* bits, int* key_list,
                                         int* warp_counts) {
        while (in_slash) {
            if (sub_tile == 0) {
                if (offset_index >= p.num_offsets[bh]) {
                    in_slash = false;
                    break;
                }
                const int o = p.local_offsets[static_cast<size_t>(bh) * p.slash_len + offset_index];
                key_block = query_block - o;
                // offsets ascend, so every later block is negative too, or before min_key too
                if (key_block < 0 || (key_block + 1) * BS <= min_key) {
                    in_slash = false;
                    break;
                }
                causal = p.q_rank == p.k_rank && o == 0;
            }
            const int first = key_block * BS + sub_tile * kKeyTile;
            if (++sub_tile == BS / kKeyTile) {
                sub_tile = 0;
                ++offset_index;
            }
            if (first >= p.seq_k || (causal && first > last_query) || min(first + kKeyTile, p.seq_k) <= min_key)
                continue;  // nothing visible in the tile
            tile = KeyTile{first, kKeyTile, false, causal};
            return true;
        }
        if (list_position >= list_count) {
            if (keys_done) return false;
            const int block = query_block;
            const bool after = p.q_rank > p.k_rank;
            const int lowest = min_key;
            list_count = compact_in_order<kThreads, Barrier>(
                p.local_keys + static_cast<size_t>(bh) * p.vertical_len, p.num_keys[bh], key_cursor, key_list,
                kListCapacity, warp_counts, keys_done, [=](int key) {
                    const int kb = key / BS;
                    if (kb > block) return kStop;  // keys ascend
                    return key >= lowest && reads_as_column(block, kb, after, bits) ? key : kSkip;
                });
            list_position = 0;
            if (list_count == 0) return false;  // empty windows only end with keys_done
        }
        tile = KeyTile{list_position, min(kKeyTile, list_count - list_position), true, false};
        list_position += kKeyTile;
        return true;
    }
};

// 64 queries of one head and query block: one step of the key-side kernels.
struct QueryStep {
    int head;
    int first;
    int block;
    bool causal;
};

}  // namespace mtr
