// Torch binding of the CUDA sparse attention kernels (docs/KERNEL_CONTRACT.md): tensor checks,
// output and scratch allocation, then raw pointers, sizes and the current stream to the kernels
// (which include no ATen header). Exposes forward, backward, delta, step_index (the per-call index
// lists, for tests and the benchmark), kernel_paths (which kernels a call takes) and
// reload_kernel_options.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

#include "mtraining/checks.h"
#include "estimator/estimate.h"
#include "mtraining/op_index.h"
#include "heuristics.h"
#include "kernel_instances.h"
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
StepLists set_index_params(mtr::AttentionParams& p, const OpIndex& index) {
    const StepLists lists{at::empty_like(index.slash), at::empty_like(index.slash_count),
                          at::empty_like(index.vertical), at::empty_like(index.vertical_count)};
    p.slash = index.slash.data_ptr<int32_t>();
    p.slash_count = index.slash_count.data_ptr<int32_t>();
    p.vertical = index.vertical.data_ptr<int32_t>();
    p.vertical_count = index.vertical_count.data_ptr<int32_t>();
    p.doc_start = index.doc_start.numel() == 0 ? nullptr : index.doc_start.data_ptr<int32_t>();
    p.local_offsets = lists.local_offsets.data_ptr<int32_t>();
    p.num_offsets = lists.num_offsets.data_ptr<int32_t>();
    p.local_keys = lists.local_keys.data_ptr<int32_t>();
    p.num_keys = lists.num_keys.data_ptr<int32_t>();
    p.batch = static_cast<int>(index.slash.size(0));
    p.heads = static_cast<int>(index.slash.size(1));
    p.block_size = static_cast<int>(index.block_size);
    p.slash_len = static_cast<int>(index.slash.size(2));
    p.vertical_len = static_cast<int>(index.vertical.size(2));
    p.world = static_cast<int>(index.world);
    p.q_rank = static_cast<int>(index.q_rank);
    p.k_rank = static_cast<int>(index.k_rank);
    return lists;
}

using mtr::KernelOverrides;
using mtr::KernelPaths;

// The overrides of heuristics.h's choice, read at the module's first forward, backward or
// kernel_paths call, and again only by reload_kernel_options: every call in between takes the
// same kernels.
bool env_is(const char* name, const char* value) {
    const char* set = std::getenv(name);
    return set != nullptr && std::string(set) == value;
}

KernelOverrides read_kernel_overrides() {
    const char* query = std::getenv("DS_MTRAINING_CUDA_QUERY");
    const std::string query_kernel = query != nullptr ? query : "";
    TORCH_CHECK_VALUE(query_kernel.empty() || query_kernel == "plain" || query_kernel == "specialized",
                      "DS_MTRAINING_CUDA_QUERY must be plain or specialized (the default), got '", query_kernel, "'");
    return {env_is("DS_MTRAINING_CUDA_MMA", "warp"), env_is("DS_MTRAINING_CUDA_TMA", "0"),
            env_is("DS_MTRAINING_CUDA_CONCURRENT_DQ", "0"), query_kernel == "plain"};
}

std::mutex kernel_overrides_mutex;
std::optional<KernelOverrides> kernel_overrides_read;

KernelOverrides kernel_overrides() {
    const std::lock_guard<std::mutex> lock(kernel_overrides_mutex);
    if (!kernel_overrides_read) kernel_overrides_read = read_kernel_overrides();
    return *kernel_overrides_read;
}

void reload_kernel_options() {
    const std::lock_guard<std::mutex> lock(kernel_overrides_mutex);
    kernel_overrides_read = read_kernel_overrides();
}

// The kernel paths of a call on `device` (heuristics.h).
KernelPaths kernel_paths_for(int device) {
    return mtr::choose_kernel_paths(at::cuda::getDeviceProperties(device)->major, kernel_overrides());
}

// One error naming the head dims the kernels are instantiated for.
void check_kernel_head_dim(int64_t head_dim) {
    std::string dims;
    for (const int dim : mtr::kKernelHeadDims) {
        if (dim == head_dim) return;
        dims += (dims.empty() ? "" : ", ") + std::to_string(dim);
    }
    TORCH_CHECK_VALUE(false, kOpName, ": the CUDA kernels take head_dim ", dims, ", got ", text(head_dim),
                      " (ds_mtraining.attention pads a smaller one)");
}

// One call of the kernels: its inputs (contiguous, q/k/v 16-byte aligned), the per-call lists, the
// kernel paths of its device and the params pointing at all of them.
struct Call {
    at::Tensor q, k, v;
    OpIndex index;
    StepLists lists;
    KernelPaths paths;
    mtr::AttentionParams p;
};

// Checks a call (shared with the CPU op), then the CUDA-only limits, and fills the params.
Call prepare_call(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const OpIndex& index,
                  double scale, double softcap) {
    Call call{contiguous_aligned(q_in), contiguous_aligned(k_in), contiguous_aligned(v_in), index.contiguous(),
              {}, {}, {}};
    const at::Tensor &q = call.q, &k = call.k, &v = call.v;
    const Geometry geo = check_call(q, k, v, call.index, scale, softcap, c10::DeviceType::CUDA, kOpName);
    const int64_t block = index.block_size;
    TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, kOpName,
                     ": the CUDA kernels take bfloat16 or float16 q/k/v, got ", text(q.scalar_type()),
                     "; cast them (float32 runs on the CPU op)");
    check_kernel_head_dim(q.size(3));
    TORCH_CHECK_VALUE(block == 64 || block == 128, kOpName, ": block_size must be 64 or 128, got ", text(block));
    TORCH_CHECK_VALUE(q.size(1) >= 1, kOpName, ": the sequence is empty");
    TORCH_CHECK_VALUE(std::max(geo.q_blocks, geo.k_blocks) <= mtr::kMaxLocalBlocks, kOpName, ": ",
                      text(std::max(geo.q_blocks, geo.k_blocks)), " local blocks exceed the kernels' limit of ",
                      text(mtr::kMaxLocalBlocks), "; use a larger block_size or more ranks");
    TORCH_CHECK_VALUE(q.numel() < (int64_t{1} << 31) * 64, kOpName, ": q is too large");
    for (const at::Tensor* t : {&call.q, &call.k, &call.v, &call.index.slash, &call.index.slash_count,
                                &call.index.vertical, &call.index.vertical_count, &call.index.doc_start})
        TORCH_CHECK_VALUE(t->is_contiguous(), kOpName, ": inputs must be contiguous (the caller makes them so)");

    mtr::AttentionParams& p = call.p;
    call.lists = set_index_params(p, call.index);
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.kv_heads = static_cast<int>(k.size(2));
    p.seq_q = static_cast<int>(q.size(1));
    p.seq_k = static_cast<int>(k.size(1));
    p.head_dim = static_cast<int>(q.size(3));
    p.scale = static_cast<float>(scale);
    p.softcap = static_cast<float>(softcap);
    call.paths = kernel_paths_for(q.get_device());
    p.warpgroup_mma = call.paths.warpgroup_mma;
    p.specialized_query = call.paths.query == "specialized";
    return call;
}

// run(dtype, head_dim) as integral constants, for the instantiation of q's (kernel_instances.h);
// the callers' checks (check_kernel_head_dim) leave no other.
template <typename Run>
cudaError_t dispatch(const at::Tensor& q, Run run) {
    const mtr::DType dtype = q.scalar_type() == at::kBFloat16 ? mtr::DType::kBF16 : mtr::DType::kFP16;
    const int head_dim = static_cast<int>(q.size(3));
#define MTR_DISPATCH(DTYPE, HEAD_DIM)                                                             \
    if (dtype == mtr::DType::DTYPE && head_dim == HEAD_DIM)                                        \
        return run(std::integral_constant<mtr::DType, mtr::DType::DTYPE>{}, std::integral_constant<int, HEAD_DIM>{});
    MTR_FOR_EACH_KERNEL(MTR_DISPATCH)
#undef MTR_DISPATCH
    return cudaErrorInvalidValue;
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
    // A pool stream: the tensors it touches belong to `stream`'s pool, which waits for it in run_backward.
    const cudaStream_t dq_stream = backward && call.paths.concurrent_dq
        ? c10::cuda::getStreamFromPool(false, call.q.get_device()).stream() : nullptr;
    check_status(mtr::build_step_index(p, stream), "build_step_index");
    check_status(dispatch(call.q, [&](auto dtype, auto dim) {
                     constexpr mtr::DType kType = decltype(dtype)::value;
                     constexpr int kDim = decltype(dim)::value;
                     return backward ? mtr::run_backward<kType, kDim>(p, stream, dq_stream)
                                     : mtr::run_forward<kType, kDim>(p, stream);
                 }),
                 backward ? "backward" : "forward");
}

// Points p at the final out as the backward kernels read it (out_in float32, or out_in_q_dtype
// when it is in the inputs' dtype `input`: no conversion) and returns the contiguous, 16-byte
// aligned tensor it points into (delta reads it in 16-byte chunks), which the caller keeps until
// the launch.
at::Tensor set_final_output(mtr::AttentionParams& p, const at::Tensor& out_in, at::ScalarType input) {
    const at::Tensor out = contiguous_aligned(out_in.scalar_type() == input ? out_in : out_in.to(at::kFloat));
    if (out.scalar_type() == at::kFloat) {
        p.out_in = out.data_ptr<float>();
    } else {
        p.out_in_q_dtype = out.data_ptr();
    }
    return out;
}

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OpIndex& index,
                                double scale, double softcap, const std::optional<at::Tensor>& running_out,
                                const std::optional<at::Tensor>& running_lse, bool input_dtype) {
    const c10::cuda::OptionalCUDAGuard guard(q.device());
    Call call = prepare_call(q, k, v, index, scale, softcap);
    call.p.merge_out = check_running_output(q, running_out, running_lse, kOpName);
    const auto float_options = call.q.options().dtype(at::kFloat);
    at::Tensor out = call.p.merge_out && !input_dtype
        ? *running_out : at::empty(call.q.sizes(), input_dtype ? call.q.options() : float_options);
    at::Tensor lse = call.p.merge_out ? *running_lse : at::empty({q.size(0), q.size(2), q.size(1)}, float_options);
    if (input_dtype) {
        call.p.out_q_dtype = out.data_ptr();
        if (call.p.merge_out) call.p.out = running_out->data_ptr<float>();  // read, not written
    } else {
        call.p.out = out.data_ptr<float>();
    }
    call.p.lse = lse.data_ptr<float>();
    launch(call, false);
    return {out, lse};
}

std::vector<at::Tensor> backward(const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out_in, const at::Tensor& lse_in,
                                 const OpIndex& index, double scale, double softcap,
                                 const std::optional<at::Tensor>& running_dq,
                                 const std::optional<at::Tensor>& given_delta, bool input_dtype) {
    const c10::cuda::OptionalCUDAGuard guard(q.device());
    Call call = prepare_call(q, k, v, index, scale, softcap);
    check_backward_tensors(call.q, dout_in, out_in, lse_in, kOpName);
    if (running_dq.has_value()) check_accumulator(q, *running_dq, q.sizes(), "the running dq", kOpName);
    if (given_delta.has_value()) check_accumulator(q, *given_delta, lse_in.sizes(), "delta", kOpName);
    const at::Tensor dout = contiguous_aligned(dout_in.to(q.scalar_type()));
    const at::Tensor lse = lse_in.contiguous();
    const auto float_options = call.q.options().dtype(at::kFloat);
    at::Tensor dq = running_dq.has_value() && !input_dtype
        ? *running_dq : at::empty(q.sizes(), input_dtype ? call.q.options() : float_options);
    at::Tensor dk = at::empty(k.sizes(), float_options);
    at::Tensor dv = at::empty(v.sizes(), float_options);
    const at::Tensor delta =
        given_delta.has_value() ? *given_delta : at::empty({q.size(0), q.size(2), q.size(1)}, float_options);
    const int query_blocks = static_cast<int>((q.size(1) + index.block_size - 1) / index.block_size);
    const std::vector<int64_t> partial_shape = {mtr::vertical_chunks(query_blocks), q.size(0), q.size(2),
                                                index.vertical.size(2), q.size(3)};
    at::Tensor vertical_dk = at::empty(partial_shape, float_options);
    at::Tensor vertical_dv = at::empty(partial_shape, float_options);
    mtr::AttentionParams& p = call.p;
    p.dout = dout.data_ptr();
    const at::Tensor out = set_final_output(p, out_in, q.scalar_type());
    p.lse_in = lse.data_ptr<float>();
    if (input_dtype) {
        p.dq_q_dtype = dq.data_ptr();
        if (running_dq.has_value()) p.dq = running_dq->data_ptr<float>();  // read, not written
    } else {
        p.dq = dq.data_ptr<float>();
    }
    p.accumulate_dq = running_dq.has_value();
    p.dk = dk.data_ptr<float>();
    p.dv = dv.data_ptr<float>();
    p.delta = delta.data_ptr<float>();
    p.delta_given = given_delta.has_value();
    p.vertical_dk = vertical_dk.data_ptr<float>();
    p.vertical_dv = vertical_dv.data_ptr<float>();
    launch(call, true);
    return {dq, dk, dv};
}

// delta(dout, out): rowsum(dout * out), float32 [B, H, S], by the kernel backward runs first.
at::Tensor row_delta(const at::Tensor& dout_in, const at::Tensor& out_in) {
    check_delta_inputs(dout_in, out_in, c10::DeviceType::CUDA, kOpName);
    TORCH_CHECK_TYPE(dout_in.scalar_type() == at::kBFloat16 || dout_in.scalar_type() == at::kHalf, kOpName,
                     ": delta takes bfloat16 or float16 dout (the kernels' dtypes), got ", text(dout_in.scalar_type()));
    check_kernel_head_dim(dout_in.size(3));
    const c10::cuda::OptionalCUDAGuard guard(dout_in.device());
    const at::Tensor dout = contiguous_aligned(dout_in);
    at::Tensor delta = at::empty({dout.size(0), dout.size(2), dout.size(1)}, dout.options().dtype(at::kFloat));
    mtr::AttentionParams p;
    p.dout = dout.data_ptr();
    const at::Tensor out = set_final_output(p, out_in, dout.scalar_type());
    p.delta = delta.data_ptr<float>();
    p.batch = static_cast<int>(dout.size(0));
    p.seq_q = static_cast<int>(dout.size(1));
    p.heads = static_cast<int>(dout.size(2));
    p.head_dim = static_cast<int>(dout.size(3));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    check_status(dispatch(dout, [&](auto dtype, auto dim) {
                     return mtr::run_delta<decltype(dtype)::value, decltype(dim)::value>(p, stream);
                 }),
                 "delta");
    return delta;
}

// The per-call lists of the index's (q_rank, k_rank) for seq_k local keys:
// (local_offsets, num_offsets, local_keys, num_keys).
std::vector<at::Tensor> step_index(const OpIndex& index_in, int64_t seq_k) {
    TORCH_CHECK_VALUE(index_in.slash.is_cuda() && index_in.slash.dim() == 3 && index_in.vertical.dim() == 3, kOpName,
                      ": step_index takes CUDA int32 lists [batch, heads, n]");
    const c10::cuda::OptionalCUDAGuard guard(index_in.slash.device());
    check_index(index_in, index_in.slash.size(0), index_in.slash.size(1), index_in.slash.device(), kOpName);
    const OpIndex index = index_in.contiguous();
    mtr::AttentionParams p;
    const StepLists lists = set_index_params(p, index);
    p.seq_k = static_cast<int>(seq_k);
    check_status(mtr::build_step_index(p, c10::cuda::getCurrentCUDAStream().stream()), "build_step_index");
    return {lists.local_offsets, lists.num_offsets, lists.local_keys, lists.num_keys};
}

// The kernel paths a call on CUDA device `device` takes:
// {"tensor_cores": "wgmma" | "mma.sync", "tma": bool, "concurrent_dq": bool,
//  "query": "plain" | "specialized" (block 128; block 64 takes plain)}.
py::dict kernel_paths(int64_t device) {
    const KernelPaths paths = kernel_paths_for(static_cast<int>(device));
    py::dict result;
    result["tensor_cores"] = paths.warpgroup_mma ? "wgmma" : "mma.sync";
    result["tma"] = paths.tma;
    result["concurrent_dq"] = paths.concurrent_dq;
    result["query"] = paths.query;
    return result;
}

}  // namespace
}  // namespace mtraining

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    mtraining::define_attention_ops(m, mtraining::kOpName, &mtraining::forward, &mtraining::backward,
                                    &mtraining::row_delta);
    m.def("kernel_paths", &mtraining::kernel_paths, "the tensor-core path and TMA use of a call on a device",
          py::arg("device"));
    m.def("reload_kernel_options", &mtraining::reload_kernel_options,
          "re-reads the DS_MTRAINING_CUDA_* test/debug overrides from the environment (read once otherwise)");
    m.def(
        "step_index",
        [](const py::dict& index, int64_t seq_k) {
            return mtraining::step_index(mtraining::op_index_from_python(index, mtraining::kOpName), seq_k);
        },
        "per-call lists -> (local_offsets, num_offsets, local_keys, num_keys)", py::arg("index"), py::arg("seq_k"));
    mtraining::register_estimator(m);  // estimate_binding.cpp: the fused vertical-slash estimator
}
