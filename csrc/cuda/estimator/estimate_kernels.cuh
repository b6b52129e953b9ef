// Kernels of the fused vertical-slash estimator (interface and rule: estimate_api.cuh).
//
// Score kernels (pass A: row statistics, pass B: masses). One CTA of 4 warps per (batch, query
// head, key split); CTAs of the query heads that share a KV head and a split are adjacent in launch
// order, so the K tiles they stream are read from L2 once per group. The CTA keeps its head's lq
// query rows in shared memory (chunks of 64 rows) and streams 64-key tiles through a two-stage
// cp.async pipeline; warp w computes rows 16 w .. 16 w + 15 of a chunk against the tile with
// mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate). A 64-key tile is 64-aligned in local keys and
// block is a multiple of 64, so its keys are 64 consecutive global positions.
//
// Pass A keeps a running (max, sum of exp) per row, merges the four lanes of a row and writes one
// partial per (row, split); a second kernel combines the splits in order. Pass B writes the tile's
// probabilities to shared memory; thread j < 64 sums column j over the rows, thread d < 127 sums
// token diagonal d (row i, key i - d + 63) over the rows, and the 127 diagonal sums of each
// (chunk, tile) go to global memory; a gather kernel adds, per global token diagonal, the at most
// two tiles per chunk that hold it, in a fixed order. Nothing uses float atomics: every result is
// bitwise reproducible.
//
// Selection: one CTA per (row, chunk of kSelectChunk entries), the rows of both mass lists
// (vertical, slash) in the same launches. Four radix passes over the float bits (masses >= 0 order
// like their bits) build 256-bin histograms of (count, fixed-point mass) with integer atomics
// (exact, so order-free): per lane in shared memory (a warp's atomics never collide), then per row
// in global memory. Each pass starts by picking, from the previous pass's row histogram, the bin
// holding the last selected entry. A write kernel then compacts, in ascending index order, the
// entries above the threshold value plus the first ties by index, each chunk at the offset that the
// last pass's per-chunk counts give.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "estimate_api.cuh"
#include "warp_mma.cuh"

namespace mtr {
namespace est {

constexpr int kScoreThreads = 128;   // 4 warps x 16 rows of a 64-row chunk
constexpr int kProbStride = 72;      // floats per row of the probability tile (conflict-free float2 stores)
constexpr int kStatsThreads = 128;
constexpr int kGatherThreads = 256;
constexpr int kSelectThreads = 512;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kRadixBins = 256;
constexpr int kSelectUnroll = 8;
constexpr int kRecordWords = 1 + kRadixBins;  // per (row, chunk): entries above the 24-bit prefix, final bin counts
constexpr int kFinalizeThreads = 256;
// Packed histogram entry: count << kCountShift | mass in fixed point (2^kFixedBits per unit).
constexpr int kCountShift = 42;
constexpr unsigned long long kMassMask = (1ull << kCountShift) - 1;
constexpr float kFixedOne = 274877906944.0f;  // 2^38: masses up to 16 sum into 42 bits
constexpr float kMaxMass = 15.0f;

// ------------------------------------------------------------------ primitives
// cp.async, ldmatrix and mma.sync come from warp_mma.cuh (the attention kernels' own).

// exp(x) for x <= 0 (and -inf -> 0) through ex2.
__device__ __forceinline__ float exp_of(float x) { return exp2f(x * kLog2e); }

// Rows 0 .. 63 of a [64][D] tile from rows at `stride` elements (rows >= valid_rows zero-filled).
template <int D, typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* base, long long stride, int valid_rows) {
    constexpr int kChunks = D / 8;
    constexpr int kRowsPerStep = kScoreThreads / kChunks;
    static_assert(kScoreThreads % kChunks == 0 && kTile % kRowsPerStep == 0, "tile split");
    const int chunk = threadIdx.x % kChunks;
    const int row0 = threadIdx.x / kChunks;
#pragma unroll
    for (int step = 0; step < kTile / kRowsPerStep; ++step) {
        const int row = row0 + step * kRowsPerStep;
        const bool valid = row < valid_rows;
        const T* src = valid ? base + row * stride + chunk * 8 : base;
        cp_async_16(tile + swizzled_offset<D>(row, chunk), src, valid);
    }
}

// acc = Q[16 w .. 16 w + 15] K^T for the 64 x D query chunk and the 64 x D key tile of this warp w.
// Accumulator (nt, c) is row 16 w + lane / 4 + 8 (c / 2), key 8 nt + 2 (lane % 4) + c % 2.
template <int D, typename T>
__device__ __forceinline__ void tile_scores(float (&acc)[8][4], const T* q_tile, const T* k_tile) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[nt][c] = 0.f;
    const int a_row = warp * 16 + (lane & 15);
    const int a_half = lane >> 4;
    const int b_row = (lane & 7) + ((lane >> 4) << 3);
    const int b_half = (lane >> 3) & 1;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t a[4];
        ldmatrix_x4(a, smem_address(q_tile + swizzled_offset<D>(a_row, 2 * kc + a_half)));
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, smem_address(k_tile + swizzled_offset<D>(np * 16 + b_row, 2 * kc + b_half)));
            Mma<T>::run(acc[2 * np], a, b[0], b[1]);
            Mma<T>::run(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// Global position of local key kk.
__device__ __forceinline__ int key_position(const ScoreParams& p, int kk) {
    return mtraining::stripe_global_token(kk, p.block, p.world, p.rank);
}

// The CTA's work: batch, query head, its KV head, and its key tiles [tile_begin, tile_end).
struct ScoreWork {
    int b, h, kvh, split, tile_begin, tile_end;
};

__device__ __forceinline__ ScoreWork score_work(const ScoreParams& p, int cta) {
    const int group = p.heads / p.kv_heads;
    int linear = cta;
    ScoreWork w;
    const int g = linear % group;
    linear /= group;
    w.split = linear % p.splits;
    linear /= p.splits;
    w.kvh = linear % p.kv_heads;
    w.b = linear / p.kv_heads;
    w.h = w.kvh * group + g;
    w.tile_begin = w.split * p.tiles_per_split;
    w.tile_end = min(p.num_tiles, w.tile_begin + p.tiles_per_split);
    return w;
}

// Document mode: p as the view of document `doc` as a causal sequence of its own (batch 1,
// world 1), its outputs offset to the document's; q and k are set by enter_document (they need T).
__device__ __forceinline__ void view_document(ScoreParams& p, const ScoreDocument& doc) {
    p.part_max += doc.stats_first * p.split_stride;
    p.part_sum += doc.stats_first * p.split_stride;
    p.row_max += doc.stats_first;
    p.row_sum += doc.stats_first;
    p.columns += static_cast<long long>(doc.row) * p.heads * p.columns_stride + doc.key_first;
    p.diag_partials += doc.partial_first;
    p.weight = doc.weight;
    p.batch = 1;
    p.lq = doc.lq;
    p.chunks = doc.chunks;
    p.sk = p.seq_len = doc.length;
    p.q_start = doc.length - doc.lq;
    p.world = 1;
    p.rank = 0;
    p.num_tiles = doc.num_tiles;
    p.splits = doc.splits;
    p.tiles_per_split = doc.tiles_per_split;
}

// Document mode: turns p into the view of this CTA's document (view_document) and returns the
// CTA's index within it. One sequence: p as it is and blockIdx.x.
template <typename T>
__device__ __forceinline__ int enter_document(ScoreParams& p) {
    const int cta = static_cast<int>(blockIdx.x);
    if (p.documents == nullptr) return cta;
    int lo = 0, hi = p.num_documents - 1;  // the last document whose first CTA is at or before this one
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (p.documents[mid].cta_first <= cta) lo = mid;
        else hi = mid - 1;
    }
    const ScoreDocument doc = p.documents[lo];
    p.q = static_cast<const T*>(p.q) + doc.row * p.q_batch_stride + doc.q_row * p.q_row_stride;
    p.k = static_cast<const T*>(p.k) + doc.row * p.k_batch_stride + doc.key_first * p.k_row_stride;
    view_document(p, doc);
    return cta - doc.cta_first;
}

// Loads the CTA's query chunks and runs compute(tile, k_tile) over its key tiles, the next tile
// loading while one computes. compute runs between two CTA barriers.
template <int D, typename T, typename Compute>
__device__ __forceinline__ void stream_key_tiles(const ScoreParams& p, const ScoreWork& w, T* q_s, T* k_s,
                                                 Compute&& compute) {
    const T* q_base = static_cast<const T*>(p.q) + w.b * p.q_batch_stride + static_cast<long long>(w.h) * D;
    const T* k_base = static_cast<const T*>(p.k) + w.b * p.k_batch_stride + static_cast<long long>(w.kvh) * D;
    for (int ch = 0; ch < p.chunks; ++ch)
        load_tile_async<D>(q_s + ch * kTile * D, q_base + ch * kTile * p.q_row_stride, p.q_row_stride,
                           p.lq - ch * kTile);
    auto load_keys = [&](int tile, int buffer) {
        load_tile_async<D>(k_s + buffer * kTile * D, k_base + tile * kTile * p.k_row_stride, p.k_row_stride,
                           p.sk - tile * kTile);
    };
    if (w.tile_begin < w.tile_end) load_keys(w.tile_begin, 0);
    cp_async_commit();
    for (int tile = w.tile_begin; tile < w.tile_end; ++tile) {
        const int buffer = (tile - w.tile_begin) & 1;
        if (tile + 1 < w.tile_end) load_keys(tile + 1, buffer ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        compute(tile, k_s + buffer * kTile * D);
        __syncthreads();  // the buffer just read is the next one refilled
    }
    cp_async_wait<0>();
}

// Largest visible key index j (0 .. 63) of the tile for query row i, or -1: keys must exist locally
// and lie at or before the query position.
__device__ __forceinline__ int visible_limit(const ScoreParams& p, int i, int tile, int tile_position) {
    if (i >= p.lq) return -1;
    return min(p.sk - tile * kTile - 1, p.q_start + i - tile_position);
}

// ------------------------------------------------------------------ pass A: row statistics
template <typename T, int D>
__global__ void __launch_bounds__(kScoreThreads, 2) row_stats_kernel(const ScoreParams params) {
    extern __shared__ __align__(128) unsigned char smem[];
    ScoreParams p = params;
    const ScoreWork w = score_work(p, enter_document<T>(p));
    T* q_s = reinterpret_cast<T*>(smem);
    T* k_s = q_s + p.chunks * kTile * D;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;

    float row_max[kMaxChunks][2], row_sum[kMaxChunks][2];
#pragma unroll
    for (int ch = 0; ch < kMaxChunks; ++ch)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            row_max[ch][half] = -INFINITY;
            row_sum[ch][half] = 0.f;
        }

    stream_key_tiles<D>(p, w, q_s, k_s, [&](int tile, const T* k_tile) {
        const int tile_position = key_position(p, tile * kTile);
#pragma unroll
        for (int ch = 0; ch < kMaxChunks; ++ch) {
            if (ch >= p.chunks) break;
            float acc[8][4];
            tile_scores<D>(acc, q_s + ch * kTile * D, k_tile);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = ch * kTile + warp * 16 + (lane >> 2) + 8 * half;
                const int limit = visible_limit(p, i, tile, tile_position);
                float tile_max = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int j = nt * 8 + 2 * (lane & 3) + c;
                        if (j <= limit) tile_max = fmaxf(tile_max, acc[nt][2 * half + c] * p.scale);
                    }
                if (tile_max == -INFINITY) continue;  // nothing visible in this row of the tile
                const float new_max = fmaxf(row_max[ch][half], tile_max);
                float sum = row_sum[ch][half] * exp_of(row_max[ch][half] - new_max);
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int j = nt * 8 + 2 * (lane & 3) + c;
                        if (j <= limit) sum += exp_of(acc[nt][2 * half + c] * p.scale - new_max);
                    }
                row_max[ch][half] = new_max;
                row_sum[ch][half] = sum;
            }
        }
    });

    // merge the four lanes of each row (commutative: every lane ends with the same bits)
#pragma unroll
    for (int ch = 0; ch < kMaxChunks; ++ch) {
        if (ch >= p.chunks) break;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float m = row_max[ch][half], s = row_sum[ch][half];
#pragma unroll
            for (int offset = 1; offset <= 2; offset <<= 1) {
                const float om = __shfl_xor_sync(0xffffffffu, m, offset);
                const float os = __shfl_xor_sync(0xffffffffu, s, offset);
                const float nm = fmaxf(m, om);
                if (nm != -INFINITY) s = s * exp_of(m - nm) + os * exp_of(om - nm);
                m = nm;
            }
            const int i = ch * kTile + warp * 16 + (lane >> 2) + 8 * half;
            if ((lane & 3) == 0 && i < p.lq) {
                const long long row = static_cast<long long>(w.b * p.heads + w.h) * p.lq + i;
                p.part_max[row * p.split_stride + w.split] = m;
                p.part_sum[row * p.split_stride + w.split] = s;
                if (w.split == p.splits - 1)  // a document of fewer splits than the stride: empty ones
                    for (int empty = p.splits; empty < p.split_stride; ++empty) {
                        p.part_max[row * p.split_stride + empty] = -INFINITY;
                        p.part_sum[row * p.split_stride + empty] = 0.f;
                    }
            }
        }
    }
}

// Combines the splits of each row in split order.
__global__ void __launch_bounds__(kStatsThreads) combine_row_stats_kernel(const ScoreParams p) {
    const long long row = static_cast<long long>(blockIdx.x) * kStatsThreads + threadIdx.x;
    if (row >= p.stats_rows) return;
    const float* pm = p.part_max + row * p.split_stride;
    const float* ps = p.part_sum + row * p.split_stride;
    float m = -INFINITY;
    for (int s = 0; s < p.split_stride; ++s) m = fmaxf(m, pm[s]);
    float sum = 0.f;
    if (m != -INFINITY)
        for (int s = 0; s < p.split_stride; ++s)
            if (pm[s] != -INFINITY) sum += ps[s] * exp_of(pm[s] - m);
    p.row_max[row] = m;
    p.row_sum[row] = sum;
}

// ------------------------------------------------------------------ pass B: masses
template <typename T, int D>
__global__ void __launch_bounds__(kScoreThreads, 3) masses_kernel(const ScoreParams params) {
    extern __shared__ __align__(128) unsigned char smem[];
    ScoreParams p = params;
    const ScoreWork w = score_work(p, enter_document<T>(p));
    T* q_s = reinterpret_cast<T*>(smem);
    T* k_s = q_s + p.chunks * kTile * D;
    float* prob = reinterpret_cast<float*>(k_s + 2 * kTile * D);  // [64][kProbStride]
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int tid = threadIdx.x;
    const long long head_row = static_cast<long long>(w.b) * p.heads + w.h;
    const float inv_rows = 1.f / static_cast<float>(p.lq);

    // this thread's rows: the row max and 1 / row sum (0 for absent rows)
    float row_max[kMaxChunks][2], row_inv[kMaxChunks][2];
#pragma unroll
    for (int ch = 0; ch < kMaxChunks; ++ch)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int i = ch * kTile + warp * 16 + (lane >> 2) + 8 * half;
            const bool present = ch < p.chunks && i < p.lq;
            const float m = present ? p.row_max[head_row * p.lq + i] : 0.f;
            const float s = present ? p.row_sum[head_row * p.lq + i] : 0.f;
            row_max[ch][half] = m == -INFINITY ? 0.f : m;
            row_inv[ch][half] = s > 0.f ? 1.f / s : 0.f;
        }

    stream_key_tiles<D>(p, w, q_s, k_s, [&](int tile, const T* k_tile) {
        const int tile_position = key_position(p, tile * kTile);
        float column = 0.f;
#pragma unroll
        for (int ch = 0; ch < kMaxChunks; ++ch) {
            if (ch >= p.chunks) break;
            float acc[8][4];
            tile_scores<D>(acc, q_s + ch * kTile * D, k_tile);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = warp * 16 + (lane >> 2) + 8 * half;
                const int limit = visible_limit(p, ch * kTile + r, tile, tile_position);
                const float m = row_max[ch][half], inv = row_inv[ch][half];
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
                    const int j = nt * 8 + 2 * (lane & 3);
                    float2 value;
                    value.x = j <= limit ? exp_of(acc[nt][2 * half] * p.scale - m) * inv : 0.f;
                    value.y = j + 1 <= limit ? exp_of(acc[nt][2 * half + 1] * p.scale - m) * inv : 0.f;
                    *reinterpret_cast<float2*>(prob + r * kProbStride + j) = value;
                }
            }
            __syncthreads();
            if (tid < kTile) {
                float sum = 0.f;
#pragma unroll 8
                for (int i = 0; i < kTile; ++i) sum += prob[i * kProbStride + tid];
                column += sum;
            }
            // token diagonal d = i - j + 63 of the tile: rows max(0, d - 63) .. min(63, d). Every
            // thread walks all 64 rows in step (adding 0 off its diagonal: the same sum), so a
            // warp's 32 loads hit 32 consecutive words: no bank conflicts, no divergence.
            {
                const int d = tid;
                float sum = 0.f;
#pragma unroll 16
                for (int i = 0; i < kTile; ++i) {
                    const int j = i - d + (kTile - 1);
                    const float v = prob[i * kProbStride + max(0, min(kTile - 1, j))];
                    sum += (j >= 0 && j < kTile) ? v : 0.f;
                }
                const long long slot =
                    ((head_row * p.chunks + ch) * p.num_tiles + tile) * static_cast<long long>(kDiagSlots) + d;
                p.diag_partials[slot] = sum;
            }
            __syncthreads();  // before the next chunk overwrites the probabilities
        }
        const int kk = tile * kTile + tid;
        if (tid < kTile && kk < p.sk) p.columns[head_row * p.columns_stride + kk] = column * inv_rows * p.weight;
    });
}

// Token diagonal t of (batch, head) row head_row: the sum over chunks of the (at most two) local
// tiles holding it, in order.
__device__ __forceinline__ float diagonal_sum(const ScoreParams& p, long long head_row, int t) {
    float sum = 0.f;
    for (int ch = 0; ch < p.chunks; ++ch) {
        const int q0 = p.q_start + ch * kTile;  // rows q0 .. q0 + 63 see keys q0 - t .. q0 + 63 - t
        const int hi = q0 + kTile - 1 - t;
        if (hi < 0) continue;
        const int lo = max(q0 - t, 0);
        for (int window = lo / kTile; window <= hi / kTile; ++window) {
            const int position = window * kTile;
            const int global_block = position / p.block;
            if (global_block % p.world != p.rank) continue;
            const int tile = ((global_block / p.world) * p.block + position % p.block) / kTile;
            if (tile >= p.num_tiles) continue;
            const int d = t - (q0 - position) + (kTile - 1);
            sum += p.diag_partials[((head_row * p.chunks + ch) * p.num_tiles + tile) * kDiagSlots + d];
        }
    }
    return sum;
}

__global__ void __launch_bounds__(kGatherThreads) gather_diagonals_kernel(const ScoreParams p) {
    const int t = blockIdx.x * kGatherThreads + threadIdx.x;
    const long long head_row = blockIdx.y;
    if (t >= p.seq_len) return;
    p.diagonals[head_row * p.seq_len + t] = diagonal_sum(p, head_row, t) / static_cast<float>(p.lq);
}

// Document mode: token diagonal t of row b, head h sums, over the row's documents longer than t
// (longest first, so the walk stops at the first one that is not), each document's weighted mass
// of its own diagonal t; 0 past the longest.
__global__ void __launch_bounds__(kGatherThreads) gather_document_diagonals_kernel(const ScoreParams p) {
    const int t = blockIdx.x * kGatherThreads + threadIdx.x;
    const int b = static_cast<int>(blockIdx.y) / p.heads, h = static_cast<int>(blockIdx.y) % p.heads;
    if (t >= p.seq_len) return;
    float sum = 0.f;
    for (int i = p.row_first[b]; i < p.row_first[b + 1]; ++i) {
        const ScoreDocument doc = p.documents[p.row_documents[i]];
        if (doc.length <= t) break;
        ScoreParams view = p;
        view_document(view, doc);
        sum += diagonal_sum(view, h, t) / static_cast<float>(doc.lq) * doc.weight;
    }
    p.diagonals[static_cast<long long>(blockIdx.y) * p.seq_len + t] = sum;
}

// ------------------------------------------------------------------ block scans
// Exclusive scan over the CTA of kThreads threads (all must call it); `total` gets the CTA's sum.
// `scratch` holds kThreads / 32 + 1 values.
template <int kThreads, typename V>
__device__ __forceinline__ V block_exclusive_scan(V value, V& total, V* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    V inclusive = value;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const V other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    if (lane == 31) scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        constexpr int kWarps = kThreads / 32;
        V warp_total = lane < kWarps ? scratch[lane] : V(0);
        V warp_inclusive = warp_total;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const V other = __shfl_up_sync(0xffffffffu, warp_inclusive, offset);
            if (lane >= offset) warp_inclusive += other;
        }
        if (lane < kWarps) scratch[lane] = warp_inclusive - warp_total;
        if (lane == kWarps - 1) scratch[kWarps] = warp_inclusive;
    }
    __syncthreads();
    const V result = scratch[warp] + inclusive - value;
    total = scratch[kThreads / 32];
    __syncthreads();  // scratch may be reused by the next call
    return result;
}

// ------------------------------------------------------------------ top-p selection
// Rows of up to two segments (vertical and slash masses, each with its own p and cap) run in the
// same launches; each row is cut into chunks of kSelectChunk entries, one CTA per (row, chunk).
// Four histogram kernels (one per 8-bit radix digit of the float bits) each add their CTA's
// 256-bin (count, fixed-point mass) histogram into the row's global histogram of that level with
// integer atomics (exact, so order-free and reproducible). The next kernel first picks, from the
// previous level's global histogram, the bin holding the last selected entry (every CTA of the row
// does the same pick on the same integers; the row's chunk-0 CTA stores the result for the kernel
// after). The last histogram kernel also records, per chunk, how many entries rank above the
// 24-bit prefix and the counts of its 256 final bins, so the write kernel knows, per chunk, how
// many selected entries precede it without another pass.
__device__ __forceinline__ uint32_t mass_bits(float x) { return x > 0.f ? __float_as_uint(x) : 0u; }

__device__ __forceinline__ unsigned long long fixed_mass(float x) {
    return x > 0.f ? __float2ull_rn(fminf(x, kMaxMass) * kFixedOne) : 0ull;
}

struct SelectState {
    uint32_t prefix, prefix_mask;
    unsigned long long above_count, above_mass;  // entries ranked before the current bin range
    unsigned long long range_count;              // entries in the chosen bin (last pass: ties)
    double target;                               // p * total * (1 - 1e-6), fixed point
    int selected, ties_taken;
};

__device__ __forceinline__ SelectState initial_select_state() {
    SelectState s;
    s.prefix = 0;
    s.prefix_mask = 0;
    s.above_count = 0;
    s.above_mass = 0;
    s.range_count = 0;
    s.target = 0.0;
    s.selected = 0;
    s.ties_taken = 0;
    return s;
}

// Whether bin (count, mass), preceded by `count_before` entries of mass `mass_before`, holds the
// last selected entry (given that it is not before it): the selection ends within it.
__device__ __forceinline__ bool ends_in(unsigned long long count_before, unsigned long long mass_before,
                                        unsigned long long count, unsigned long long mass, int cap_n,
                                        double target) {
    return count > 0 && (count_before + count >= static_cast<unsigned long long>(cap_n) ||
                         static_cast<double>(mass_before + mass) >= target);
}

// The CTA's row (within its segment), chunk and entry range; `active` is false for the CTAs past
// the row's last chunk (the grid is sized for the longest segment).
struct SelectWork {
    SelectSegment seg;
    int row;     // over all segments (scratch index)
    int local;   // within the segment
    int chunk, begin, end;
    bool active;
};

__device__ __forceinline__ SelectWork select_work(const SelectParams& p) {
    SelectWork w;
    w.row = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.max_chunks));
    w.chunk = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.max_chunks));
    const bool second = p.segments > 1 && w.row >= p.segment[0].rows;
    w.seg = second ? p.segment[1] : p.segment[0];
    w.local = second ? w.row - p.segment[0].rows : w.row;
    w.begin = w.chunk * kSelectChunk;
    w.end = min(w.seg.n, w.begin + kSelectChunk);
    w.active = w.begin < w.seg.n;
    return w;
}

__device__ __forceinline__ unsigned long long* level_histogram(const SelectParams& p, int level, int row) {
    return p.histogram + (static_cast<long long>(level) * p.total_rows + row) * kRadixBins;
}

// Warp 0: refines `state` by the digit at `level` from the row's global histogram of that level.
__device__ __forceinline__ void pick_digit(SelectState& state, const unsigned long long* bins, int level,
                                           int cap_n, float p_top) {
    const int lane = threadIdx.x & 31;
    const int shift = 24 - 8 * level;
    // lane l scans bins 255 - 8 l down to 248 - 8 l (descending values)
    unsigned long long v[8];
    unsigned long long chunk_count = 0, chunk_mass = 0;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
        v[u] = bins[kRadixBins - 1 - 8 * lane - u];
        chunk_count += v[u] >> kCountShift;
        chunk_mass += v[u] & kMassMask;
    }
    if (level == 0) {
        unsigned long long total = chunk_mass;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) total += __shfl_xor_sync(0xffffffffu, total, offset);
        if (lane == 0) state.target = static_cast<double>(p_top) * static_cast<double>(total) * (1.0 - 1e-6);
    }
    __syncwarp();
    unsigned long long count_before = chunk_count, mass_before = chunk_mass;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned long long c = __shfl_up_sync(0xffffffffu, count_before, offset);
        const unsigned long long m = __shfl_up_sync(0xffffffffu, mass_before, offset);
        if (lane >= offset) {
            count_before += c;
            mass_before += m;
        }
    }
    count_before = count_before - chunk_count + state.above_count;
    mass_before = mass_before - chunk_mass + state.above_mass;
    const double target = state.target;
    int hit_bin = -1;
    unsigned long long hit_count = 0;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
        const int bin = kRadixBins - 1 - 8 * lane - u;
        const unsigned long long c = v[u] >> kCountShift, m = v[u] & kMassMask;
        if (hit_bin < 0) {
            if (ends_in(count_before, mass_before, c, m, cap_n, target)) {
                hit_bin = bin;
                hit_count = c;
            } else {
                count_before += c;
                mass_before += m;
            }
        }
    }
    const unsigned hits = __ballot_sync(0xffffffffu, hit_bin >= 0);
    __syncwarp();
    // by construction some bin ends the selection; should none (impossible), keep the state, and
    // the compaction takes no ties
    if (hits != 0 && lane == __ffs(hits) - 1) {
        state.prefix |= static_cast<uint32_t>(hit_bin) << shift;
        state.prefix_mask |= 0xffu << shift;
        state.above_count = count_before;
        state.above_mass = mass_before;
        state.range_count = hit_count;
    }
    __syncwarp();
}

// Warp 0: the row's state before the histogram of `level` (picks 0 .. level - 1 applied); the
// chunk-0 CTA stores it for the next kernel.
__device__ __forceinline__ void state_before(SelectState& state, const SelectParams& p, const SelectWork& w,
                                             int level) {
    const int lane = threadIdx.x & 31;
    SelectState* states = static_cast<SelectState*>(p.states);  // [kSelectLevels - 1][total_rows]
    if (lane == 0) state = level >= 2 ? states[static_cast<long long>(level - 2) * p.total_rows + w.row]
                                      : initial_select_state();
    __syncwarp();
    if (level >= 1) {
        pick_digit(state, level_histogram(p, level - 1, w.row), level - 1, min(w.seg.cap, w.seg.n), w.seg.p);
        if (level <= kSelectLevels - 1 && w.chunk == 0 && lane == 0)
            states[static_cast<long long>(level - 1) * p.total_rows + w.row] = state;
    }
}

__device__ __forceinline__ uint32_t* chunk_record(const SelectParams& p, int row, int chunk) {
    return p.records + (static_cast<long long>(row) * p.max_chunks + chunk) * kRecordWords;
}

template <int kLevel>
__global__ void __launch_bounds__(kSelectThreads) select_histogram_kernel(const SelectParams p) {
    extern __shared__ __align__(16) unsigned char select_smem[];
    unsigned long long* histogram = reinterpret_cast<unsigned long long*>(select_smem);  // [bins][32 lanes]
    __shared__ SelectState state;
    __shared__ unsigned int above_prefix;
    const SelectWork w = select_work(p);
    if (!w.active) return;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    if (tid < 32) state_before(state, p, w, kLevel);
    for (int e = tid; e < kRadixBins * 32; e += kSelectThreads) histogram[e] = 0ull;
    if (tid == 0) above_prefix = 0;
    __syncthreads();

    constexpr int shift = 24 - 8 * kLevel;
    const uint32_t prefix = state.prefix, prefix_mask = state.prefix_mask;
    const float* mass = w.seg.mass + static_cast<long long>(w.local) * w.seg.row_stride;
    unsigned int above = 0;
    for (int base = w.begin + tid; base < w.end; base += kSelectThreads * kSelectUnroll) {
        float value[kSelectUnroll];
#pragma unroll
        for (int u = 0; u < kSelectUnroll; ++u) {
            const int e = base + u * kSelectThreads;
            value[u] = e < w.end ? mass[e] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kSelectUnroll; ++u) {
            const int e = base + u * kSelectThreads;
            const uint32_t bits = mass_bits(value[u]);
            if (e < w.end) {
                if ((bits & prefix_mask) == prefix) {
                    const int bin = (bits >> shift) & (kRadixBins - 1);
                    atomicAdd(&histogram[bin * 32 + lane], (1ull << kCountShift) | fixed_mass(value[u]));
                } else if (kLevel == kSelectLevels - 1 && (bits & prefix_mask) > prefix) {
                    ++above;
                }
            }
        }
    }
    if (kLevel == kSelectLevels - 1 && above > 0) atomicAdd(&above_prefix, above);
    __syncthreads();
    if (tid < kRadixBins) {
        unsigned long long sum = 0;
        for (int l = 0; l < 32; ++l) sum += histogram[tid * 32 + ((l + tid) & 31)];
        if (sum != 0) atomicAdd(level_histogram(p, kLevel, w.row) + tid, sum);
        if (kLevel == kSelectLevels - 1) chunk_record(p, w.row, w.chunk)[1 + tid] = static_cast<uint32_t>(sum >> kCountShift);
    }
    if (kLevel == kSelectLevels - 1 && tid == 0) chunk_record(p, w.row, w.chunk)[0] = above_prefix;
}

// The last pick, the tie count, then the chunk's selected entries in ascending index order at
// their offsets in the row's list (the records of the earlier chunks give the offsets).
__global__ void __launch_bounds__(kSelectThreads) select_write_kernel(const SelectParams p) {
    __shared__ unsigned long long scan_scratch[kSelectWarps + 1];
    __shared__ SelectState state;
    __shared__ unsigned int above_earlier, ties_earlier;
    const SelectWork w = select_work(p);
    if (!w.active) return;
    const int tid = threadIdx.x;
    const int n = w.seg.n;
    const int cap_n = min(w.seg.cap, n);
    if (tid < 32) state_before(state, p, w, kSelectLevels);
    if (tid == 32) {
        above_earlier = 0;
        ties_earlier = 0;
    }
    __syncthreads();

    // the threshold value is state.prefix; its ties are taken in index order
    if (tid == 0) {
        const unsigned long long above = state.above_count, ties = state.range_count;
        const unsigned long long tie_mass = fixed_mass(__uint_as_float(state.prefix));
        const double target = state.target;
        // ties r = 1 .. counted by the mass rule: those with above_mass + (r - 1) tie_mass < target
        unsigned long long by_mass = 0;
        if (static_cast<double>(state.above_mass) < target) {
            if (tie_mass == 0) {
                by_mass = ties;
            } else {
                const double estimate = ceil((target - static_cast<double>(state.above_mass)) /
                                             static_cast<double>(tie_mass));
                by_mass = estimate < 0.0 ? 0 : (estimate > static_cast<double>(ties) ? ties
                                                                                     : static_cast<unsigned long long>(estimate));
                while (by_mass > 0 &&
                       static_cast<double>(state.above_mass + (by_mass - 1) * tie_mass) >= target)
                    --by_mass;
                while (by_mass < ties && static_cast<double>(state.above_mass + by_mass * tie_mass) < target)
                    ++by_mass;
            }
        }
        long long selected = static_cast<long long>(above + by_mass);
        selected = selected < 1 ? 1 : selected;
        selected = selected > cap_n ? cap_n : selected;
        long long taken = selected - static_cast<long long>(above);
        taken = taken < 0 ? 0 : (taken > static_cast<long long>(ties) ? static_cast<long long>(ties) : taken);
        state.ties_taken = static_cast<int>(taken);
        state.selected = static_cast<int>(above + taken);
    }
    // entries of the earlier chunks above the threshold, and ties (last digit = the threshold's)
    const uint32_t threshold = state.prefix;
    const int low = static_cast<int>(threshold & 0xffu);
    if (tid < kRadixBins && w.chunk > 0) {
        unsigned int sum = 0;
        for (int c = 0; c < w.chunk; ++c) sum += chunk_record(p, w.row, c)[1 + tid];
        if (tid > low && sum > 0) atomicAdd(&above_earlier, sum);
        if (tid == low) atomicAdd(&ties_earlier, sum);
    }
    for (int c = tid; c < w.chunk; c += kSelectThreads) {
        const unsigned int v = chunk_record(p, w.row, c)[0];
        if (v > 0) atomicAdd(&above_earlier, v);
    }
    __syncthreads();

    const unsigned long long ties_taken = static_cast<unsigned long long>(state.ties_taken);
    const int selected = state.selected;
    const float* mass = w.seg.mass + static_cast<long long>(w.local) * w.seg.row_stride;
    int* out = w.seg.indices + static_cast<long long>(w.local) * w.seg.width;
    unsigned long long above_running = above_earlier, ties_running = ties_earlier;
    // compaction: pieces of kSelectThreads x 8 entries, 8 consecutive per thread
    constexpr int kPerThread = 8;
    for (int base = w.begin; base < w.end; base += kSelectThreads * kPerThread) {
        const int first = base + tid * kPerThread;
        uint32_t bits[kPerThread];
        unsigned long long mine = 0;  // above << 32 | ties
#pragma unroll
        for (int u = 0; u < kPerThread; ++u) {
            const int e = first + u;
            bits[u] = e < w.end ? mass_bits(mass[e]) : 0u;
            if (e < w.end) mine += bits[u] > threshold ? (1ull << 32) : (bits[u] == threshold ? 1ull : 0ull);
        }
        unsigned long long piece_total;
        const unsigned long long before = block_exclusive_scan<kSelectThreads>(mine, piece_total, scan_scratch);
        unsigned long long above_before = above_running + (before >> 32);
        unsigned long long ties_before = ties_running + (before & 0xffffffffull);
#pragma unroll
        for (int u = 0; u < kPerThread; ++u) {
            const int e = first + u;
            if (e >= w.end) continue;
            const bool is_above = bits[u] > threshold, is_tie = bits[u] == threshold;
            if (is_above || (is_tie && ties_before < ties_taken)) {
                const unsigned long long slot = above_before + (ties_before < ties_taken ? ties_before : ties_taken);
                if (slot < static_cast<unsigned long long>(w.seg.width)) out[slot] = e;
            }
            above_before += is_above ? 1 : 0;
            ties_before += is_tie ? 1 : 0;
        }
        above_running += piece_total >> 32;
        ties_running += piece_total & 0xffffffffull;
    }
    // the padding, spread over the row's CTAs
    const int row_chunks = (n + kSelectChunk - 1) / kSelectChunk;
    for (int slot = selected + w.chunk * kSelectThreads + tid; slot < w.seg.width; slot += row_chunks * kSelectThreads)
        out[slot] = kPad;
    if (w.chunk == 0 && tid == 0) w.seg.count[w.local] = selected;
}

// ------------------------------------------------------------------ merge
// Entries < value in the ascending list[0 .. n) (pattern.h's binary search).
__device__ __forceinline__ int count_less(const int* list, int n, int value) {
    return static_cast<int>(mtraining::sorted_lower_bound(list, n, value));
}

// One CTA per row. Every entry's place in the union is its place in its own list plus the number
// of the other list's entries before it, less the repeats before it: extra entries that the
// selected list also holds are dropped, and each list's running count of them comes from chunked
// block scans (kFinalizeThreads entries per pass).
__global__ void __launch_bounds__(kFinalizeThreads) merge_kernel(const MergeParams p) {
    __shared__ int scan_scratch[kFinalizeThreads / 32 + 1];
    const long long row = blockIdx.x;
    const int* selected = p.selected + row * p.selected_width;
    const int n_selected = min(p.selected_count[row], p.selected_width);
    const int* extra = p.extra + row / p.heads * p.extra_width;
    const int n_extra = count_less(extra, p.extra_width, kPad);
    const int width = p.selected_width + p.extra_width;
    int* merged = p.merged + row * width;
    // extra entry i (kept unless selected holds it): its place among the kept ones plus the selected before it
    int kept_before = 0;
    for (int base = 0; base < n_extra; base += kFinalizeThreads) {
        const int i = base + threadIdx.x;
        const int value = i < n_extra ? extra[i] : kPad;
        const int keep = i < n_extra && !mtraining::sorted_contains(selected, n_selected, value);
        int total;
        const int before = block_exclusive_scan<kFinalizeThreads>(keep, total, scan_scratch);
        if (keep) merged[kept_before + before + count_less(selected, n_selected, value)] = value;
        kept_before += total;
    }
    // selected entry j: j plus the kept extra entries before it (the extra before it less the repeats before it)
    int repeats_before = 0;
    for (int base = 0; base < n_selected; base += kFinalizeThreads) {
        const int j = base + threadIdx.x;
        const int value = j < n_selected ? selected[j] : kPad;
        const int repeat = j < n_selected && mtraining::sorted_contains(extra, n_extra, value);
        int total;
        const int before = block_exclusive_scan<kFinalizeThreads>(repeat, total, scan_scratch);
        if (j < n_selected) merged[j + count_less(extra, n_extra, value) - (repeats_before + before)] = value;
        repeats_before += total;
    }
    const int count = n_selected + kept_before;
    for (int slot = count + threadIdx.x; slot < width; slot += kFinalizeThreads) merged[slot] = kPad;
    if (threadIdx.x == 0) p.merged_count[row] = count;
}

// ------------------------------------------------------------------ finalize
__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(const FinalizeParams p) {
    extern __shared__ unsigned char keep_block[];  // [num_blocks]
    __shared__ int scan_scratch[kFinalizeThreads / 32 + 1];
    __shared__ int leading_run, below_sinks, below_limit;
    const int tid = threadIdx.x;
    const long long row = blockIdx.x;
    const int nb = p.num_blocks;

    for (int i = tid; i < nb; i += kFinalizeThreads) keep_block[i] = i < p.local_blocks ? 1 : 0;
    if (tid == 0) {
        leading_run = nb;
        below_sinks = 0;
        below_limit = 0;
    }
    __syncthreads();
    const int* tokens = p.slash_tokens + row * p.slash_token_width;
    const int token_count = min(p.slash_token_count[row], p.slash_token_width);
    for (int j = tid; j < token_count; j += kFinalizeThreads) {
        const int t = tokens[j];
        if (t < 0 || t >= p.seq_len) continue;
        const int first = t / p.block;
        keep_block[first] = 1;  // benign race: every writer stores 1
        if (t % p.block != 0 && first + 1 < nb) keep_block[first + 1] = 1;
    }
    __syncthreads();

    int* slash = p.slash + row * p.slash_width;
    int written = 0;
    for (int base = 0; base < nb; base += kFinalizeThreads) {
        const int i = base + tid;
        const int keep = i < nb ? keep_block[i] : 0;
        if (i < nb && !keep) atomicMin(&leading_run, i);
        int total;
        const int before = block_exclusive_scan<kFinalizeThreads>(keep, total, scan_scratch);
        if (keep && written + before < p.slash_width) slash[written + before] = i;
        written += total;
    }
    const int slash_count = min(written, p.slash_width);
    for (int slot = slash_count + tid; slot < p.slash_width; slot += kFinalizeThreads) slash[slot] = kPad;
    if (tid == 0) p.slash_count[row] = slash_count;

    // columns: sinks 0 .. sinks - 1, then the selected ones >= sinks, all below the first block
    // that the leading run of diagonals already covers for every later query block
    __syncthreads();  // leading_run final
    const long long limit = static_cast<long long>(nb - leading_run) * p.block;
    const int sinks = min(p.sink_tokens, p.seq_len);
    const int* columns = p.columns + row * p.column_width;
    const int column_count = min(p.column_count[row], p.column_width);
    for (int j = tid; j < column_count; j += kFinalizeThreads) {
        const int c = columns[j];
        if (c < sinks) atomicAdd(&below_sinks, 1);
        if (c < limit) atomicAdd(&below_limit, 1);
    }
    __syncthreads();
    const int kept_sinks = static_cast<int>(min(static_cast<long long>(sinks), limit));
    const int extra = max(0, below_limit - below_sinks);
    const int vertical_count = min(kept_sinks + extra, p.vertical_width);
    int* vertical = p.vertical + row * p.vertical_width;
    for (int slot = tid; slot < p.vertical_width; slot += kFinalizeThreads) {
        int value = kPad;
        if (slot < kept_sinks) value = slot;
        else if (slot < vertical_count) value = columns[below_sinks + slot - kept_sinks];
        vertical[slot] = value;
    }
    if (tid == 0) p.vertical_count[row] = vertical_count;
}

}  // namespace est
}  // namespace mtr
