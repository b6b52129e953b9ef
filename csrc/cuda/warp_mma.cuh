// Warp-level building blocks: cp.async tile loads into swizzled shared memory, ldmatrix fragment
// loads, the m16n8k16 tensor-core MMA (mma.sync, sm_80 and later, including sm_90), the
// two-stage load pipeline, and WarpMma, the mma.sync tensor-core policy of the kernels
// (warpgroup_mma.cuh has the wgmma one, WarpgroupMma, with the same members).
//
// WarpMma's shared-memory tiles are row-major [rows][D] of 16-bit elements with the 16-byte
// chunks of each row XOR-swizzled by (row % 8), so that the 8 row addresses of one ldmatrix and
// the 16-byte cp.async stores of a warp hit distinct banks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "params.h"

namespace mtr {

template <DType dtype> struct ElementOf;
template <> struct ElementOf<DType::kBF16> { using type = __nv_bfloat16; };
template <> struct ElementOf<DType::kFP16> { using type = __half; };

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// The first kAlignment-aligned byte at or after `pointer` in shared memory (allocate kAlignment
// extra bytes).
template <int kAlignment>
__device__ __forceinline__ unsigned char* align_shared(unsigned char* pointer) {
    return pointer + (kAlignment - smem_address(pointer) % kAlignment) % kAlignment;
}

// Element offset of (row, 16-byte chunk) in a swizzled [rows][D] tile.
template <int D>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
    return row * D + ((chunk ^ (row & 7)) << 3);
}

// ---------------------------------------------------------------- cp.async
// Copies 16 bytes, or writes 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

// Copies 4 bytes, or writes zero when !valid.
__device__ __forceinline__ void cp_async_4(void* smem, const void* src, bool valid) {
    const int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(smem)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// How a CTA's kThreads threads split a kRows x D tile load: each thread keeps one 16-byte chunk
// column of each chunk pass and takes every kRowsPerStep-th row. A step moves a multiple of 8 rows
// and a pass a multiple of 8 chunks, so the swizzle stays fixed and the destination moves by
// whole rows and whole swizzle groups. Passes exist where a row has more chunks than the threads
// of 8 rows (head_dim 256 on 128 threads: 32 chunks, two passes of 16).
template <typename Arch, int kRows, int D, int kThreads>
struct RowLoadPlan {
    static constexpr int kChunks = D / 8;
    static constexpr int kChunkColumns = kChunks < kThreads / 8 ? kChunks : kThreads / 8;  // per pass
    static constexpr int kChunkPasses = kChunks / kChunkColumns;
    static constexpr int kRowsPerStep = kThreads / kChunkColumns;
    static constexpr int kSteps = kRows / kRowsPerStep;
    static_assert(kThreads % kChunkColumns == 0 && kChunks % kChunkColumns == 0 && kRows % kRowsPerStep == 0 &&
                      kRowsPerStep % 8 == 0 && (kChunkPasses == 1 || kChunkColumns % 8 == 0),
                  "rows must split evenly over the threads, 8 rows and 8 chunks at a time");
    int chunk = threadIdx.x % kChunkColumns;  // of pass 0
    int row_first = threadIdx.x / kChunkColumns;
    int destination = Arch::template tile_offset<D>(row_first, chunk);  // of step 0, pass 0
    static_assert(64 % kRowsPerStep == 0, "a step must stay inside a 64-row block of the tile");

    __device__ __forceinline__ int row(int step) const { return row_first + step * kRowsPerStep; }
    // the source element offset of a pass's chunk within its row
    __device__ __forceinline__ int column(int pass) const { return (chunk + pass * kChunkColumns) * 8; }
    __device__ __forceinline__ int destination_of(int step, int pass) const {
        return destination + Arch::template row_step_offset<D>(step * kRowsPerStep) +
               Arch::template chunk_step_offset<D>(pass * kChunkColumns);
    }
};

// Loads kRows rows of one or two [rows][D] tensors (e.g. K and V, which share row positions)
// into tiles laid out by Arch::tile_offset: row_offset(row) is the row's element offset from each
// base, or -1 for a row to zero-fill. All kThreads threads of the CTA take part.
template <typename Arch, int kRows, int D, int kThreads, bool kPair, typename T, typename RowOffset>
__device__ __forceinline__ void load_rows_async(T* tile_a, T* tile_b, const T* base_a, const T* base_b,
                                                RowOffset row_offset) {
    const RowLoadPlan<Arch, kRows, D, kThreads> plan;
#pragma unroll
    for (int step = 0; step < plan.kSteps; ++step) {
        const long long offset = row_offset(plan.row(step));
        const bool valid = offset >= 0;
#pragma unroll
        for (int pass = 0; pass < plan.kChunkPasses; ++pass) {
            const long long element = valid ? offset + plan.column(pass) : 0;
            cp_async_16(tile_a + plan.destination_of(step, pass), base_a + element, valid);
            if constexpr (kPair) cp_async_16(tile_b + plan.destination_of(step, pass), base_b + element, valid);
        }
    }
}

// load_rows_async for consecutive rows: row r sits at element offset r * stride from each base,
// rows >= valid_rows are zero-filled. The source is a per-thread offset plus step * a constant
// (no per-row 64-bit multiply, which the compiler keeps for a generic row_offset).
template <typename Arch, int kRows, int D, int kThreads, bool kPair, typename T>
__device__ __forceinline__ void load_consecutive_rows_async(T* tile_a, T* tile_b, const T* base_a, const T* base_b,
                                                            long long stride, int valid_rows) {
    const RowLoadPlan<Arch, kRows, D, kThreads> plan;
    const long long source = plan.row_first * stride;
#pragma unroll
    for (int step = 0; step < plan.kSteps; ++step) {
        const bool valid = plan.row(step) < valid_rows;
#pragma unroll
        for (int pass = 0; pass < plan.kChunkPasses; ++pass) {
            const long long element = valid ? source + step * plan.kRowsPerStep * stride + plan.column(pass) : 0;
            cp_async_16(tile_a + plan.destination_of(step, pass), base_a + element, valid);
            if constexpr (kPair) cp_async_16(tile_b + plan.destination_of(step, pass), base_b + element, valid);
        }
    }
}

// Makes this thread's completed shared-memory writes (cp.async included) visible to the async
// proxy, i.e. to wgmma reading them through descriptors; a CTA barrier must follow.
__device__ __forceinline__ void fence_async_proxy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------- ldmatrix
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Fragment addressing. A lane's ldmatrix row segment for 16-element k-chunk kc sits in 16-byte
// chunk 2 kc + half, swizzled to (2 kc + half) ^ (row % 8). Since row % 8 is the same for every
// fragment a lane loads (fragment rows start at multiples of 8), the swizzled chunk is
// 8 (kc / 4) + ((2 (kc % 4)) ^ m) with the per-lane m = half ^ (row % 8): four base addresses
// (kc % 4) per operand plus compile-time offsets, instead of one register per k-chunk.
struct LaneAddresses {
    uint32_t base[4];
};

template <int D, typename T>
__device__ __forceinline__ LaneAddresses lane_addresses(const T* tile, int row, int half) {
    const int m = half ^ (row & 7);
    const uint32_t row_address = smem_address(tile) + row * D * 2;
    LaneAddresses addresses;
#pragma unroll
    for (int j = 0; j < 4; ++j) addresses.base[j] = row_address + (((2 * j) ^ m) << 4);
    return addresses;
}

// Address of k-chunk kc (16 elements) at `row_offset` rows below the lane's row.
template <int D>
__device__ __forceinline__ uint32_t fragment_address(const LaneAddresses& addresses, int kc, int row_offset) {
    return addresses.base[kc & 3] + (kc >> 2) * 128 + row_offset * D * 2;
}

// A operand (16 rows x 16 k) rows row0.. of a [rows][D] tile: lanes 0-15 address rows 0-15 of
// chunk 2 kc, lanes 16-31 the same rows of chunk 2 kc + 1.
template <int D, typename T>
__device__ __forceinline__ LaneAddresses a_addresses(const T* tile, int row0) {
    const int lane = threadIdx.x & 31;
    return lane_addresses<D>(tile, row0 + (lane & 15), lane >> 4);
}

// B operands of two n-tiles (16 rows of a [n][D] tile, B = tile^T): b[0], b[1] for rows 0-7 and
// b[2], b[3] for rows 8-15.
template <int D, typename T>
__device__ __forceinline__ LaneAddresses b_addresses(const T* tile) {
    const int lane = threadIdx.x & 31;
    return lane_addresses<D>(tile, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
}

// B operands of two n-tiles along D (columns 16 dp..) for 16 k rows of a [k][D] tile (B = tile),
// loaded transposed: b[0], b[1] for columns 16 dp.. 16 dp + 7, b[2], b[3] for the next 8.
template <int D, typename T>
__device__ __forceinline__ LaneAddresses b_trans_addresses(const T* tile) {
    const int lane = threadIdx.x & 31;
    return lane_addresses<D>(tile, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
}

// ---------------------------------------------------------------- mma.sync m16n8k16
template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 value = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&value);
    }
};

template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 value = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&value);
    }
};

template <int MA, int NT>
__device__ __forceinline__ void zero_fill(float (&acc)[MA][NT][4]) {
#pragma unroll
    for (int ma = 0; ma < MA; ++ma)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[ma][nt][c] = 0.f;
}

// Accumulator element (ma, nt, c) of a warp's [16*MA rows] x [8*NT cols] fp32 tile sits at
// row 16*ma + lane/4 + 8*(c/2) and column 8*nt + 2*(lane%4) + c%2.
__device__ __forceinline__ int fragment_row(int c) { return ((threadIdx.x & 31) >> 2) + ((c >> 1) << 3); }
__device__ __forceinline__ int fragment_col(int nt, int c) { return nt * 8 + ((threadIdx.x & 3) << 1) + (c & 1); }

// acc[ma][nt] += A[row0 + 16 ma.., :] * B[8 nt.., :]^T over D, for a 64-column B tile:
// S = Q K^T, dP = dO V^T (rows = queries) and S^T = K Q^T, dP^T = V dO^T (rows = keys).
template <int MA, int D, typename T>
__device__ __forceinline__ void gemm_abt(float (&acc)[MA][8][4], const T* a_tile, int row0, const T* b_tile) {
    const LaneAddresses a_lane = a_addresses<D>(a_tile, row0);
    const LaneAddresses b_lane = b_addresses<D>(b_tile);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t a[MA][4];
#pragma unroll
        for (int ma = 0; ma < MA; ++ma) ldmatrix_x4(a[ma], fragment_address<D>(a_lane, kc, ma * 16));
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, fragment_address<D>(b_lane, kc, np * 16));
#pragma unroll
            for (int ma = 0; ma < MA; ++ma) {
                Mma<T>::run(acc[ma][2 * np], a[ma], b[0], b[1]);
                Mma<T>::run(acc[ma][2 * np + 1], a[ma], b[2], b[3]);
            }
        }
    }
}

// The A fragment (16 rows x 16 keys, k-step kc) of fp32 accumulators p (16 rows x 64 keys)
// rounded to T: accumulator and A-operand fragments share their row/column ownership.
template <typename T>
__device__ __forceinline__ void pack_a_fragment(uint32_t (&a)[4], const float (&p)[8][4], int kc) {
    a[0] = Mma<T>::pack(p[2 * kc][0], p[2 * kc][1]);
    a[1] = Mma<T>::pack(p[2 * kc][2], p[2 * kc][3]);
    a[2] = Mma<T>::pack(p[2 * kc + 1][0], p[2 * kc + 1][1]);
    a[3] = Mma<T>::pack(p[2 * kc + 1][2], p[2 * kc + 1][3]);
}

// acc[ma] (16 rows x N) += P[ma] (16 rows x 64, fp32 accumulators rounded to T) * B (64 x N, the
// columns of a [64][kStride] tile from b_tile, a multiple of 64 columns in): O += P V, dQ += dS K,
// dV += P^T dO, dK += dS^T Q.
template <int MA, int N, int kStride, typename T>
__device__ __forceinline__ void gemm_pb(float (&acc)[MA][N / 8][4], const float (&p)[MA][8][4], const T* b_tile) {
    const LaneAddresses b_lane = b_trans_addresses<kStride>(b_tile);
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        uint32_t a[MA][4];
#pragma unroll
        for (int ma = 0; ma < MA; ++ma) pack_a_fragment<T>(a[ma], p[ma], kc);
#pragma unroll
        for (int dp = 0; dp < N / 16; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, fragment_address<kStride>(b_lane, dp, kc * 16));
#pragma unroll
            for (int ma = 0; ma < MA; ++ma) {
                Mma<T>::run(acc[ma][2 * dp], a[ma], b[0], b[1]);
                Mma<T>::run(acc[ma][2 * dp + 1], a[ma], b[2], b[3]);
            }
        }
    }
}

// The mma.sync path (sm_80 and later): each warp loads its own fragments with ldmatrix from
// row-swizzled tiles, so tiles need no special alignment and shared memory needs no proxy fence.
// A policy gives the kernels: the CTA's rows (kCtaRows) and pipeline stages (kStages) per head_dim,
// a warp's rows (first_row, kSliceStride), the tile layout (tile_offset, row_step_offset,
// chunk_step_offset, kTileAlignment, kAsyncProxy), whether 64-row
// tiles may be copied by TMA (kTma), how the key kernel's softmax takes the cap's slope
// (kBranchPerTile: TransposedSoftmax::dscores), S = A B^T (scores, which overwrites S), acc += P B
// (accumulate), and each of the two for two independent products at once (scores_pair,
// accumulate_pair: one wgmma batch and wait for both).
struct WarpMma {
    static constexpr bool kAsyncProxy = false;
    static constexpr bool kTma = false;
    static constexpr int kTileAlignment = 128;
    static constexpr bool kBranchPerTile = false;  // a second loop would raise the key kernels' spills
    // A CTA owns a whole block (rows or keys); above head_dim 128, 64 rows of it (its tiles would
    // outgrow an sm_80 CTA's 163 KB of shared memory), one 16-row slice per warp (MA = 1).
    template <int BS, int MA, int D>
    static constexpr int kCtaRows = D > kMaxNarrowHeadDim ? 64 : BS;
    // Pipeline stages (run_pipeline): one above head_dim 128, for the same shared memory.
    template <int D>
    static constexpr int kStages = D > kMaxNarrowHeadDim ? 1 : 2;
    // A warp owns 16 MA consecutive rows: slice ma starts at first_row + 16 ma.
    static constexpr int kSliceStride = 16;
    template <int MA>
    static __device__ __forceinline__ int first_row() { return (threadIdx.x >> 5) * 16 * MA; }
    template <int D>
    static __device__ __forceinline__ int tile_offset(int row, int chunk) { return swizzled_offset<D>(row, chunk); }
    template <int D>
    static constexpr int row_step_offset(int rows) { return rows * D; }
    // tile_offset(r, c + chunks) - tile_offset(r, c) for chunks a multiple of 8
    template <int D>
    static constexpr int chunk_step_offset(int chunks) { return chunks * 8; }
    template <int MA, int D, typename T>
    static __device__ __forceinline__ void scores(float (&acc)[MA][8][4], const T* a_tile, int row0, const T* b_tile) {
        zero_fill(acc);
        gemm_abt<MA, D>(acc, a_tile, row0, b_tile);
    }
    template <int MA, int D, typename T>
    static __device__ __forceinline__ void scores_pair(float (&s0)[MA][8][4], const T* a0, const T* b0,
                                                       float (&s1)[MA][8][4], const T* a1, const T* b1, int row0) {
        scores<MA, D>(s0, a0, row0, b0);
        scores<MA, D>(s1, a1, row0, b1);
    }
    // accumulate: acc (N columns) += P B, B the N columns from b_tile of a [64][kStride] tile.
    template <int MA, int N, int kStride = N, typename T>
    static __device__ __forceinline__ void accumulate(float (&acc)[MA][N / 8][4], const float (&p)[MA][8][4],
                                                      const T* b_tile) {
        gemm_pb<MA, N, kStride>(acc, p, b_tile);
    }
    template <int MA, int N, int kStride = N, typename T>
    static __device__ __forceinline__ void accumulate_pair(float (&acc0)[MA][N / 8][4], const float (&p0)[MA][8][4],
                                                           const T* b0, float (&acc1)[MA][N / 8][4],
                                                           const float (&p1)[MA][8][4], const T* b1) {
        gemm_pb<MA, N, kStride>(acc0, p0, b0);
        gemm_pb<MA, N, kStride>(acc1, p1, b1);
    }
};

// Scores are kept as sign(scale) * q.k so that |scale| * log2(e) folds into the exponent
// (exp2(s * |scale| log2 e - m)) and the running maximum is taken before scaling.
// |scale| log2(e), kept >= the smallest normal float so that a masked score (-inf) times it stays
// -inf for scale 0 (where every probability is then exp2(~0) = 1, as it should be).
__device__ __forceinline__ float exponent_scale(float scale) { return fmaxf(fabsf(scale) * kLog2e, 1.17549435e-38f); }

template <int MA>
__device__ __forceinline__ void orient_scores(float (&s)[MA][8][4], bool negate) {
    if (!negate) return;  // uniform: the sign of the scale
#pragma unroll
    for (int ma = 0; ma < MA; ++ma)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[ma][nt][c] = -s[ma][nt][c];
}

// Two adjacent output values of a row: fp32, or rounded to nearest into bf16/fp16 (as torch's
// .to() rounds).
__device__ __forceinline__ void store_pair(float* cell, float x, float y) {
    *reinterpret_cast<float2*>(cell) = make_float2(x, y);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* cell, float x, float y) {
    *reinterpret_cast<__nv_bfloat162*>(cell) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void store_pair(__half* cell, float x, float y) {
    *reinterpret_cast<__half2*>(cell) = __floats2half2_rn(x, y);
}

// store_rows' running row by default: the destination row itself (float rows), read before it is
// written.
struct SameRow {};

// Writes a warp's fp32 accumulator rows (scaled) to global rows row_pointer(local_row) (nullptr:
// skip), float or the inputs' dtype (the pointer's type); slice ma of the warp starts at row
// row0 + ma * slice_stride. With keep (per slice and fragment half: one row each), the row becomes
// keep * the running row + the scaled accumulator instead. The running row is float: the
// destination row itself (SameRow, float rows only), or running_row(local_row), read and not
// written (a result in the inputs' dtype from a float32 running one: the ring's last step).
template <int MA, int D, typename RowPointer, typename RunningRow = SameRow>
__device__ __forceinline__ void store_rows(const float (&acc)[MA][D / 8][4], int row0, int slice_stride, float scale,
                                           RowPointer row_pointer, const float (*keep)[2] = nullptr,
                                           RunningRow running_row = {}) {
    using Out = std::remove_pointer_t<decltype(row_pointer(0))>;
#pragma unroll
    for (int ma = 0; ma < MA; ++ma)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + ma * slice_stride + fragment_row(2 * half);
            Out* dst = row_pointer(row);
            if (dst == nullptr) continue;
            const float* running = nullptr;
            if (keep != nullptr) {
                if constexpr (!std::is_same_v<RunningRow, SameRow>) {
                    running = running_row(row);
                } else if constexpr (std::is_same_v<Out, float>) {
                    running = dst;
                }
            }
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                Out* cell = dst + fragment_col(nt, 0);
                float x = acc[ma][nt][2 * half] * scale, y = acc[ma][nt][2 * half + 1] * scale;
                if (running != nullptr) {
                    const float2 old = *reinterpret_cast<const float2*>(running + fragment_col(nt, 0));
                    x += keep[ma][half] * old.x;
                    y += keep[ma][half] * old.y;
                }
                store_pair(cell, x, y);
            }
        }
}

// The cp.async pipeline over the items next(item) -> bool yields (uniform over the CTA), in
// kStages buffers. Two stages: item n + 1 loads (issue(item, buffer)) while item n computes
// (compute(item, buffer)); groups are committed every iteration, possibly empty, so wait<1> always
// means "all but the newest group". One stage (where shared memory holds one buffer: head_dim 256
// on mma.sync): each item loads, then computes. Groups committed before the call (e.g. a resident
// tile) complete by the first wait. kAsyncProxy: the tiles are read by wgmma (fence_async_proxy
// before the barrier).
template <typename Item, bool kAsyncProxy, int kStages, typename Next, typename Issue, typename Compute>
__device__ __forceinline__ void run_pipeline(Next&& next, Issue&& issue, Compute&& compute) {
    static_assert(kStages == 1 || kStages == 2, "one or two pipeline stages");
    if constexpr (kStages == 1) {
        Item current;
        for (bool has_current = next(current); has_current; has_current = next(current)) {
            issue(current, 0);
            cp_async_commit();
            cp_async_wait<0>();
            if constexpr (kAsyncProxy) fence_async_proxy();
            __syncthreads();
            compute(current, 0);
            __syncthreads();  // the buffer just read is the next one filled
        }
        return;
    }
    Item current, upcoming;
    bool has_current = next(current);
    if (has_current) issue(current, 0);
    cp_async_commit();
    bool has_upcoming = has_current && next(upcoming);
    int buffer = 0;
    while (has_current) {
        if (has_upcoming) issue(upcoming, buffer ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        if constexpr (kAsyncProxy) fence_async_proxy();
        __syncthreads();
        compute(current, buffer);
        __syncthreads();  // the buffer just read is the next one refilled
        current = upcoming;
        has_current = has_upcoming;
        buffer ^= 1;
        if (has_current) has_upcoming = next(upcoming);
    }
    cp_async_wait<0>();
}

}  // namespace mtr
