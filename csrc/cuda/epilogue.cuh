// Epilogues: what the kernels write after their main loop, from the fp32 accumulators in the
// mma.sync fragment layout (store_rows in warp_mma.cuh writes them row by row).
//  * Forward: out normalised by the softmax sum, and lse (or both merged into running ones).
//  * dQ: store_rows alone (scaled, or added into a running dQ); store_query_outputs picks one of
//    the two for the query-side kernels.
//  * dK/dV: the vertical pass's partials, the slash pass's rows plus those partials.
#pragma once

#include <math.h>

#include "softmax.cuh"

namespace mtr {

// Normalises acc by each row's softmax sum and writes lse (natural log, scaled logits; -inf for a
// row without keys, whose out stays 0), then out. lse points at this head's [seq_q] row;
// out_row(local row) is the row's output pointer (float, or q's dtype without merge; nullptr past
// the sequence). With merge, out and lse hold the running result of earlier calls over other
// keys: each row's lse becomes log(exp(running) + exp(this call's)) and its out the two outputs
// weighted by exp(lse - merged), read and written in place (the ring's merge, without a pass of
// its own); or, given running_row (store_rows), the merged out goes to out_row in q's dtype and
// the running out is only read (the ring's last step).
template <typename Arch, int MA, int D, typename RowPointer, typename RunningRow = SameRow>
__device__ __forceinline__ void store_forward_output(float (&acc)[MA][D / 8][4], const OnlineSoftmax<MA>& softmax,
                                                     int query_first, int row0, int seq_q, float scale, float* lse,
                                                     bool merge, RowPointer out_row, RunningRow running_row = {}) {
    float keep[MA][2];  // merge: the running output's weight per row
#pragma unroll
    for (int ma = 0; ma < MA; ++ma)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float sum = softmax.row_sum[ma][half];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int t = query_first + row0 + ma * Arch::kSliceStride + fragment_row(2 * half);
            float row_lse = sum > 0.f ? softmax.row_max[ma][half] * fabsf(scale) + logf(sum) : -INFINITY;
            float weight = sum > 0.f ? 1.f / sum : 0.f;
            keep[ma][half] = 0.f;
            if (merge && t < seq_q) {
                const float running = lse[t];
                const float high = fmaxf(running, row_lse), low = fminf(running, row_lse);
                if (high != -INFINITY) {  // else neither saw a key: out stays 0, lse -inf
                    const float merged = high + log1pf(expf(low - high));
                    keep[ma][half] = expf(running - merged);
                    weight *= expf(row_lse - merged);
                    row_lse = merged;
                }
            }
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                acc[ma][nt][2 * half] *= weight;
                acc[ma][nt][2 * half + 1] *= weight;
            }
            __syncwarp();  // the row's four lanes have read the running lse before one rewrites it
            if ((threadIdx.x & 3) == 0 && t < seq_q) lse[t] = row_lse;
        }
    store_rows<MA, D>(acc, row0, Arch::kSliceStride, 1.f, out_row, merge ? keep : nullptr, running_row);
}

// The query-side kernels' epilogue: the forward's out and lse (store_forward_output), or dQ
// (scaled, or added into the running dQ), for this thread's rows of the CTA's first query
// query_first; q_head is the (batch, head)'s first element of q-shaped outputs, lse_row its row of
// lse. An output in q's dtype, when set, is written from the fp32 running one, which is only read.
template <typename Arch, typename T, int MA, int D, bool kBackward, typename Softmax>
__device__ __forceinline__ void store_query_outputs(const AttentionParams& p, float (&acc)[MA][D / 8][4],
                                                    const Softmax& softmax, int query_first, int row0, size_t q_head,
                                                    size_t lse_row) {
    const int query_rows = p.seq_q - query_first;
    const size_t q_stride = static_cast<size_t>(p.heads) * D;
    // this CTA's row `row` of an output [B, Sq, H, D] (fp32, or q's dtype T); nullptr past the sequence
    auto query_out_row = [&](auto* base, int row) -> decltype(base) {
        return row < query_rows ? base + q_head + static_cast<size_t>(query_first + row) * q_stride : nullptr;
    };
    auto running_row = [&](float* base) { return [=](int row) -> const float* { return query_out_row(base, row); }; };
    if constexpr (!kBackward) {
        if (p.out_q_dtype != nullptr) {
            T* out = static_cast<T*>(p.out_q_dtype);
            store_forward_output<Arch, MA, D>(acc, softmax, query_first, row0, p.seq_q, p.scale, p.lse + lse_row,
                                              p.merge_out, [&](int row) { return query_out_row(out, row); },
                                              running_row(p.out));
        } else {
            store_forward_output<Arch, MA, D>(acc, softmax, query_first, row0, p.seq_q, p.scale, p.lse + lse_row,
                                              p.merge_out, [&](int row) { return query_out_row(p.out, row); });
        }
    } else {
        float keep_all[MA][2];  // accumulate_dq: the running dQ kept whole on every row
#pragma unroll
        for (int ma = 0; ma < MA; ++ma) keep_all[ma][0] = keep_all[ma][1] = 1.f;
        const float(*keep)[2] = p.accumulate_dq ? keep_all : nullptr;
        if (p.dq_q_dtype != nullptr) {
            store_rows<MA, D>(acc, row0, Arch::kSliceStride, p.scale,
                              [&](int row) { return query_out_row(static_cast<T*>(p.dq_q_dtype), row); }, keep,
                              running_row(p.dq));
        } else {
            store_rows<MA, D>(acc, row0, Arch::kSliceStride, p.scale,
                              [&](int row) { return query_out_row(p.dq, row); }, keep);
        }
    }
}

// Slash pass, after the CTA's own dK/dV rows are written and visible to all its threads: adds the
// vertical pass's partials for the vertical keys among rows [key_first, key_first + key_count) of
// kv head kv_head, head by head of its GQA group and chunk by chunk (a fixed order: deterministic),
// in the kColumns columns from first_column that the CTA wrote.
template <int D, int kColumns, int kThreads>
__device__ __forceinline__ void add_vertical_partials(const AttentionParams& p, int batch, int kv_head, int group,
                                                      int key_first, int key_count, int query_blocks,
                                                      int first_column) {
    const size_t batch_heads = static_cast<size_t>(batch) * p.heads;  // the batch's first (batch, head) row
    const int chunks = vertical_chunks(query_blocks);
    const size_t chunk_stride = static_cast<size_t>(p.batch) * p.heads * p.vertical_len * D;
    for (int head = kv_head * group; head < (kv_head + 1) * group; ++head) {
        const size_t bh = batch_heads + head;
        const int* keys = p.local_keys + bh * p.vertical_len;
        const int num_keys = p.num_keys[bh];
        int lo = 0, hi = num_keys;  // first key >= key_first
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (keys[mid] < key_first) lo = mid + 1; else hi = mid;
        }
        int end = lo;
        while (end < num_keys && keys[end] < key_first + key_count) ++end;
        for (int index = threadIdx.x; index < (end - lo) * kColumns; index += kThreads) {
            const int entry = lo + index / kColumns;
            const int d = first_column + index % kColumns;
            const size_t out = ((static_cast<size_t>(batch) * p.seq_k + keys[entry]) * p.kv_heads + kv_head) * D + d;
            const size_t partial = (bh * p.vertical_len + entry) * D + d;
            float dk_sum = 0.f, dv_sum = 0.f;
            for (int c = 0; c < chunks; ++c) {
                dk_sum += p.vertical_dk[partial + c * chunk_stride];
                dv_sum += p.vertical_dv[partial + c * chunk_stride];
            }
            p.dk[out] += dk_sum;
            p.dv[out] += dv_sum;
        }
        __syncthreads();  // the next head may hold the same keys
    }
}

}  // namespace mtr
