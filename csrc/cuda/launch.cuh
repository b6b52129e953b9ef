// Launch templates: run_forward / run_backward for one (dtype, head dim), dispatching on the
// index block size. Each fwd_*/bwd_*.cu file instantiates one pair (FlashAttention style), so the
// instantiations compile in parallel.
#pragma once

#include <type_traits>

#include "key_kernel.cuh"
#include "query_kernel.cuh"
#include "specialized_query_kernel.cuh"
#include "warpgroup_mma.cuh"

namespace mtr {

constexpr int kDeltaThreads = 256;
constexpr int kDeltaRowsPerThread = 4;  // independent 16-byte loads in flight per thread and tensor
template <int D>
constexpr int kDeltaLanes = D / 8;  // lanes per row, 8 elements (16 bytes of bf16/fp16) each
template <int D>
constexpr int kDeltaRowsPerBlock = kDeltaThreads / kDeltaLanes<D> * kDeltaRowsPerThread;

__device__ __forceinline__ float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }
__device__ __forceinline__ float to_float(__half value) { return __half2float(value); }

// Elements 8 c..8 c + 7 of a row as floats, read with 16-byte loads (rows 16-byte aligned).
template <typename T>
__device__ __forceinline__ void load_eight(float (&x)[8], const T* row, int c) {
    const uint4 packed = reinterpret_cast<const uint4*>(row)[c];
    const T* values = reinterpret_cast<const T*>(&packed);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_float(values[i]);
}
__device__ __forceinline__ void load_eight(float (&x)[8], const float* row, int c) {
    const float4 low = reinterpret_cast<const float4*>(row)[2 * c];
    const float4 high = reinterpret_cast<const float4*>(row)[2 * c + 1];
    x[0] = low.x, x[1] = low.y, x[2] = low.z, x[3] = low.w, x[4] = high.x, x[5] = high.y, x[6] = high.z, x[7] = high.w;
}

// delta[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d] over the [B x S x H] rows of D
// elements: D / 8 lanes per row, each reading 8 elements of dout and out with 16-byte loads, and
// kDeltaRowsPerThread rows per thread issued before any is summed, so that enough loads are in
// flight to stream at memory bandwidth. Out is q's dtype T or float (a ring's running out).
template <typename T, typename Out, int D>
__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(const AttentionParams p, const Out* out) {
    constexpr int kLanes = kDeltaLanes<D>;
    constexpr int kRowsPerPass = kDeltaThreads / kLanes;  // rows a block covers per pass
    const long long rows = static_cast<long long>(p.batch) * p.seq_q * p.heads;
    const long long first = static_cast<long long>(blockIdx.x) * kDeltaRowsPerBlock<D> + threadIdx.x / kLanes;
    const int c = threadIdx.x % kLanes;
    float dout[kDeltaRowsPerThread][8], value[kDeltaRowsPerThread][8];
#pragma unroll
    for (int r = 0; r < kDeltaRowsPerThread; ++r) {
        const long long row = first + r * kRowsPerPass;
        if (row < rows) {
            load_eight(dout[r], static_cast<const T*>(p.dout) + row * D, c);
            load_eight(value[r], out + row * D, c);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) dout[r][i] = value[r][i] = 0.f;
        }
    }
#pragma unroll
    for (int r = 0; r < kDeltaRowsPerThread; ++r) {
        const long long row = first + r * kRowsPerPass;
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += dout[r][i] * value[r][i];
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        if (c == 0 && row < rows) {
            const int head = static_cast<int>(row % p.heads);
            const long long token_row = row / p.heads;
            const int t = static_cast<int>(token_row % p.seq_q);
            const int batch = static_cast<int>(token_row / p.seq_q);
            p.delta[(static_cast<size_t>(batch) * p.heads + head) * p.seq_q + t] = sum;
        }
    }
}

// The warp-specialised query kernels exist for the wgmma path at block 128, up to head_dim 128
// (their stages of Q and K/V tiles outgrow shared memory above).
template <typename Arch, int D, int BS>
constexpr bool kHasSpecializedQuery = std::is_same_v<Arch, WarpgroupMma> && BS == 128 && D <= kMaxNarrowHeadDim;

// The forward: the warp-specialised kernel where it exists and is chosen; else query_kernel, at
// block 128 with 32 rows per warp (two 16-row slices, MA = 2) amortising each key tile's fragment
// loads (mma.sync) or its loads and bookkeeping (wgmma: a 128-row CTA of one warpgroup) over twice
// the rows, at the price of registers. Block 64, and head_dims above 128 (whose output rows alone
// take 128 registers per 16-row slice), keep 16 rows per warp.
template <typename Arch, typename T, int D, int BS>
cudaError_t forward_with(const AttentionParams& p, cudaStream_t stream) {
    if constexpr (kHasSpecializedQuery<Arch, D, BS>) {
        if (p.specialized_query) return launch_specialized_query_kernel<T, D, false>(p, stream);
    }
    if constexpr (BS == 128 && D <= kMaxNarrowHeadDim) {
        return launch_query_kernel<Arch, T, D, BS, 2, false>(p, stream);
    } else {
        return launch_query_kernel<Arch, T, D, BS, 1, false>(p, stream);
    }
}

// Makes `waiter` wait for the work queued on `signaller` so far, through an event.
inline cudaError_t wait_for_stream(cudaStream_t waiter, cudaStream_t signaller) {
    cudaEvent_t event;
    cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (status != cudaSuccess) return status;
    status = cudaEventRecord(event, signaller);
    if (status == cudaSuccess) status = cudaStreamWaitEvent(waiter, event, 0);
    const cudaError_t destroyed = cudaEventDestroy(event);  // its resources go once it has completed
    return status != cudaSuccess ? status : destroyed;
}

// dK/dV (vertical pass first: it writes the scratch partials the slash pass adds) and dQ. dQ
// neither reads nor writes what the dK/dV passes do, so with a dq_stream it runs there, beside
// them: its short CTAs fill the SMs that the slash pass's long CTAs leave idle towards its end.
// `stream` waits for dq_stream before it returns, so later work on `stream` sees dq.
template <typename Arch, typename T, int D, int BS>
cudaError_t backward_kernels(const AttentionParams& p, cudaStream_t stream, cudaStream_t dq_stream) {
    cudaError_t status = cudaSuccess;
    if (dq_stream != nullptr) {
        status = wait_for_stream(dq_stream, stream);  // delta and the per-call lists
        if (status != cudaSuccess) return status;
    }
    status = launch_key_kernel<Arch, T, D, BS, true>(p, stream);
    if (status != cudaSuccess) return status;
    status = launch_key_kernel<Arch, T, D, BS, false>(p, stream);
    if (status != cudaSuccess) return status;
    cudaStream_t dq_on = dq_stream != nullptr ? dq_stream : stream;
    if constexpr (kHasSpecializedQuery<Arch, D, BS>) {
        status = p.specialized_query ? launch_specialized_query_kernel<T, D, true>(p, dq_on)
                                     : launch_query_kernel<Arch, T, D, BS, 1, true>(p, dq_on);
    } else {
        status = launch_query_kernel<Arch, T, D, BS, 1, true>(p, dq_on);
    }
    if (status != cudaSuccess || dq_stream == nullptr) return status;
    return wait_for_stream(stream, dq_stream);
}

// Calls run(Arch{}, std::integral_constant<int, BS>{}) for the params' tensor-core path and index
// block size: the one place forward and backward pick their kernels' instantiation.
template <typename Run>
cudaError_t with_path_and_block(const AttentionParams& p, Run run) {
    auto with_block = [&](auto arch) {
        return p.block_size == 64 ? run(arch, std::integral_constant<int, 64>{}) : run(arch, std::integral_constant<int, 128>{});
    };
    return p.warpgroup_mma ? with_block(WarpgroupMma{}) : with_block(WarpMma{});
}

template <DType dtype, int kHeadDim>
cudaError_t run_forward(const AttentionParams& p, cudaStream_t stream) {
    using T = typename ElementOf<dtype>::type;
    if (p.head_dim != kHeadDim) return cudaErrorInvalidValue;
    return with_path_and_block(p, [&](auto arch, auto block) {
        return forward_with<decltype(arch), T, kHeadDim, decltype(block)::value>(p, stream);
    });
}

template <DType dtype, int kHeadDim>
cudaError_t run_delta(const AttentionParams& p, cudaStream_t stream) {
    using T = typename ElementOf<dtype>::type;
    if (p.head_dim != kHeadDim) return cudaErrorInvalidValue;
    const long long rows = static_cast<long long>(p.batch) * p.seq_q * p.heads;
    const long long blocks = (rows + kDeltaRowsPerBlock<kHeadDim> - 1) / kDeltaRowsPerBlock<kHeadDim>;
    if (blocks == 0) return cudaSuccess;
    if (p.out_in_q_dtype != nullptr) {
        delta_kernel<T, T, kHeadDim><<<static_cast<unsigned>(blocks), kDeltaThreads, 0, stream>>>(
            p, static_cast<const T*>(p.out_in_q_dtype));
    } else {
        delta_kernel<T, float, kHeadDim><<<static_cast<unsigned>(blocks), kDeltaThreads, 0, stream>>>(p, p.out_in);
    }
    return cudaGetLastError();
}

template <DType dtype, int kHeadDim>
cudaError_t run_backward(const AttentionParams& p, cudaStream_t stream, cudaStream_t dq_stream) {
    using T = typename ElementOf<dtype>::type;
    if (p.head_dim != kHeadDim) return cudaErrorInvalidValue;
    if (!p.delta_given) {
        const cudaError_t status = run_delta<dtype, kHeadDim>(p, stream);
        if (status != cudaSuccess) return status;
    }
    return with_path_and_block(p, [&](auto arch, auto block) {
        return backward_kernels<decltype(arch), T, kHeadDim, decltype(block)::value>(p, stream, dq_stream);
    });
}

}  // namespace mtr
