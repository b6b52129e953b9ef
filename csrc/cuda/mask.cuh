// Masks of one tile's scores: entries a row may not see get score -inf (so P = 0). Only diagonal,
// partial and partly filled tiles need one; the common tile skips it (a uniform branch).
//
// Each thread holds its rows' scores in the mma.sync fragment layout (warp_mma.cuh): column
// nt * 8 + odd + fragment_col(0, 0) of row fragment_row(2 * half). A mask compares each column
// with per-row bounds, one compare per element and no branches (col - fragment_col(0, 0) is a
// compile-time constant).
//
// Document masking adds a lower limit per query: the first local key it may see (DocumentLimits).
// doc_start is a packing (nondecreasing), so the limits never decrease along the queries: a run
// of queries has its lowest limit at its first query and its highest at its last, which decide
// the tiles skipped whole (sources) and the tiles masked per row (here).
#pragma once

#include <limits.h>
#include <math.h>

#include "step_index.cuh"

namespace mtr {

template <int BS>
struct DocumentLimits {
    const int* doc_start;  // this batch's row [seq_q * world] (global positions), or nullptr: no masking
    int world, q_rank, k_rank;
    int tokens;  // seq_q * world: the row's length

    __device__ __forceinline__ DocumentLimits(const AttentionParams& p, int batch)
        : doc_start(p.doc_start == nullptr ? nullptr : p.doc_start + static_cast<size_t>(batch) * p.seq_q * p.world),
          world(p.world), q_rank(p.q_rank), k_rank(p.k_rank), tokens(p.seq_q * p.world) {}

    // First local key of the call's key rank that local query `query` may see (0 without masking).
    __device__ __forceinline__ int key_limit(int query) const {
        if (doc_start == nullptr) return 0;
        const int start = doc_start[query_global(query)];
        return mtraining::stripe_first_local_at(start, BS, world, k_rank);
    }

    __device__ __forceinline__ int query_global(int query) const {
        return mtraining::stripe_global_token(query, BS, world, q_rank);
    }
    __device__ __forceinline__ int key_global(int key) const {
        return mtraining::stripe_global_token(key, BS, world, k_rank);
    }

    // First local query whose document starts after local key `key` (INT_MAX: none, or no
    // masking): key_limit(query) > key iff query >= query_end_after(key). The key side computes it
    // once per CTA instead of loading limits per step. A packing makes {t : doc_start[t] > key's
    // global position} a suffix of the row: a binary search, alike in every thread (broadcast loads;
    // a CTA-wide search measured more registers and spills in the step loop).
    __device__ __forceinline__ int query_end_after(int key) const {
        if (doc_start == nullptr) return INT_MAX;
        const int end = static_cast<int>(mtraining::sorted_lower_bound(doc_start, tokens, key_global(key) + 1));
        return end == tokens ? INT_MAX : mtraining::stripe_first_local_at(end, BS, world, q_rank);
    }
};

// Number of keys < value in an ascending list of kKeyTile keys (padded with INT_MAX).
__device__ __forceinline__ int count_below(const int* keys, int value) {
    int count = 0;
#pragma unroll
    for (int step = kKeyTile / 2; step > 0; step >>= 1)
        if (keys[count + step - 1] < value) count += step;
    return count + (keys[count] < value);
}

// Query side (forward, dQ): key tiles against the CTA's query rows. Column col of a row is
// visible iff low <= col < limit: limit is the gathered count, or the keys left in the sequence
// and, on the diagonal, col <= query - tile.first; low is 0, or with document masking the tile's
// keys before the row's first visible key.
template <typename Arch, int MA>
struct KeyTileMask {
    int query_first;  // the CTA's first query row (local)
    int row0;         // this warp's first row in the CTA
    int seq_k;
    int row_key_limit[MA][2];  // document masking: the first key each of this thread's rows sees
    int max_key_limit;         // the CTA's highest such key (its last row's); 0 without masking

    template <int BS>
    __device__ __forceinline__ KeyTileMask(int query_first_, int row0_, int seq_q, int seq_k_, int last_query,
                                           const DocumentLimits<BS>& limits)
        : query_first(query_first_), row0(row0_), seq_k(seq_k_), max_key_limit(limits.key_limit(last_query)) {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int query = query_first + row0 + ma * Arch::kSliceStride + fragment_row(2 * half);
                row_key_limit[ma][half] = query < seq_q ? limits.key_limit(query) : 0;
            }
    }

    // gathered_keys: a gathered tile's keys, padded with INT_MAX (read only with document masking).
    __device__ __forceinline__ void apply(float (&s)[MA][8][4], const KeyTile& tile, const int* gathered_keys) const {
        // some row's document starts after the tile's first key (uniform)
        const bool lower = max_key_limit > 0 && (tile.gathered ? gathered_keys[0] : tile.first) < max_key_limit;
        const bool masked =
            lower || (tile.gathered ? tile.count < kKeyTile : (tile.causal || tile.first + kKeyTile > seq_k));
        if (!masked) return;
        const int tile_limit = tile.gathered ? tile.count : min(kKeyTile, seq_k - tile.first);
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int query = query_first + row0 + ma * Arch::kSliceStride + fragment_row(2 * half);
                const int limit =
                    (tile.causal ? min(tile_limit, query - tile.first + 1) : tile_limit) - fragment_col(0, 0);
                const int key_limit = row_key_limit[ma][half];
                const int low = (!lower         ? 0
                                 : tile.gathered ? count_below(gathered_keys, key_limit)
                                                 : key_limit - tile.first) -
                                fragment_col(0, 0);
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int odd = 0; odd < 2; ++odd) {
                        const int col = nt * 8 + odd;
                        if (col < low || col >= limit) s[ma][nt][2 * half + odd] = -INFINITY;
                    }
            }
    }
};

// Key side (dK/dV): query steps against the CTA's key rows (S^T: rows are keys, columns
// queries). Query column col of a key row is visible iff low <= col < high: high is the queries
// left in the sequence (0 for a vertical key row that does not read the step's block), low the
// row's own key on the diagonal; with document masking also iff the row's key is at or after
// the column's document start.
template <int BS, bool kVertical>
struct QueryStepMask {
    bool row_reads[2] = {true, true};  // vertical pass: does each of this thread's key rows read step.block?
    int row_key[2];                    // the global position of each of this thread's key rows

    // Read before the step's scores are computed (the rows' keys are in shared memory).
    __device__ __forceinline__ QueryStepMask(const QueryStep& step, int row0, int key_first, int key_count,
                                             const int* tile_keys, bool query_rank_after, const uint32_t* bits,
                                             const DocumentLimits<BS>& limits) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + fragment_row(2 * half);
            if constexpr (kVertical) {
                row_key[half] = limits.key_global(row < key_count ? tile_keys[row] : 0);
                row_reads[half] = row < key_count &&
                                  reads_as_column(step.block, tile_keys[row] / BS, query_rank_after, bits);
            } else {
                row_key[half] = limits.key_global(key_first + row);
            }
        }
    }

    // step_starts: the document start (global) of each of the step's queries (0 past the
    // sequence), in shared memory, on a step where some query's document starts after the CTA's
    // first key; nullptr on any other step (every row then sees all of the step's documents).
    __device__ __forceinline__ void apply(float (&s)[1][8][4], const QueryStep& step, int key_first, int row0,
                                          int seq_q, const int* step_starts) const {
        const bool lower = step_starts != nullptr;  // uniform
        if (!(kVertical || step.causal || step.first + kQueryStep > seq_q || lower)) return;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int high = (row_reads[half] ? seq_q - step.first : 0) - fragment_col(0, 0);
            const int low = (!kVertical && step.causal ? key_first + row0 + fragment_row(2 * half) - step.first : 0) -
                            fragment_col(0, 0);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int odd = 0; odd < 2; ++odd) {
                    const int col = nt * 8 + odd;
                    const bool before_document = lower && row_key[half] < step_starts[col + fragment_col(0, 0)];
                    if (col < low || col >= high || before_document) s[0][nt][2 * half + odd] = -INFINITY;
                }
        }
    }
};

}  // namespace mtr
