// Instantiation: run_backward and run_delta for fp16, head_dim 64.
#include "launch.cuh"

namespace mtr {
template cudaError_t run_backward<DType::kFP16, 64>(const AttentionParams&, cudaStream_t, cudaStream_t);
template cudaError_t run_delta<DType::kFP16, 64>(const AttentionParams&, cudaStream_t);
}  // namespace mtr
