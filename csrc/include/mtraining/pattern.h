// Derivation of a (query rank, key rank) pair's work from the compact vertical-slash lists.
//
// Plain integer arithmetic, included by the CPU kernel (csrc/cpu) and the CUDA code (csrc/cuda:
// build_step_index and, through params.h, the kernels). See docs/KERNEL_CONTRACT.md: per head the
// pattern is a sorted list of block diagonals (query block minus key block, always holding 0) and
// a sorted list of global key token columns. Under striping over `world` ranks, global block g
// lives on rank g % world as local block g / world.
#pragma once

#include <stdint.h>

// Host and device functions under nvcc, plain functions elsewhere.
#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif

namespace mtraining {

// The striping arithmetic, templated on the integer type: the CPU kernel computes in int64_t, the
// CUDA kernels in int (32-bit division is several times cheaper on the GPU).

// Local block distance (query minus key) that slash diagonal d reaches between a query rank and a
// key rank rank_gap = q_rank - k_rank apart, or -1 when d connects no blocks of the two ranks: the
// global distance is local_distance * world + rank_gap.
template <typename Int>
MT_HOST_DEVICE inline Int stripe_local_distance(Int d, Int rank_gap, Int world) {
    const Int shifted = d - rank_gap;
    return (shifted >= 0 && shifted % world == 0) ? shifted / world : Int(-1);
}

// Whether global key token `column` lives on `rank`.
template <typename Int>
MT_HOST_DEVICE inline bool stripe_column_on_rank(Int column, Int block, Int world, Int rank) {
    return (column / block) % world == rank;
}

// Local token, on its own rank, of global key token `column`.
template <typename Int>
MT_HOST_DEVICE inline Int stripe_local_token(Int column, Int block, Int world) {
    return column / block / world * block + column % block;
}

// Global position of local token `local` of `rank` (the inverse of stripe_local_token).
template <typename Int>
MT_HOST_DEVICE inline Int stripe_global_token(Int local, Int block, Int world, Int rank) {
    return (local / block * world + rank) * block + local % block;
}

// First local token of `rank` whose global position is >= `global` (past the rank's tokens when
// none): local tokens ascend with their global positions, so the keys a document start allows
// are a suffix of each rank's keys.
template <typename Int>
MT_HOST_DEVICE inline Int stripe_first_local_at(Int global, Int block, Int world, Int rank) {
    const Int global_block = global / block;
    if (global_block < rank) return 0;
    const Int gap = global_block - rank;
    return gap % world == 0 ? gap / world * block + global % block : (gap / world + 1) * block;
}

// Padding value of the slash and vertical lists (2^30), as in ds_mtraining/index.py.
constexpr int32_t kListPad = 1 << 30;

// Sizes of one call: the local queries of q_rank against the local keys of k_rank.
struct Geometry {
    int64_t block;     // tokens per block (the stripe width)
    int64_t world;     // ranks the sequence is striped over (1: single device)
    int64_t q_rank;    // rank whose queries these are
    int64_t k_rank;    // rank whose keys these are
    int64_t q_len;     // local query tokens
    int64_t k_len;     // local key tokens
    int64_t q_blocks;  // local query blocks (the last one may be partial when world == 1)
    int64_t k_blocks;  // local key blocks

    MT_HOST_DEVICE int64_t query_block_global(int64_t i) const { return i * world + q_rank; }
    MT_HOST_DEVICE int64_t key_block_global(int64_t j) const { return j * world + k_rank; }
    MT_HOST_DEVICE int64_t query_rows(int64_t i) const { return block_extent(q_len, i); }
    MT_HOST_DEVICE int64_t key_rows(int64_t j) const { return block_extent(k_len, j); }

    MT_HOST_DEVICE int64_t block_extent(int64_t len, int64_t b) const {
        const int64_t rest = len - b * block;
        return rest < block ? rest : block;
    }

    // Local block distance (query minus key) reached by slash diagonal d, or -1 when d does not
    // connect this rank pair: the global distance is (i - j) * world + q_rank - k_rank.
    MT_HOST_DEVICE int64_t local_distance(int64_t d) const {
        return stripe_local_distance(d, q_rank - k_rank, world);
    }

    // Local key block that query block i reads through diagonal d, or -1 when none.
    MT_HOST_DEVICE int64_t key_block_of(int64_t i, int64_t d) const {
        const int64_t distance = local_distance(d);
        if (distance < 0 || distance > i || i - distance >= k_blocks) return -1;
        return i - distance;
    }

    // Local query block that reads key block j through diagonal d, or -1 when none.
    MT_HOST_DEVICE int64_t query_block_of(int64_t j, int64_t d) const {
        const int64_t distance = local_distance(d);
        if (distance < 0 || j + distance >= q_blocks) return -1;
        return j + distance;
    }

    // Local token of a global key column that lives on k_rank.
    MT_HOST_DEVICE int64_t local_key_token(int64_t column) const {
        return stripe_local_token(column, block, world);
    }

    // Global position of local query token t.
    MT_HOST_DEVICE int64_t query_global_token(int64_t t) const {
        return stripe_global_token(t, block, world, q_rank);
    }

    // First local key token at or after global position `global` (k_len or more when none).
    MT_HOST_DEVICE int64_t first_key_at(int64_t global) const {
        return stripe_first_local_at(global, block, world, k_rank);
    }

    // Whether a global key column lives on k_rank.
    MT_HOST_DEVICE bool column_on_key_rank(int64_t column) const {
        return stripe_column_on_rank(column, block, world, k_rank);
    }

    // First local query block whose global block lies after global key block key_global.
    MT_HOST_DEVICE int64_t first_query_block_after(int64_t key_global) const {
        return key_global < q_rank ? 0 : (key_global - q_rank) / world + 1;
    }
};

// Index of the first entry >= value in an ascending list of n values.
MT_HOST_DEVICE inline int64_t sorted_lower_bound(const int32_t* list, int64_t n, int64_t value) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (list[mid] < value) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Whether an ascending list of n values holds value.
MT_HOST_DEVICE inline bool sorted_contains(const int32_t* list, int64_t n, int64_t value) {
    const int64_t at = sorted_lower_bound(list, n, value);
    return at < n && list[at] == value;
}

// A vertical column of global key block c_block is read by global query block g on its own
// (not through a slash block) iff c_block < g and g - c_block is no slash diagonal.
MT_HOST_DEVICE inline bool column_read_alone(const int32_t* slash, int64_t slash_count,
                                             int64_t c_block, int64_t g) {
    return c_block < g && !sorted_contains(slash, slash_count, g - c_block);
}

}  // namespace mtraining
