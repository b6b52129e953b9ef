// Argument validation shared by the CPU and CUDA bindings (docs/KERNEL_CONTRACT.md).
//
// Every failure raises one Python exception naming the problem and the fix: ValueError for
// shapes, ranges and devices (TORCH_CHECK_VALUE), TypeError for dtypes (TORCH_CHECK_TYPE).
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <initializer_list>
#include <utility>

#include "mtraining/pattern.h"

namespace mtraining {

inline bool is_supported_float(at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Checks one input of layout [batch, seq, heads, head_dim].
inline void check_bshd(const at::Tensor& t, const char* name, c10::DeviceType device_type,
                       const char* op_name) {
    TORCH_CHECK_VALUE(t.defined(), op_name, ": ", name, " is undefined");
    TORCH_CHECK_VALUE(t.dim() == 4, op_name, ": ", name,
                      " must be a 4-d tensor [batch, seq, heads, head_dim], got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.device().type() == device_type, op_name, ": ", name, " is on ", t.device(),
                      " but this op runs on ", c10::DeviceTypeName(device_type),
                      " tensors; put q, k, v and the index on one device");
    TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), op_name, ": ", name, " has dtype ",
                     t.scalar_type(), "; use float32, bfloat16 or float16");
}

// Checks one index list: int32 [batch, heads, width] and its count int32 [batch, heads].
inline void check_list(const at::Tensor& list, const at::Tensor& count, const char* name,
                       int64_t batch, int64_t heads, const at::Device& device, const char* op_name) {
    TORCH_CHECK_TYPE(list.scalar_type() == at::kInt && count.scalar_type() == at::kInt, op_name,
                     ": ", name, " and ", name, "_count must be int32, got ", list.scalar_type(),
                     " and ", count.scalar_type(), " (use SparseIndex, which stores int32)");
    TORCH_CHECK_VALUE(list.dim() == 3 && list.size(0) == batch && list.size(1) == heads &&
                          list.size(2) >= 1,
                      op_name, ": ", name, " must be [batch=", batch, ", heads=", heads,
                      ", n >= 1], got ", list.sizes(),
                      "; the index was built for another shape: rebuild it from these q/k");
    TORCH_CHECK_VALUE(count.dim() == 2 && count.size(0) == batch && count.size(1) == heads,
                      op_name, ": ", name, "_count must be [batch=", batch, ", heads=", heads,
                      "], got ", count.sizes());
    TORCH_CHECK_VALUE(list.device() == device && count.device() == device, op_name, ": ", name,
                      " is on ", list.device(), " but q is on ", device,
                      "; move the index with index.to(q.device)");
}

// Validates a forward call and returns its geometry. Backward calls it too, then
// check_backward_tensors for the extra tensors.
inline Geometry check_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& slash, const at::Tensor& slash_count,
                           const at::Tensor& vertical, const at::Tensor& vertical_count,
                           int64_t block, double scale, int64_t world, int64_t q_rank,
                           int64_t k_rank, c10::DeviceType device_type, const char* op_name) {
    check_bshd(q, "q", device_type, op_name);
    check_bshd(k, "k", device_type, op_name);
    check_bshd(v, "v", device_type, op_name);
    TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), op_name,
                      ": q, k, v must be on one device, got ", q.device(), ", ", k.device(), ", ",
                      v.device());
    TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                     op_name, ": q, k, v must share a dtype, got ", q.scalar_type(), ", ",
                     k.scalar_type(), ", ", v.scalar_type());
    TORCH_CHECK_VALUE(k.sizes() == v.sizes(), op_name, ": k ", k.sizes(), " and v ", v.sizes(),
                      " must have the same shape");
    TORCH_CHECK_VALUE(q.size(0) == k.size(0) && q.size(3) == k.size(3), op_name, ": q ", q.sizes(),
                      " and k ", k.sizes(),
                      " must share batch and head_dim (layout [batch, seq, heads, head_dim])");
    TORCH_CHECK_VALUE(k.size(2) >= 1 && q.size(2) % k.size(2) == 0, op_name, ": query heads (",
                      q.size(2), ") must be a multiple of key/value heads (", k.size(2),
                      ") for GQA");
    TORCH_CHECK_VALUE(q.size(3) >= 1, op_name, ": head_dim must be >= 1");
    TORCH_CHECK_VALUE(block >= 1, op_name, ": block_size must be >= 1, got ", block);
    TORCH_CHECK_VALUE(std::isfinite(scale), op_name, ": scale must be finite, got ", scale);
    TORCH_CHECK_VALUE(world >= 1 && 0 <= q_rank && q_rank < world && 0 <= k_rank && k_rank < world,
                      op_name, ": need world >= 1 and 0 <= q_rank, k_rank < world, got world=",
                      world, ", q_rank=", q_rank, ", k_rank=", k_rank);
    TORCH_CHECK_VALUE(q.size(1) == k.size(1), op_name, ": q has ", q.size(1), " tokens but k has ",
                      k.size(1), "; queries and keys must be the same length");
    TORCH_CHECK_VALUE(world == 1 || q.size(1) % block == 0, op_name,
                      ": with striping (world=", world, ") the local length ", q.size(1),
                      " must be a multiple of block_size=", block,
                      "; pad the sequence to world * block_size tokens");
    const int64_t batch = q.size(0), heads = q.size(2);
    check_list(slash, slash_count, "slash", batch, heads, q.device(), op_name);
    check_list(vertical, vertical_count, "vertical", batch, heads, q.device(), op_name);

    Geometry geo;
    geo.block = block;
    geo.world = world;
    geo.q_rank = q_rank;
    geo.k_rank = k_rank;
    geo.q_len = q.size(1);
    geo.k_len = k.size(1);
    geo.q_blocks = (geo.q_len + block - 1) / block;
    geo.k_blocks = (geo.k_len + block - 1) / block;
    return geo;
}

// Validates the tensors that only backward takes.
inline void check_backward_tensors(const at::Tensor& q, const at::Tensor& dout,
                                   const at::Tensor& out, const at::Tensor& lse,
                                   const char* op_name) {
    for (const auto& [tensor, name] :
         {std::pair<const at::Tensor&, const char*>{dout, "dout"}, {out, "out"}}) {
        TORCH_CHECK_VALUE(tensor.defined() && tensor.sizes() == q.sizes(), op_name, ": ", name,
                          " must have q's shape ", q.sizes(), ", got ",
                          tensor.defined() ? tensor.sizes() : at::IntArrayRef{});
        TORCH_CHECK_TYPE(is_supported_float(tensor.scalar_type()), op_name, ": ", name,
                         " has dtype ", tensor.scalar_type(), "; use float32, bfloat16 or float16");
        TORCH_CHECK_VALUE(tensor.device() == q.device(), op_name, ": ", name, " is on ",
                          tensor.device(), " but q is on ", q.device());
    }
    TORCH_CHECK_VALUE(lse.defined() && lse.dim() == 3 && lse.size(0) == q.size(0) &&
                          lse.size(1) == q.size(2) && lse.size(2) == q.size(1),
                      op_name, ": lse must be [batch, heads, seq] = [", q.size(0), ", ", q.size(2),
                      ", ", q.size(1), "], got ", lse.defined() ? lse.sizes() : at::IntArrayRef{});
    TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, op_name,
                     ": lse must be float32 (as forward returns it), got ", lse.scalar_type());
    TORCH_CHECK_VALUE(lse.device() == q.device(), op_name, ": lse is on ", lse.device(),
                      " but q is on ", q.device());
}

// Validates the contents of host-resident index lists: counts in range, diagonal 0 present,
// entries strictly ascending and inside the global sequence. O(batch * heads * width).
inline void check_list_contents(const Geometry& geo, const at::Tensor& slash,
                                const at::Tensor& slash_count, const at::Tensor& vertical,
                                const at::Tensor& vertical_count, const char* op_name) {
    const int64_t global_len = geo.world == 1 ? geo.q_len : geo.q_len * geo.world;
    const int64_t global_blocks = (global_len + geo.block - 1) / geo.block;
    const int64_t rows = slash_count.numel();
    const int64_t slash_width = slash.size(2), vertical_width = vertical.size(2);
    const auto slash_c = slash.contiguous(), vertical_c = vertical.contiguous();
    const auto slash_n = slash_count.contiguous(), vertical_n = vertical_count.contiguous();
    const int32_t* s = slash_c.data_ptr<int32_t>();
    const int32_t* vt = vertical_c.data_ptr<int32_t>();
    const int32_t* sn = slash_n.data_ptr<int32_t>();
    const int32_t* vn = vertical_n.data_ptr<int32_t>();
    for (int64_t row = 0; row < rows; ++row) {
        const int32_t* list = s + row * slash_width;
        TORCH_CHECK_VALUE(sn[row] >= 1 && sn[row] <= slash_width && list[0] == 0, op_name,
                          ": slash list ", row, " must start with diagonal 0 and hold 1..",
                          slash_width, " entries (count ", sn[row], "); build it with SparseIndex");
        for (int64_t e = 1; e < sn[row]; ++e)
            TORCH_CHECK_VALUE(list[e] > list[e - 1], op_name, ": slash list ", row,
                              " is not strictly ascending; build it with SparseIndex");
        TORCH_CHECK_VALUE(list[sn[row] - 1] < global_blocks, op_name, ": slash diagonal ",
                          list[sn[row] - 1], " is beyond the ", global_blocks,
                          " blocks of the sequence; the index was built for another length");
        const int32_t* cols = vt + row * vertical_width;
        TORCH_CHECK_VALUE(vn[row] >= 0 && vn[row] <= vertical_width, op_name,
                          ": vertical_count ", vn[row], " is outside [0, ", vertical_width, "]");
        for (int64_t e = 0; e < vn[row]; ++e)
            TORCH_CHECK_VALUE(cols[e] >= 0 && cols[e] < global_len && (e == 0 || cols[e] > cols[e - 1]),
                              op_name, ": vertical list ", row,
                              " must be strictly ascending key positions in [0, ", global_len,
                              "); the index was built for another length or is not sorted");
    }
}

}  // namespace mtraining
