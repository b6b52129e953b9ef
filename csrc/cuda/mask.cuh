// Masks of one tile's scores: entries a row may not see get score -inf (so P = 0). Only diagonal,
// partial and partly filled tiles need one; the common tile skips it (a uniform branch).
//
// Each thread holds its rows' scores in the mma.sync fragment layout (warp_mma.cuh): column
// nt * 8 + odd + fragment_col(0, 0) of row fragment_row(2 * half). A mask compares each column
// with per-row bounds, one compare per element and no branches (col - fragment_col(0, 0) is a
// compile-time constant).
#pragma once

#include <math.h>

#include "step_index.cuh"

namespace mtr {

// Query side (forward, dQ): key tiles against the CTA's query rows. Column col of a row is
// visible iff col < limit: the gathered count, or the keys left in the sequence and, on the
// diagonal, col <= query - tile.first.
template <typename Arch, int MA>
struct KeyTileMask {
    int query_first;  // the CTA's first query row (local)
    int row0;         // this warp's first row in the CTA
    int seq_k;

    __device__ __forceinline__ void apply(float (&s)[MA][8][4], const KeyTile& tile) const {
        const bool masked = tile.gathered ? tile.count < kKeyTile : (tile.causal || tile.first + kKeyTile > seq_k);
        if (!masked) return;
        const int tile_limit = tile.gathered ? tile.count : min(kKeyTile, seq_k - tile.first);
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int query = query_first + row0 + ma * Arch::kSliceStride + fragment_row(2 * half);
                const int limit =
                    (tile.causal ? min(tile_limit, query - tile.first + 1) : tile_limit) - fragment_col(0, 0);
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int odd = 0; odd < 2; ++odd)
                        if (nt * 8 + odd >= limit) s[ma][nt][2 * half + odd] = -INFINITY;
            }
    }
};

// Key side (dK/dV): query steps against the CTA's key rows (S^T: rows are keys, columns
// queries). Query column col of a key row is visible iff low <= col < high: high is the queries
// left in the sequence (0 for a vertical key row that does not read the step's block), low the
// row's own key on the diagonal.
template <int BS, bool kVertical>
struct QueryStepMask {
    bool row_reads[2] = {true, true};  // vertical pass: does each of this thread's key rows read step.block?

    // Read before the step's scores are computed (the rows' keys are in shared memory).
    __device__ __forceinline__ QueryStepMask(const QueryStep& step, int row0, int key_count, const int* tile_keys,
                                             bool query_rank_after, const uint32_t* bits) {
        if constexpr (kVertical) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + fragment_row(2 * half);
                row_reads[half] = row < key_count &&
                                  reads_as_column(step.block, tile_keys[row] / BS, query_rank_after, bits);
            }
        }
    }

    __device__ __forceinline__ void apply(float (&s)[1][8][4], const QueryStep& step, int key_first, int row0,
                                          int seq_q) const {
        if (!(kVertical || step.causal || step.first + kQueryStep > seq_q)) return;
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
                    if (col < low || col >= high) s[0][nt][2 * half + odd] = -INFINITY;
                }
        }
    }
};

}  // namespace mtr
