// Host side of the TMA copies: tensor maps (CUtensorMap) of q, k, v and dout for the sm_90a
// kernels. A tensor [batch, seq, heads, D] is viewed as [rows = batch x seq][heads][D], and a
// copy moves a box of 64 rows x 1 head x 64 elements (128 bytes a row) into one column atom of
// the 128-byte-swizzle tile layout (warpgroup_mma.cuh). The driver's encoder is fetched through
// the runtime, so nothing links against libcuda.
#include <cudaTypedefs.h>

#include "params.h"

namespace mtr {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
        void* function = nullptr;
        cudaDriverEntryPointQueryResult found;
        const cudaError_t status =
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found);
        return status == cudaSuccess && found == cudaDriverEntryPointSuccess
                   ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function)
                   : nullptr;
    }();
    return encoder;
}

cudaError_t encode_rows(CUtensorMap& map, const void* data, DType dtype, int batch, int seq, int heads, int head_dim) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == nullptr) return cudaErrorNotSupported;
    constexpr cuuint64_t kElementBytes = 2;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                                static_cast<cuuint64_t>(batch) * seq};
    const cuuint64_t strides[2] = {kElementBytes * head_dim, kElementBytes * head_dim * heads};  // bytes, dims 1 and 2
    const cuuint32_t box[3] = {64, 1, 64};
    const cuuint32_t element_strides[3] = {1, 1, 1};
    const CUresult result =
        encode(&map, dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
               const_cast<void*>(data), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

cudaError_t encode_tensor_maps(AttentionParams& p, DType dtype) {
    p.tma = false;
    cudaError_t status = encode_rows(p.q_map, p.q, dtype, p.batch, p.seq_q, p.heads, p.head_dim);
    if (status == cudaSuccess) status = encode_rows(p.k_map, p.k, dtype, p.batch, p.seq_k, p.kv_heads, p.head_dim);
    if (status == cudaSuccess) status = encode_rows(p.v_map, p.v, dtype, p.batch, p.seq_k, p.kv_heads, p.head_dim);
    if (status == cudaSuccess && p.dout != nullptr)
        status = encode_rows(p.dout_map, p.dout, dtype, p.batch, p.seq_q, p.heads, p.head_dim);
    p.tma = status == cudaSuccess;
    return status;
}

}  // namespace mtr
