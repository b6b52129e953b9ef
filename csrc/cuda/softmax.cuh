// Softmax of one tile's scores, in the mma.sync fragment layout (each thread owns rows
// fragment_row(0) and fragment_row(2), half = 0 and 1, of each 16-row slice ma; a row's 64
// columns are spread over the 4 threads of a quad).
//
// Scores arrive as raw q.k and become logits (Logits::prepare), still unscaled: |scale| log2(e) is
// folded into exp2.
//  * Logits: orientation by the sign of the scale, and logit soft-capping.
//  * OnlineSoftmax (forward): running max and sum per row, P in place of S, acc rescaled.
//  * SavedSoftmax (dQ): P and dS from the forward's lse and delta = rowsum(dO * O) per row.
//  * TransposedSoftmax (dK/dV): P^T and dS^T from the lse and delta of the step's queries.
#pragma once

#include <math.h>

#include "warp_mma.cuh"

namespace mtr {

// The logit of a score x = q.k is scale x, or with soft-capping (softcap > 0, Gemma-2)
// softcap tanh(scale x / softcap). The kernels keep it in units of |scale| (the softmax multiplies
// by |scale| log2 e): l = sign(scale) x, or (softcap / |scale|) tanh(|scale| sign(scale) x / softcap);
// lse is then the same code's. The backward's dS / scale gains d logit / d(scale x) = 1 - tanh^2,
// with tanh = |scale| l / softcap read back from the capped score.
struct Logits {
    bool negate;      // scale < 0
    float to_tanh;    // |scale| / softcap; 0: no soft-capping (or scale 0, where every logit is 0 anyway)
    float from_tanh;  // softcap / |scale|

    __device__ __forceinline__ Logits(float scale, float softcap)
        : negate(scale < 0.f),
          to_tanh(softcap > 0.f ? fabsf(scale) / softcap : 0.f),
          from_tanh(softcap > 0.f && scale != 0.f ? softcap / fabsf(scale) : 0.f) {}

    __device__ __forceinline__ bool capped() const { return to_tanh != 0.f; }

    // tanh to about 1e-7 absolute (ex2 and a fast reciprocal; tanh.approx's 2^-11 relative error
    // would move a logit near a cap of 50 by 0.02); +-1 beyond |x| ~ 9, -1 for x = -inf.
    static __device__ __forceinline__ float tanh(float x) {
        return 1.f - __fdividef(2.f, exp2f(x * (2.f * kLog2e)) + 1.f);
    }

    // Raw scores -> logits (before masking, so that a masked score stays -inf).
    template <int MA>
    __device__ __forceinline__ void prepare(float (&s)[MA][8][4]) const {
        orient_scores(s, negate);
        if (!capped()) return;  // uniform
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[ma][nt][c] = from_tanh * tanh(s[ma][nt][c] * to_tanh);
    }

    // d logit / d(scale x) at a prepared logit l: 1 without capping; 0 at a masked one (-inf).
    // Uncapped, the backward must not pay a select and a multiply per score (4-5% of the D = 128
    // backward): SavedSoftmax branches on capped() once per tile, TransposedSoftmax as its Arch says.
    template <bool kCapped>
    __device__ __forceinline__ float slope(float logit) const {
        if (!kCapped) return 1.f;
        const float t = fminf(fmaxf(logit * to_tanh, -1.f), 1.f);
        return 1.f - t * t;
    }
};

template <int MA>
struct OnlineSoftmax {
    float scale_log2;      // exponent_scale(scale)
    float row_max[MA][2];  // running maximum of the unscaled scores
    float row_sum[MA][2];  // this thread's partial sum of the row's probabilities (the quad adds them at the end)

    __device__ __forceinline__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                row_max[ma][half] = -INFINITY;
                row_sum[ma][half] = 0.f;
            }
    }

    // s: scores -> probabilities against the new running max; acc (the unnormalised output) is
    // rescaled where a row's max grew. Both rows a thread owns go through each step together:
    // independent instructions interleave, and one vote decides the rescale of both.
    template <int D>
    __device__ __forceinline__ void update(float (&s)[MA][8][4], float (&acc)[MA][D / 8][4]) {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma) {
            float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) tile_max[c >> 1] = fmaxf(tile_max[c >> 1], s[ma][nt][c]);
            float reference[2], rescale[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
                tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
                const float new_max = fmaxf(row_max[ma][half], tile_max[half]);  // unscaled
                reference[half] = new_max == -INFINITY ? 0.f : new_max * scale_log2;  // no -inf - -inf
                rescale[half] = exp2f(row_max[ma][half] * scale_log2 - reference[half]);
                row_max[ma][half] = new_max;
            }
            float tile_sum[2] = {0.f, 0.f};
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float prob = exp2f(fmaf(s[ma][nt][c], scale_log2, -reference[c >> 1]));
                    s[ma][nt][c] = prob;
                    tile_sum[c >> 1] += prob;
                }
#pragma unroll
            for (int half = 0; half < 2; ++half) row_sum[ma][half] = row_sum[ma][half] * rescale[half] + tile_sum[half];
            if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {  // most tiles change no row max
#pragma unroll
                for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[ma][nt][c] *= rescale[c >> 1];
            }
        }
    }
};

template <int MA>
struct SavedSoftmax {
    float scale_log2;        // exponent_scale(scale)
    float row_lse[MA][2];    // lse in log2 units; +inf for a row without keys, so that its P is 0
    float row_delta[MA][2];  // rowsum(dO * O)

    // Rows row0 + ma * slice_stride + fragment_row(2 * half) of the CTA's first query query_first.
    __device__ __forceinline__ SavedSoftmax(float scale_log2_, const float* lse, const float* delta, int query_first,
                                            int row0, int slice_stride, int seq_q)
        : scale_log2(scale_log2_) {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = query_first + row0 + ma * slice_stride + fragment_row(2 * half);
                const float row_lse_e = t < seq_q ? lse[t] : -INFINITY;
                row_lse[ma][half] = row_lse_e == -INFINITY ? INFINITY : row_lse_e * kLog2e;
                row_delta[ma][half] = t < seq_q ? delta[t] : 0.f;
            }
    }

    // s: logits -> dS / scale = P * (dP - delta) * logits.slope, with dp = dO V^T.
    __device__ __forceinline__ void dscores(float (&s)[MA][8][4], const float (&dp)[MA][8][4],
                                            const Logits& logits) const {
        if (logits.capped())  // uniform
            dscores<true>(s, dp, logits);
        else
            dscores<false>(s, dp, logits);
    }

    template <bool kCapped>
    __device__ __forceinline__ void dscores(float (&s)[MA][8][4], const float (&dp)[MA][8][4],
                                            const Logits& logits) const {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int half = c >> 1;
                    const float logit = s[ma][nt][c];
                    const float prob = exp2f(fmaf(logit, scale_log2, -row_lse[ma][half]));
                    s[ma][nt][c] = prob * (dp[ma][nt][c] - row_delta[ma][half]) * logits.template slope<kCapped>(logit);
                }
    }
};

struct TransposedSoftmax {
    float scale_log2;  // exponent_scale(scale)

    // How the cap's slope enters dS^T: not at all, always, or predicated per score on capped().
    enum class Slope { kNone, kCapped, kPredicated };

    // Logits S^T -> P^T and dP^T -> dS^T / scale for one 64-query step: lse and delta are the step's
    // 64 values in shared memory (a thread's columns col0 and col0 + 1 per nt). kBranchPerTile: one
    // uniform branch around a loop per case (the wgmma key kernels: 1.4% of the D = 128 backward on
    // an H200 over the predicated multiply); else the predicated multiply (the mma.sync key kernels,
    // where a second loop raises ptxas's spills).
    template <bool kBranchPerTile>
    __device__ __forceinline__ void dscores(float (&s)[1][8][4], float (&dp)[1][8][4], const float* lse,
                                            const float* delta, const Logits& logits) const {
        if constexpr (!kBranchPerTile)
            dscores<Slope::kPredicated>(s, dp, lse, delta, logits);
        else if (logits.capped())  // uniform
            dscores<Slope::kCapped>(s, dp, lse, delta, logits);
        else
            dscores<Slope::kNone>(s, dp, lse, delta, logits);
    }

    template <Slope kSlope>
    __device__ __forceinline__ void dscores(float (&s)[1][8][4], float (&dp)[1][8][4], const float* lse,
                                            const float* delta, const Logits& logits) const {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col0 = fragment_col(nt, 0);
            const float2 lse_pair = *reinterpret_cast<const float2*>(lse + col0);
            const float2 delta_pair = *reinterpret_cast<const float2*>(delta + col0);
            // +inf for a query row without keys (lse = -inf): its P is 0, not NaN
            const float lse_log2[2] = {lse_pair.x == -INFINITY ? INFINITY : lse_pair.x * kLog2e,
                                       lse_pair.y == -INFINITY ? INFINITY : lse_pair.y * kLog2e};
            const float delta_col[2] = {delta_pair.x, delta_pair.y};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float logit = s[0][nt][c];
                const float prob = exp2f(fmaf(logit, scale_log2, -lse_log2[c & 1]));
                s[0][nt][c] = prob;                                       // P^T
                dp[0][nt][c] = prob * (dp[0][nt][c] - delta_col[c & 1]);  // dS^T / scale
                if (kSlope == Slope::kCapped || (kSlope == Slope::kPredicated && logits.capped()))
                    dp[0][nt][c] *= logits.template slope<true>(logit);
            }
        }
    }
};

}  // namespace mtr
