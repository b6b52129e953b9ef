// The wgmma path (sm_90a, Hopper): a warpgroup (4 consecutive warps, 64 rows) issues
// wgmma.mma_async through CuTe's instruction atoms, with B (and the score A) read by the tensor
// cores straight from shared memory through matrix descriptors instead of per-warp ldmatrix, and
// whole 64-row tiles copied by TMA (cp.async.bulk.tensor) where they are contiguous rows.
//
// It is a drop-in for WarpMma (warp_mma.cuh): a warp still owns 16 rows, and the wgmma
// accumulator of a 64-row warpgroup tile hands each warp its rows in the mma.sync fragment layout
// (fragment_row / fragment_col), so the kernels' masking and softmax code is shared.
//
// Tile layout (the canonical 128-byte-swizzle K-major layout of wgmma, and what TMA writes for a
// box of 64 rows x 64 elements with 128-byte swizzle): a [rows][D] tile is stored in blocks of 64
// rows; a block holds D/64 column atoms one after the other, an atom being [64 rows][64 elements]
// (128-byte rows, 8 KB), and each row's 16-byte chunks are XOR-swizzled by row % 8. The same
// tile is read K-major (rows = M or N, the contraction over D: S = Q K^T, dP = dO V^T) and
// MN-major (the contraction over rows, N = D: O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q).
//
//      D = 128:  rows 0-63  | cols 0-63 (8 KB) | cols 64-127 (8 KB) |
//                rows 64-127| cols 0-63 (8 KB) | cols 64-127 (8 KB) |   ...
#pragma once

#include <type_traits>
#include <utility>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "warp_mma.cuh"

namespace mtr {

// The RS atom of an accumulation N columns wide (the accumulator's whole width: the head_dim, or a
// key kernel's column part).
template <int N, typename A64, typename A128, typename A256>
using AtomOfWidth = std::conditional_t<N == 64, A64, std::conditional_t<N == 128, A128, A256>>;

template <typename T, int N> struct WgmmaAtoms;

template <int N> struct WgmmaAtoms<__nv_bfloat16, N> {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma accumulations are 64, 128 or 256 columns wide");
    using Major = cute::SM90::GMMA::Major;
    using Scores = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<Major::K, Major::K>;
    using Accumulate = AtomOfWidth<N, cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<Major::K, Major::MN>,
                                   cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<Major::K, Major::MN>,
                                   cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<Major::K, Major::MN>>;
};

template <int N> struct WgmmaAtoms<__half, N> {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma accumulations are 64, 128 or 256 columns wide");
    using Major = cute::SM90::GMMA::Major;
    using Scores = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<Major::K, Major::K>;
    using Accumulate = AtomOfWidth<N, cute::SM90::GMMA::MMA_64x64x16_F32F16F16_RS<Major::K, Major::MN>,
                                   cute::SM90::GMMA::MMA_64x128x16_F32F16F16_RS<Major::K, Major::MN>,
                                   cute::SM90::GMMA::MMA_64x256x16_F32F16F16_RS<Major::K, Major::MN>>;
};

// A shared-memory matrix descriptor with 128-byte swizzle (PTX ISA "matrix descriptor"): start
// address, leading and stride byte offsets, all in 16-byte units.
__device__ __forceinline__ uint64_t swizzle128_descriptor(uint32_t address, uint32_t leading_bytes,
                                                          uint32_t stride_bytes) {
    return (uint64_t{1} << 62) | (static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32) |
           (static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16) | ((address >> 4) & 0x3FFF);
}

// d = A B (overwrite) or d += A B (accumulate), both operands in shared memory.
template <typename Atom, int N, size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t a, uint64_t b, float (&d)[N], bool accumulate,
                                         std::index_sequence<I...>) {
    Atom::fma(a, b, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <typename Atom, int N, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t b, float (&d)[N], std::index_sequence<I...>) {
    Atom::fma(a[0], a[1], a[2], a[3], b, d[I]...);
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
template <typename Array>
__device__ __forceinline__ void fence_accumulators(Array& d) {
    constexpr int kCount = sizeof(Array) / sizeof(float);
    float(&flat)[kCount] = reinterpret_cast<float(&)[kCount]>(d);
#pragma unroll
    for (int i = 0; i < kCount; ++i) cute::warpgroup_fence_operand(flat[i]);
}

// One batch of wgmma into the given accumulator arrays: issue() issues them; returns when they
// completed. A-operand registers must be written before the call (wgmma.fence orders them).
template <typename Issue, typename... Accumulators>
__device__ __forceinline__ void wgmma_batch(Issue issue, Accumulators&... accumulators) {
    (fence_accumulators(accumulators), ...);
    cute::warpgroup_arrive();
    issue();
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    (fence_accumulators(accumulators), ...);
}

// P (a warp's 16 MA rows x 64 fp32 accumulators) rounded to T as wgmma A fragments, k-step by k-step.
template <typename T, int MA>
__device__ __forceinline__ void pack_a_fragments(uint32_t (&a)[MA][4][4], const float (&p)[MA][8][4]) {
#pragma unroll
    for (int ma = 0; ma < MA; ++ma)
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) pack_a_fragment<T>(a[ma][kc], p[ma], kc);
}

struct WarpgroupMma {
    static constexpr bool kAsyncProxy = true;
    static constexpr int kTileAlignment = 1024;  // the swizzle repeats every 1024 bytes
    static constexpr bool kBranchPerTile = true;
    // One warpgroup per CTA, 64 MA rows: a warp owns 16 rows of each 64-row wgmma tile ma
    // (MA = 2 amortises a key tile's loads and bookkeeping over 128 rows). With MA = 1 a 128-block
    // takes two CTAs, which run out of step on an SM where one CTA's two warpgroups would run in
    // lockstep between their shared barriers.
    template <int BS, int MA, int D>
    static constexpr int kCtaRows = 64 * MA;
    template <int D>
    static constexpr int kStages = 2;  // sm_90's 227 KB hold two at every head_dim
    static constexpr int kSliceStride = 64;
    template <int MA>
    static __device__ __forceinline__ int first_row() { return (threadIdx.x >> 5) * 16; }

    static constexpr bool kTma = true;
    static constexpr int kAtomBytes = 64 * 128;  // a column atom: 64 rows x 128 bytes
    static constexpr int kGroupBytes = 8 * 128;  // 8 rows of an atom: the descriptors' stride byte offset

    template <int D>
    static __device__ __forceinline__ int tile_offset(int row, int chunk) {
        return (row >> 6) * 64 * D + (chunk >> 3) * 4096 + (row & 63) * 64 + (((chunk & 7) ^ (row & 7)) << 3);
    }
    // tile_offset(r + rows, c) - tile_offset(r, c) for rows a multiple of 8 and r % 64 + rows % 64 < 64.
    template <int D>
    static constexpr int row_step_offset(int rows) { return (rows >> 6) * 64 * D + (rows & 63) * 64; }
    // tile_offset(r, c + chunks) - tile_offset(r, c) for chunks a multiple of 8: whole column atoms.
    template <int D>
    static constexpr int chunk_step_offset(int chunks) { return (chunks >> 3) * 4096; }

    // acc[ma] (this warp's 16 rows of A tile ma x 64) = A[64 ma..] B^T over D, B a 64-row tile.
    // The CTA is one warpgroup, so its A tiles start at row 0 (the warp's first row is not needed).
    template <int MA, int D, typename T>
    static __device__ __forceinline__ void scores(float (&acc)[MA][8][4], const T* a_tile, int, const T* b_tile) {
        wgmma_batch([&] { issue_scores<MA, D>(acc, a_tile, b_tile); }, acc);
    }

    // Two independent score products in one batch (one wait): s0 = A0 B0^T, s1 = A1 B1^T.
    template <int MA, int D, typename T>
    static __device__ __forceinline__ void scores_pair(float (&s0)[MA][8][4], const T* a0, const T* b0,
                                                       float (&s1)[MA][8][4], const T* a1, const T* b1, int) {
        wgmma_batch([&] { issue_scores<MA, D>(s0, a0, b0); issue_scores<MA, D>(s1, a1, b1); }, s0, s1);
    }

    // acc[ma] (this warp's 16 rows of tile ma x D) += P[ma] (16 rows x 64, rounded to T) B, B the
    // D columns from b_tile of a [64][kStride] tile: a 64-row tile's column atoms follow each other
    // whatever its width, so kStride changes nothing here (WarpMma's rows are kStride long).
    template <int MA, int D, int kStride = D, typename T>
    static __device__ __forceinline__ void accumulate(float (&acc)[MA][D / 8][4], const float (&p)[MA][8][4],
                                                      const T* b_tile) {
        uint32_t a[MA][4][4];
        pack_a_fragments<T>(a, p);
        wgmma_batch([&] { issue_accumulate<MA, D>(acc, a, b_tile); }, acc);
    }

    // Two independent accumulations in one batch: acc0 += P0 B0, acc1 += P1 B1.
    template <int MA, int D, int kStride = D, typename T>
    static __device__ __forceinline__ void accumulate_pair(float (&acc0)[MA][D / 8][4], const float (&p0)[MA][8][4],
                                                           const T* b0, float (&acc1)[MA][D / 8][4],
                                                           const float (&p1)[MA][8][4], const T* b1) {
        uint32_t a0[MA][4][4], a1[MA][4][4];
        pack_a_fragments<T>(a0, p0);
        pack_a_fragments<T>(a1, p1);
        wgmma_batch([&] { issue_accumulate<MA, D>(acc0, a0, b0); issue_accumulate<MA, D>(acc1, a1, b1); }, acc0, acc1);
    }

    // Asynchronous score products (the warp-specialised kernel's consumers take turns issuing
    // them): each starts one batch and returns at once; finish<N>(accumulators...) returns when
    // all but the N newest batches completed. Until then the accumulators must not be touched.
    template <int MA, int D, typename T>
    static __device__ __forceinline__ void start_scores(float (&acc)[MA][8][4], const T* a_tile, const T* b_tile) {
        start_batch([&] { issue_scores<MA, D>(acc, a_tile, b_tile); }, acc);
    }
    template <int MA, int D, typename T>
    static __device__ __forceinline__ void start_scores_pair(float (&s0)[MA][8][4], const T* a0, const T* b0,
                                                             float (&s1)[MA][8][4], const T* a1, const T* b1) {
        start_batch([&] { issue_scores<MA, D>(s0, a0, b0); issue_scores<MA, D>(s1, a1, b1); }, s0, s1);
    }
    template <int kPending, typename... Accumulators>
    static __device__ __forceinline__ void finish(Accumulators&... accumulators) {
        cute::warpgroup_wait<kPending>();
        (fence_accumulators(accumulators), ...);
    }

  private:
    template <typename Issue, typename... Accumulators>
    static __device__ __forceinline__ void start_batch(Issue issue, Accumulators&... accumulators) {
        (fence_accumulators(accumulators), ...);
        cute::warpgroup_arrive();
        issue();
        cute::warpgroup_commit_batch();
        (fence_accumulators(accumulators), ...);
    }

    template <int MA, int D, typename T>
    static __device__ __forceinline__ void issue_scores(float (&acc)[MA][8][4], const T* a_tile, const T* b_tile) {
        using Atom = typename WgmmaAtoms<T, 64>::Scores;
        const uint32_t a = smem_address(a_tile);
        const uint32_t b = smem_address(b_tile);
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
                const uint32_t k_bytes = (kc >> 2) * kAtomBytes + (kc & 3) * 32;  // atom, then 32 bytes per 16 elements
                wgmma_ss<Atom>(swizzle128_descriptor(a + ma * 64 * D * 2 + k_bytes, 16, kGroupBytes),
                               swizzle128_descriptor(b + k_bytes, 16, kGroupBytes),
                               reinterpret_cast<float(&)[32]>(acc[ma]), kc > 0, std::make_index_sequence<32>{});
            }
    }

    template <int MA, int D, typename T>
    static __device__ __forceinline__ void issue_accumulate(float (&acc)[MA][D / 8][4], const uint32_t (&a)[MA][4][4],
                                                            const T* b_tile) {
        using Atom = typename WgmmaAtoms<T, D>::Accumulate;
        const uint32_t b = smem_address(b_tile);
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int kc = 0; kc < 4; ++kc)  // 16 rows of B (two 8-row groups) per step; atoms kAtomBytes apart along D
                wgmma_rs<Atom>(a[ma][kc], swizzle128_descriptor(b + kc * 2 * kGroupBytes, kAtomBytes, kGroupBytes),
                               reinterpret_cast<float(&)[D / 2]>(acc[ma]), std::make_index_sequence<D / 2>{});
    }
};

// ---------------------------------------------------------------- TMA
// Copies of whole 64-row tiles by the tensor memory accelerator (cp.async.bulk.tensor): thread 0
// arms a buffer's mbarrier with the bytes to come and starts the copies; every thread waits on the
// barrier's phase before reading the buffer. The tensor maps (params.h: q_map, k_map, ...) view a
// tensor as [rows][heads][D] with a box of 64 rows x 1 head x 64 elements and 128-byte swizzle,
// so one copy writes one column atom of the tile layout above.
template <int kBuffers>
struct TmaBuffers {
    uint64_t* barriers;   // kBuffers mbarriers in shared memory
    uint32_t phases = 0;  // bit b: the phase parity the next wait on buffer b waits for

    // Thread 0 initialises the barriers; a CTA barrier must follow before their first use.
    __device__ __forceinline__ void init() const {
        if (threadIdx.x != 0) return;
        for (int b = 0; b < kBuffers; ++b) cute::initialize_barrier(barriers[b], 1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
    }

    // Rows row..row + 63 of head `head` of two tensors viewed alike (K and V, or q and dout) into
    // their 64-row tiles of `buffer`: thread 0 arms the buffer's barrier with the bytes to come and
    // starts one copy per column atom; the other threads return at once.
    template <int D, typename T>
    __device__ __forceinline__ void copy_pair(int buffer, const CUtensorMap& map_a, T* tile_a, const CUtensorMap& map_b,
                                              T* tile_b, int head, int row) const {
        if (threadIdx.x != 0) return;
        cute::set_barrier_transaction_bytes(barriers[buffer], 2 * 64 * D * sizeof(T));
#pragma unroll
        for (int atom = 0; atom < D / 64; ++atom) {
            const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
            cute::SM90_TMA_LOAD_3D::copy(&map_a, &barriers[buffer], hint, tile_a + atom * 64 * 64, atom * 64, head, row);
            cute::SM90_TMA_LOAD_3D::copy(&map_b, &barriers[buffer], hint, tile_b + atom * 64 * 64, atom * 64, head, row);
        }
    }

    // Every thread: waits until the copies into `buffer` have landed.
    __device__ __forceinline__ void wait(int buffer) {
        cute::wait_barrier(barriers[buffer], (phases >> buffer) & 1u);
        phases ^= 1u << buffer;
    }
};

}  // namespace mtr
