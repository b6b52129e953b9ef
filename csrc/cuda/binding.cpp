// Torch binding of the CUDA sparse attention kernels (docs/KERNEL_CONTRACT.md): tensor checks,
// output and scratch allocation, then raw pointers, sizes and the current stream to the kernels
// (which include no ATen header). Exposes forward, backward, step_index (the per-call index
// lists, for tests and the benchmark) and kernel_paths (which kernels a call takes).
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>

#include "mtraining/checks.h"
#include "params.h"

namespace mtraining {
namespace {

constexpr const char* kOpName = "mtraining_cuda";

void check_status(cudaError_t status, const char* what) {
    TORCH_CHECK(status == cudaSuccess, kOpName, ": ", what, " failed: ", cudaGetErrorString(status));
}

// The kernels copy 16-byte chunks (cp.async, TMA), so a contiguous tensor must start on a 16-byte
// boundary; a view that does not (e.g. a slice of a larger buffer) is copied first.
at::Tensor contiguous_aligned(const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// The per-call lists build_step_index fills, kept alive for the kernels that read them.
struct StepLists {
    at::Tensor local_offsets, num_offsets, local_keys, num_keys;
};

// The index part of the params, shared by the kernels and step_index: the contiguous compact lists
// [batch, heads, n] in, freshly allocated per-call lists out, the block size and the ring position.
StepLists set_index_params(mtr::AttentionParams& p, const at::Tensor& slash, const at::Tensor& slash_count,
                           const at::Tensor& vertical, const at::Tensor& vertical_count, int64_t block,
                           int64_t world, int64_t q_rank, int64_t k_rank) {
    const StepLists lists{at::empty_like(slash), at::empty_like(slash_count), at::empty_like(vertical),
                          at::empty_like(vertical_count)};
    p.slash = slash.data_ptr<int32_t>();
    p.slash_count = slash_count.data_ptr<int32_t>();
    p.vertical = vertical.data_ptr<int32_t>();
    p.vertical_count = vertical_count.data_ptr<int32_t>();
    p.local_offsets = lists.local_offsets.data_ptr<int32_t>();
    p.num_offsets = lists.num_offsets.data_ptr<int32_t>();
    p.local_keys = lists.local_keys.data_ptr<int32_t>();
    p.num_keys = lists.num_keys.data_ptr<int32_t>();
    p.batch = static_cast<int>(slash.size(0));
    p.heads = static_cast<int>(slash.size(1));
    p.block_size = static_cast<int>(block);
    p.slash_len = static_cast<int>(slash.size(2));
    p.vertical_len = static_cast<int>(vertical.size(2));
    p.world = static_cast<int>(world);
    p.q_rank = static_cast<int>(q_rank);
    p.k_rank = static_cast<int>(k_rank);
    return lists;
}

// Which kernels run on `device`: wgmma (sm_90a) on compute capability 9.x, unless
// DS_MTRAINING_CUDA_MMA=warp forces mma.sync; on the wgmma path TMA copies contiguous tiles unless
// DS_MTRAINING_CUDA_TMA=0 (the benchmark compares all three).
struct KernelPaths {
    bool warpgroup_mma;
    bool tma;
};

KernelPaths kernel_paths_for(int device) {
    const char* mma = std::getenv("DS_MTRAINING_CUDA_MMA");
    const char* tma = std::getenv("DS_MTRAINING_CUDA_TMA");
    const bool warpgroup = at::cuda::getDeviceProperties(device)->major == 9 && !(mma && std::string(mma) == "warp");
    return {warpgroup, warpgroup && !(tma && std::string(tma) == "0")};
}

// One call of the kernels: its inputs (contiguous, q/k/v 16-byte aligned), the per-call lists, the
// kernel paths of its device and the params pointing at all of them.
struct Call {
    at::Tensor q, k, v, slash, slash_count, vertical, vertical_count;
    StepLists lists;
    KernelPaths paths;
    mtr::AttentionParams p;
};

// Checks a call (shared with the CPU op), then the CUDA-only limits, and fills the params.
Call prepare_call(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& slash_in,
                  const at::Tensor& slash_count_in, const at::Tensor& vertical_in,
                  const at::Tensor& vertical_count_in, int64_t block, double scale, int64_t world, int64_t q_rank,
                  int64_t k_rank) {
    Call call{contiguous_aligned(q_in), contiguous_aligned(k_in),    contiguous_aligned(v_in),
              slash_in.contiguous(),    slash_count_in.contiguous(), vertical_in.contiguous(),
              vertical_count_in.contiguous(), {}, {}, {}};
    const at::Tensor &q = call.q, &k = call.k, &v = call.v;
    const Geometry geo = check_call(q, k, v, call.slash, call.slash_count, call.vertical, call.vertical_count, block,
                                    scale, world, q_rank, k_rank, c10::DeviceType::CUDA, kOpName);
    TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, kOpName,
                     ": the CUDA kernels take bfloat16 or float16 q/k/v, got ", text(q.scalar_type()),
                     "; cast them (float32 runs on the CPU op)");
    TORCH_CHECK_VALUE(q.size(3) == 64 || q.size(3) == 128, kOpName, ": head_dim must be 64 or 128, got ",
                      text(q.size(3)));
    TORCH_CHECK_VALUE(block == 64 || block == 128, kOpName, ": block_size must be 64 or 128, got ", text(block));
    TORCH_CHECK_VALUE(q.size(1) >= 1, kOpName, ": the sequence is empty");
    TORCH_CHECK_VALUE(std::max(geo.q_blocks, geo.k_blocks) <= mtr::kMaxLocalBlocks, kOpName, ": ",
                      text(std::max(geo.q_blocks, geo.k_blocks)), " local blocks exceed the kernels' limit of ",
                      text(mtr::kMaxLocalBlocks), "; use a larger block_size or more ranks");
    TORCH_CHECK_VALUE(q.numel() < (int64_t{1} << 31) * 64, kOpName, ": q is too large");
    for (const at::Tensor* t :
         {&call.q, &call.k, &call.v, &call.slash, &call.slash_count, &call.vertical, &call.vertical_count})
        TORCH_CHECK_VALUE(t->is_contiguous(), kOpName, ": inputs must be contiguous (the caller makes them so)");

    mtr::AttentionParams& p = call.p;
    call.lists = set_index_params(p, call.slash, call.slash_count, call.vertical, call.vertical_count, block, world,
                                  q_rank, k_rank);
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.kv_heads = static_cast<int>(k.size(2));
    p.seq_q = static_cast<int>(q.size(1));
    p.seq_k = static_cast<int>(k.size(1));
    p.head_dim = static_cast<int>(q.size(3));
    p.scale = static_cast<float>(scale);
    if (const char* rows = std::getenv("DS_MTRAINING_CUDA_FORWARD_ROWS")) p.forward_rows_per_warp = std::atoi(rows);
    call.paths = kernel_paths_for(q.get_device());
    p.warpgroup_mma = call.paths.warpgroup_mma;
    return call;
}

template <typename Run>
cudaError_t dispatch(const at::Tensor& q, Run run) {
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    const bool d64 = q.size(3) == 64;
    if (bf16) return d64 ? run(std::integral_constant<mtr::DType, mtr::DType::kBF16>{}, std::integral_constant<int, 64>{})
                         : run(std::integral_constant<mtr::DType, mtr::DType::kBF16>{}, std::integral_constant<int, 128>{});
    return d64 ? run(std::integral_constant<mtr::DType, mtr::DType::kFP16>{}, std::integral_constant<int, 64>{})
               : run(std::integral_constant<mtr::DType, mtr::DType::kFP16>{}, std::integral_constant<int, 128>{});
}

// Runs a prepared call on the current stream: the TMA tensor maps (when this device's path uses
// TMA), the per-call lists, then the forward or the backward kernels. The outputs (and, in the
// backward, dout and the scratch) must be set in call.p.
void launch(Call& call, bool backward) {
    mtr::AttentionParams& p = call.p;
    if (call.paths.tma) {
        const mtr::DType dtype = call.q.scalar_type() == at::kBFloat16 ? mtr::DType::kBF16 : mtr::DType::kFP16;
        check_status(mtr::encode_tensor_maps(p, dtype), "encoding the TMA tensor maps of q/k/v/dout");
    }
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    check_status(mtr::build_step_index(p, stream), "build_step_index");
    check_status(dispatch(call.q, [&](auto dtype, auto dim) {
                     constexpr mtr::DType kType = decltype(dtype)::value;
                     constexpr int kDim = decltype(dim)::value;
                     return backward ? mtr::run_backward<kType, kDim>(p, stream)
                                     : mtr::run_forward<kType, kDim>(p, stream);
                 }),
                 backward ? "backward" : "forward");
}

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& slash, const at::Tensor& slash_count,
                                const at::Tensor& vertical, const at::Tensor& vertical_count, int64_t block,
                                double scale, int64_t world, int64_t q_rank, int64_t k_rank) {
    const c10::cuda::OptionalCUDAGuard guard(q.device());
    Call call =
        prepare_call(q, k, v, slash, slash_count, vertical, vertical_count, block, scale, world, q_rank, k_rank);
    const auto float_options = call.q.options().dtype(at::kFloat);
    at::Tensor out = at::empty(call.q.sizes(), float_options);
    at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, float_options);
    call.p.out = out.data_ptr<float>();
    call.p.lse = lse.data_ptr<float>();
    launch(call, false);
    return {out, lse};
}

std::vector<at::Tensor> backward(const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out_in, const at::Tensor& lse_in,
                                 const at::Tensor& slash, const at::Tensor& slash_count,
                                 const at::Tensor& vertical, const at::Tensor& vertical_count, int64_t block,
                                 double scale, int64_t world, int64_t q_rank, int64_t k_rank) {
    const c10::cuda::OptionalCUDAGuard guard(q.device());
    Call call =
        prepare_call(q, k, v, slash, slash_count, vertical, vertical_count, block, scale, world, q_rank, k_rank);
    check_backward_tensors(call.q, dout_in, out_in, lse_in, kOpName);
    const at::Tensor dout = contiguous_aligned(dout_in.to(q.scalar_type()));
    const at::Tensor out = out_in.to(at::kFloat).contiguous();
    const at::Tensor lse = lse_in.contiguous();
    const auto float_options = call.q.options().dtype(at::kFloat);
    at::Tensor dq = at::empty(q.sizes(), float_options);
    at::Tensor dk = at::empty(k.sizes(), float_options);
    at::Tensor dv = at::empty(v.sizes(), float_options);
    at::Tensor delta = at::empty({q.size(0), q.size(2), q.size(1)}, float_options);
    const int query_blocks = static_cast<int>((q.size(1) + block - 1) / block);
    const std::vector<int64_t> partial_shape = {mtr::vertical_chunks(query_blocks), q.size(0), q.size(2),
                                                vertical.size(2), q.size(3)};
    at::Tensor vertical_dk = at::empty(partial_shape, float_options);
    at::Tensor vertical_dv = at::empty(partial_shape, float_options);
    mtr::AttentionParams& p = call.p;
    p.dout = dout.data_ptr();
    p.out_in = out.data_ptr<float>();
    p.lse_in = lse.data_ptr<float>();
    p.dq = dq.data_ptr<float>();
    p.dk = dk.data_ptr<float>();
    p.dv = dv.data_ptr<float>();
    p.delta = delta.data_ptr<float>();
    p.vertical_dk = vertical_dk.data_ptr<float>();
    p.vertical_dv = vertical_dv.data_ptr<float>();
    launch(call, true);
    return {dq, dk, dv};
}

// The per-call lists for (q_rank, k_rank): (local_offsets, num_offsets, local_keys, num_keys).
std::vector<at::Tensor> step_index(const at::Tensor& slash, const at::Tensor& slash_count, const at::Tensor& vertical,
                                   const at::Tensor& vertical_count, int64_t block, int64_t seq_k, int64_t world,
                                   int64_t q_rank, int64_t k_rank) {
    TORCH_CHECK_VALUE(slash.is_cuda() && slash.dim() == 3 && vertical.dim() == 3, kOpName,
                      ": step_index takes CUDA int32 lists [batch, heads, n]");
    const c10::cuda::OptionalCUDAGuard guard(slash.device());
    const int64_t batch = slash.size(0), heads = slash.size(1);
    check_list(slash, slash_count, "slash", batch, heads, slash.device(), kOpName);
    check_list(vertical, vertical_count, "vertical", batch, heads, slash.device(), kOpName);
    TORCH_CHECK_VALUE(world >= 1 && 0 <= q_rank && q_rank < world && 0 <= k_rank && k_rank < world && block >= 1,
                      kOpName, ": need block >= 1, world >= 1 and ranks in [0, world)");
    const at::Tensor s = slash.contiguous(), sc = slash_count.contiguous();
    const at::Tensor vt = vertical.contiguous(), vc = vertical_count.contiguous();
    mtr::AttentionParams p;
    const StepLists lists = set_index_params(p, s, sc, vt, vc, block, world, q_rank, k_rank);
    p.seq_k = static_cast<int>(seq_k);
    check_status(mtr::build_step_index(p, c10::cuda::getCurrentCUDAStream().stream()), "build_step_index");
    return {lists.local_offsets, lists.num_offsets, lists.local_keys, lists.num_keys};
}

// The kernel paths a call on CUDA device `device` takes: {"tensor_cores": "wgmma" | "mma.sync", "tma": bool}.
py::dict kernel_paths(int64_t device) {
    const KernelPaths paths = kernel_paths_for(static_cast<int>(device));
    py::dict result;
    result["tensor_cores"] = paths.warpgroup_mma ? "wgmma" : "mma.sync";
    result["tma"] = paths.tma;
    return result;
}

}  // namespace
}  // namespace mtraining

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &mtraining::forward, "sparse attention forward -> (out fp32, lse fp32)", py::arg("q"),
          py::arg("k"), py::arg("v"), py::arg("slash"), py::arg("slash_count"), py::arg("vertical"),
          py::arg("vertical_count"), py::arg("block_size"), py::arg("scale"), py::arg("world"), py::arg("q_rank"),
          py::arg("k_rank"));
    m.def("backward", &mtraining::backward, "sparse attention backward -> (dq, dk, dv) fp32", py::arg("dout"),
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("slash"),
          py::arg("slash_count"), py::arg("vertical"), py::arg("vertical_count"), py::arg("block_size"),
          py::arg("scale"), py::arg("world"), py::arg("q_rank"), py::arg("k_rank"));
    m.def("kernel_paths", &mtraining::kernel_paths, "the tensor-core path and TMA use of a call on a device",
          py::arg("device"));
    m.def("step_index", &mtraining::step_index,
          "per-call lists -> (local_offsets, num_offsets, local_keys, num_keys)", py::arg("slash"),
          py::arg("slash_count"), py::arg("vertical"), py::arg("vertical_count"), py::arg("block_size"),
          py::arg("seq_k"), py::arg("world"), py::arg("q_rank"), py::arg("k_rank"));
}
