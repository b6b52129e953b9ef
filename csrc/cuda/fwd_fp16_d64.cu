// Instantiation: run_forward for fp16, head_dim 64.
#include "launch.cuh"

namespace mtr {
template cudaError_t run_forward<DType::kFP16, 64>(const AttentionParams&, cudaStream_t);
}  // namespace mtr
