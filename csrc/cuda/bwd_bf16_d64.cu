// Instantiation: run_backward and run_delta for bf16, head_dim 64.
#include "launch.cuh"

namespace mtr {
template cudaError_t run_backward<DType::kBF16, 64>(const AttentionParams&, cudaStream_t, cudaStream_t);
template cudaError_t run_delta<DType::kBF16, 64>(const AttentionParams&, cudaStream_t);
}  // namespace mtr
