// Plain-C++ interface between the torch binding (binding.cpp) and the CUDA kernels (*.cu).
// It holds raw pointers and sizes only, so the kernels never see ATen and `nvcc -c` compiles them
// on machines without torch's CUDA headers or a GPU.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime_api.h>

#include "mtraining/pattern.h"  // the striping arithmetic and MT_HOST_DEVICE

namespace mtr {

// Head dims above this are wide (256): a thread cannot hold two 16-row output slices or dK and dV
// whole, nor an sm_80 CTA two pipeline stages of their tiles, so the kernels take narrower
// configurations there (launch.cuh, key_kernel.cuh, warp_mma.cuh).
constexpr int kMaxNarrowHeadDim = 128;

enum class DType { kBF16, kFP16 };

struct AttentionParams {
    // Inputs: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (contiguous, bf16 or fp16).
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    // Backward inputs: dout [B, Sq, H, D] (q's dtype), the final out (fp32 in out_in, or q's dtype
    // in out_in_q_dtype: one of them is set) and lse [B, H, Sq].
    const void* dout = nullptr;
    const float* out_in = nullptr;
    const void* out_in_q_dtype = nullptr;
    const float* lse_in = nullptr;

    // Forward outputs: out fp32 [B, Sq, H, D], lse fp32 [B, H, Sq]. merge_out: they hold the
    // running result of earlier calls (other keys, same queries), which the epilogue merges into.
    // out_q_dtype: out in q's dtype there instead; with merge_out the merged one, `out` (the
    // running one) being read and not written.
    float* out = nullptr;
    void* out_q_dtype = nullptr;
    float* lse = nullptr;
    bool merge_out = false;
    // Backward outputs (fp32): dq [B, Sq, H, D], dk/dv [B, Sk, Hkv, D]. accumulate_dq: dq holds a
    // running sum that the epilogue adds into. dq_q_dtype: dq in q's dtype there instead; with
    // accumulate_dq the sum, `dq` (the running one) being read and not written.
    float* dq = nullptr;
    void* dq_q_dtype = nullptr;
    bool accumulate_dq = false;
    float* dk = nullptr;
    float* dv = nullptr;
    // Backward scratch: delta [B, H, Sq] (delta_given: the caller's, already computed: not
    // recomputed); vertical-column dK/dV per query-block chunk and query
    // head [vertical_chunks(query blocks), B, H, Lv, D].
    float* delta = nullptr;
    bool delta_given = false;
    float* vertical_dk = nullptr;
    float* vertical_dv = nullptr;

    // The compact index (see docs/KERNEL_CONTRACT.md): slash [B, H, Ls], vertical [B, H, Lv].
    const int* slash = nullptr;
    const int* slash_count = nullptr;
    const int* vertical = nullptr;
    const int* vertical_count = nullptr;
    // Document masking: int32 [B, Sq * world], the global position of the first token of each
    // global token's document (docs/KERNEL_CONTRACT.md); nullptr: none.
    const int* doc_start = nullptr;

    // Per-call lists derived on the GPU by build_step_index (scratch, [B, H, Ls] / [B, H, Lv]):
    // local_offsets: sorted local block offsets o (query block i reads key block i - o);
    // local_keys: sorted local key indices of this call's key rank that are vertical columns.
    int* local_offsets = nullptr;
    int* num_offsets = nullptr;
    int* local_keys = nullptr;
    int* num_keys = nullptr;

    int batch = 0, heads = 0, kv_heads = 0, seq_q = 0, seq_k = 0, head_dim = 0, block_size = 0;
    int slash_len = 0, vertical_len = 0;
    float scale = 0.f;
    float softcap = 0.f;  // > 0: logits softcap * tanh(scale q.k / softcap) (softmax.cuh's Logits)
    int world = 1, q_rank = 0, k_rank = 0;
    // The query-side kernels (forward, dQ) at block 128 on the wgmma path: warp-specialised
    // (specialized_query_kernel.cuh, the default there) or one warpgroup per CTA (query_kernel.cuh;
    // test/debug override DS_MTRAINING_CUDA_QUERY=plain). Set by the binding's
    // choose_kernel_paths; results are the same.
    bool specialized_query = false;
    // The tensor-core path: wgmma (sm_90a kernels, set by the binding on compute capability 9.x)
    // or mma.sync. Test/debug override DS_MTRAINING_CUDA_MMA=warp: mma.sync on Hopper.
    bool warpgroup_mma = false;
    // TMA (sm_90a kernels): encode_tensor_maps sets `tma` and these views of q, k, v and dout
    // (dout only when set) as [rows = batch x seq][heads][D]; the kernels then copy whole 64-row
    // tiles of contiguous rows with them. Test/debug override DS_MTRAINING_CUDA_TMA=0: cp.async for
    // every tile.
    bool tma = false;
    CUtensorMap q_map{}, k_map{}, v_map{}, dout_map{};
};

// Encodes the tensor maps of q, k, v (and dout when params.dout is set) and sets params.tma
// (tensor_maps.cu). Needs compute capability 9.0 or later.
cudaError_t encode_tensor_maps(AttentionParams& params, DType dtype);

// Derives local_offsets/num_offsets and local_keys/num_keys from the compact index.
cudaError_t build_step_index(const AttentionParams& params, cudaStream_t stream);

// Forward: out, lse. Backward: dq, dk, dv (uses delta/vertical_dk/vertical_dv as scratch); with
// a dq_stream (not nullptr) dQ runs there, beside dK/dV, and `stream` waits for it.
// Both expect build_step_index to have run on the same stream with the same params.
// Instantiated for the (dtype, head_dim) pairs of kernel_instances.h, one file each under
// instantiations/ (generate_kernels.py writes them).
template <DType dtype, int kHeadDim>
cudaError_t run_forward(const AttentionParams& params, cudaStream_t stream);

template <DType dtype, int kHeadDim>
cudaError_t run_backward(const AttentionParams& params, cudaStream_t stream, cudaStream_t dq_stream = nullptr);

// delta = rowsum(dout * out) into params.delta (reads dout, out_in or out_in_q_dtype, batch, seq_q,
// heads); run_backward runs it first unless delta_given.
template <DType dtype, int kHeadDim>
cudaError_t run_delta(const AttentionParams& params, cudaStream_t stream);

// The vertical dK/dV pass splits each column tile's query blocks into chunks of this many, so
// that no CTA loops over the whole sequence (the tiles of sink columns would otherwise dominate).
constexpr int kVerticalChunkBlocks = 64;
MT_HOST_DEVICE inline int vertical_chunks(int query_blocks) { return (query_blocks + kVerticalChunkBlocks - 1) / kVerticalChunkBlocks; }

// Largest number of local key blocks the kernels' shared-memory bitmap of offsets supports.
constexpr int kMaxLocalBlocks = 1 << 17;

}  // namespace mtr
