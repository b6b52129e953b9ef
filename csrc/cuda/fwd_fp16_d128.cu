// Instantiation: run_forward for fp16, head_dim 128.
#include "launch.cuh"

namespace mtr {
template cudaError_t run_forward<DType::kFP16, 128>(const AttentionParams&, cudaStream_t);
}  // namespace mtr
