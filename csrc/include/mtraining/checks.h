// Argument validation shared by the CPU and CUDA bindings (docs/KERNEL_CONTRACT.md).
//
// Every failure raises one Python exception naming the problem and the fix: ValueError for
// shapes, ranges and devices (TORCH_CHECK_VALUE), TypeError for dtypes (TORCH_CHECK_TYPE).
// Messages are assembled from strings only: numbers, shapes and devices go through text() first.
#pragma once

#include <ATen/ATen.h>

#include <charconv>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "mtraining/op_index.h"
#include "mtraining/pattern.h"

namespace mtraining {

// Message text of a number, shape, device or dtype, made without std::ostream.
//
// TORCH_CHECK joins its message in an ostringstream (c10::str). On the H200 image, inserting a
// number into that stream segfaulted inside libstdc++'s locale code while inserting strings
// worked (docs/CUDA_NOTES.md), so numbers reach the stream already as text. std::to_chars uses
// no locale; the output matches what the stream would print.
template <typename Integer, typename = std::enable_if_t<std::is_integral_v<Integer> &&
                                                        !std::is_same_v<Integer, bool>>>
inline std::string text(Integer value) {
    char digits[24];  // enough for any 64-bit integer with its sign
    const auto end = std::to_chars(digits, digits + sizeof(digits), value).ptr;
    return std::string(digits, end);
}

// As the stream prints a double by default: printf's %g (6 significant digits; nan, -inf).
inline std::string text(double value) {
    char digits[32];  // "-1.23457e+308" at most
    const auto end =
        std::to_chars(digits, digits + sizeof(digits), value, std::chars_format::general, 6).ptr;
    return std::string(digits, end);
}

// A shape as c10 prints it: [1, 128, 4, 64].
inline std::string text(at::IntArrayRef sizes) {
    std::string out = "[";
    for (size_t i = 0; i < sizes.size(); ++i) {
        if (i > 0) out += ", ";
        out += text(sizes[i]);
    }
    return out + "]";
}

// "cpu", "cuda:0" (Device::str() builds it with std::to_string).
inline std::string text(const at::Device& device) { return device.str(); }

// "Float", "BFloat16": the name c10 prints for a dtype.
inline const char* text(at::ScalarType type) { return c10::toString(type); }

inline bool is_supported_float(at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Checks one input of layout [batch, seq, heads, head_dim].
inline void check_bshd(const at::Tensor& t, const char* name, c10::DeviceType device_type,
                       const char* op_name) {
    TORCH_CHECK_VALUE(t.defined(), op_name, ": ", name, " is undefined");
    TORCH_CHECK_VALUE(t.dim() == 4, op_name, ": ", name,
                      " must be a 4-d tensor [batch, seq, heads, head_dim], got shape ",
                      text(t.sizes()));
    TORCH_CHECK_VALUE(t.device().type() == device_type, op_name, ": ", name, " is on ",
                      text(t.device()), " but this op runs on ", c10::DeviceTypeName(device_type),
                      " tensors; put q, k, v and the index on one device");
    TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), op_name, ": ", name, " has dtype ",
                     text(t.scalar_type()), "; use float32, bfloat16 or float16");
}

// Checks one index list: int32 [batch, heads, width] and its count int32 [batch, heads].
inline void check_list(const at::Tensor& list, const at::Tensor& count, const char* name,
                       int64_t batch, int64_t heads, const at::Device& device, const char* op_name) {
    TORCH_CHECK_TYPE(list.scalar_type() == at::kInt && count.scalar_type() == at::kInt, op_name,
                     ": ", name, " and ", name, "_count must be int32, got ",
                     text(list.scalar_type()), " and ", text(count.scalar_type()),
                     " (use SparseIndex, which stores int32)");
    TORCH_CHECK_VALUE(list.dim() == 3 && list.size(0) == batch && list.size(1) == heads &&
                          list.size(2) >= 1,
                      op_name, ": ", name, " must be [batch=", text(batch),
                      ", heads=", text(heads), ", n >= 1], got ", text(list.sizes()),
                      "; the index was built for another shape: rebuild it from these q/k");
    TORCH_CHECK_VALUE(count.dim() == 2 && count.size(0) == batch && count.size(1) == heads,
                      op_name, ": ", name, "_count must be [batch=", text(batch), ", heads=",
                      text(heads), "], got ", text(count.sizes()));
    TORCH_CHECK_VALUE(list.device() == device && count.device() == device, op_name, ": ", name,
                      " is on ", text(list.device()), " but q is on ", text(device),
                      "; move the index with index.to(q.device)");
}

// Checks the index of a call whose q has `batch` and `heads` on `device`: the block size, the
// ring position and the shapes, dtypes and device of the lists (not their contents).
inline void check_index(const OpIndex& index, int64_t batch, int64_t heads, const at::Device& device,
                        const char* op_name) {
    const int64_t world = index.world, q_rank = index.q_rank, k_rank = index.k_rank;
    TORCH_CHECK_VALUE(index.block_size >= 1, op_name, ": block_size must be >= 1, got ",
                      text(index.block_size));
    TORCH_CHECK_VALUE(world >= 1 && 0 <= q_rank && q_rank < world && 0 <= k_rank && k_rank < world,
                      op_name, ": need world >= 1 and 0 <= q_rank, k_rank < world, got world=",
                      text(world), ", q_rank=", text(q_rank), ", k_rank=", text(k_rank));
    check_list(index.slash, index.slash_count, "slash", batch, heads, device, op_name);
    check_list(index.vertical, index.vertical_count, "vertical", batch, heads, device, op_name);
}

// Checks doc_start: empty (no document masking) or int32 [batch, global_len], contiguous, on q's
// device. Its contents (a packing: ds_mtraining.documents.check_doc_start) are the caller's.
inline void check_doc_start(const at::Tensor& doc_start, int64_t batch, int64_t global_len,
                            const at::Device& device, const char* op_name) {
    TORCH_CHECK_VALUE(doc_start.defined(), op_name,
                      ": doc_start is undefined; pass an empty int32 tensor for no document masking");
    if (doc_start.numel() == 0) return;
    TORCH_CHECK_TYPE(doc_start.scalar_type() == at::kInt, op_name, ": doc_start must be int32, got ",
                     text(doc_start.scalar_type()));
    TORCH_CHECK_VALUE(doc_start.dim() == 2 && doc_start.size(0) == batch && doc_start.size(1) == global_len,
                      op_name, ": doc_start must be [batch, global seq] = [", text(batch), ", ",
                      text(global_len), "] (indexed by global position, the whole sequence on every rank), got ",
                      text(doc_start.sizes()));
    TORCH_CHECK_VALUE(doc_start.device() == device, op_name, ": doc_start is on ", text(doc_start.device()),
                      " but q is on ", text(device));
    TORCH_CHECK_VALUE(doc_start.is_contiguous(), op_name, ": doc_start must be contiguous");
}

// Validates a forward call and returns its geometry. Backward calls it too, then
// check_backward_tensors for the extra tensors.
inline Geometry check_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const OpIndex& index, double scale, double softcap, c10::DeviceType device_type,
                           const char* op_name) {
    check_bshd(q, "q", device_type, op_name);
    check_bshd(k, "k", device_type, op_name);
    check_bshd(v, "v", device_type, op_name);
    TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), op_name,
                      ": q, k, v must be on one device, got ", text(q.device()), ", ",
                      text(k.device()), ", ", text(v.device()));
    TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                     op_name, ": q, k, v must share a dtype, got ", text(q.scalar_type()), ", ",
                     text(k.scalar_type()), ", ", text(v.scalar_type()));
    TORCH_CHECK_VALUE(k.sizes() == v.sizes(), op_name, ": k ", text(k.sizes()), " and v ",
                      text(v.sizes()), " must have the same shape");
    TORCH_CHECK_VALUE(q.size(0) == k.size(0) && q.size(3) == k.size(3), op_name, ": q ",
                      text(q.sizes()), " and k ", text(k.sizes()),
                      " must share batch and head_dim (layout [batch, seq, heads, head_dim])");
    TORCH_CHECK_VALUE(k.size(2) >= 1 && q.size(2) % k.size(2) == 0, op_name, ": query heads (",
                      text(q.size(2)), ") must be a multiple of key/value heads (", text(k.size(2)),
                      ") for GQA");
    TORCH_CHECK_VALUE(q.size(3) >= 1, op_name, ": head_dim must be >= 1");
    TORCH_CHECK_VALUE(std::isfinite(scale), op_name, ": scale must be finite, got ", text(scale));
    TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0, op_name,
                      ": softcap must be finite and >= 0 (0: no logit soft-capping), got ", text(softcap));
    check_index(index, q.size(0), q.size(2), q.device(), op_name);
    const int64_t block = index.block_size, world = index.world;
    TORCH_CHECK_VALUE(q.size(1) == k.size(1), op_name, ": q has ", text(q.size(1)),
                      " tokens but k has ", text(k.size(1)),
                      "; queries and keys must be the same length");
    TORCH_CHECK_VALUE(world == 1 || q.size(1) % block == 0, op_name,
                      ": with striping (world=", text(world), ") the local length ",
                      text(q.size(1)), " must be a multiple of block_size=", text(block),
                      "; pad the sequence to world * block_size tokens");

    check_doc_start(index.doc_start, q.size(0), q.size(1) * world, q.device(), op_name);

    Geometry geo;
    geo.block = block;
    geo.world = world;
    geo.q_rank = index.q_rank;
    geo.k_rank = index.k_rank;
    geo.q_len = q.size(1);
    geo.k_len = k.size(1);
    geo.q_blocks = (geo.q_len + block - 1) / block;
    geo.k_blocks = (geo.k_len + block - 1) / block;
    return geo;
}

// Validates a float32 tensor the caller passes in for the op to add into or read (the running
// out/lse/dq of a ring's steps, a precomputed delta): float32, contiguous, `shape`, on q's device.
// `name` is how the messages call it ("the running out", "delta").
inline void check_accumulator(const at::Tensor& q, const at::Tensor& t, at::IntArrayRef shape, const char* name,
                              const char* op_name) {
    TORCH_CHECK_VALUE(t.sizes() == shape, op_name, ": ", name, " must be ", text(shape), ", got ", text(t.sizes()));
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op_name, ": ", name,
                     " must be float32 (as the ops return it), got ", text(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device() == q.device(), op_name, ": ", name, " is on ", text(t.device()), " but q is on ",
                      text(q.device()));
    TORCH_CHECK_VALUE(t.is_contiguous(), op_name, ": ", name, " must be contiguous");
}

// Forward's optional running (out, lse): both or neither, each an accumulator of its shape.
inline bool check_running_output(const at::Tensor& q, const std::optional<at::Tensor>& out,
                                 const std::optional<at::Tensor>& lse, const char* op_name) {
    TORCH_CHECK_VALUE(out.has_value() == lse.has_value(), op_name,
                      ": pass both the running out and lse (to merge this call into them) or neither");
    if (!out.has_value()) return false;
    check_accumulator(q, *out, q.sizes(), "the running out", op_name);
    check_accumulator(q, *lse, {q.size(0), q.size(2), q.size(1)}, "the running lse", op_name);
    return true;
}

// Validates delta's inputs: dout and out of one shape [batch, seq, heads, head_dim], float types,
// on one device of `device_type`.
inline void check_delta_inputs(const at::Tensor& dout, const at::Tensor& out, c10::DeviceType device_type,
                               const char* op_name) {
    check_bshd(dout, "dout", device_type, op_name);
    check_bshd(out, "out", device_type, op_name);
    TORCH_CHECK_VALUE(out.sizes() == dout.sizes(), op_name, ": out ", text(out.sizes()), " must have dout's shape ",
                      text(dout.sizes()));
    TORCH_CHECK_VALUE(out.device() == dout.device(), op_name, ": out is on ", text(out.device()), " but dout is on ",
                      text(dout.device()));
}

// Validates the tensors that only backward takes.
inline void check_backward_tensors(const at::Tensor& q, const at::Tensor& dout,
                                   const at::Tensor& out, const at::Tensor& lse,
                                   const char* op_name) {
    for (const auto& [tensor, name] :
         {std::pair<const at::Tensor&, const char*>{dout, "dout"}, {out, "out"}}) {
        TORCH_CHECK_VALUE(tensor.defined() && tensor.sizes() == q.sizes(), op_name, ": ", name,
                          " must have q's shape ", text(q.sizes()), ", got ",
                          text(tensor.defined() ? tensor.sizes() : at::IntArrayRef{}));
        TORCH_CHECK_TYPE(is_supported_float(tensor.scalar_type()), op_name, ": ", name,
                         " has dtype ", text(tensor.scalar_type()),
                         "; use float32, bfloat16 or float16");
        TORCH_CHECK_VALUE(tensor.device() == q.device(), op_name, ": ", name, " is on ",
                          text(tensor.device()), " but q is on ", text(q.device()));
    }
    TORCH_CHECK_VALUE(lse.defined() && lse.dim() == 3 && lse.size(0) == q.size(0) &&
                          lse.size(1) == q.size(2) && lse.size(2) == q.size(1),
                      op_name, ": lse must be [batch, heads, seq] = [", text(q.size(0)), ", ",
                      text(q.size(2)), ", ", text(q.size(1)), "], got ",
                      text(lse.defined() ? lse.sizes() : at::IntArrayRef{}));
    TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, op_name,
                     ": lse must be float32 (as forward returns it), got ",
                     text(lse.scalar_type()));
    TORCH_CHECK_VALUE(lse.device() == q.device(), op_name, ": lse is on ", text(lse.device()),
                      " but q is on ", text(q.device()));
}

// Validates the contents of host-resident index lists: counts in range, diagonal 0 present,
// entries strictly ascending and inside the global sequence. O(batch * heads * width).
inline void check_list_contents(const Geometry& geo, const OpIndex& index, const char* op_name) {
    const int64_t global_len = geo.world == 1 ? geo.q_len : geo.q_len * geo.world;
    const int64_t global_blocks = (global_len + geo.block - 1) / geo.block;
    const int64_t rows = index.slash_count.numel();
    const int64_t slash_width = index.slash.size(2), vertical_width = index.vertical.size(2);
    const OpIndex lists = index.contiguous();
    const int32_t* s = lists.slash.data_ptr<int32_t>();
    const int32_t* vt = lists.vertical.data_ptr<int32_t>();
    const int32_t* sn = lists.slash_count.data_ptr<int32_t>();
    const int32_t* vn = lists.vertical_count.data_ptr<int32_t>();
    for (int64_t row = 0; row < rows; ++row) {
        const int32_t* list = s + row * slash_width;
        TORCH_CHECK_VALUE(sn[row] >= 1 && sn[row] <= slash_width && list[0] == 0, op_name,
                          ": slash list ", text(row),
                          " must start with diagonal 0 and hold 1..", text(slash_width),
                          " entries (count ", text(sn[row]), "); build it with SparseIndex");
        for (int64_t e = 1; e < sn[row]; ++e)
            TORCH_CHECK_VALUE(list[e] > list[e - 1], op_name, ": slash list ", text(row),
                              " is not strictly ascending; build it with SparseIndex");
        TORCH_CHECK_VALUE(list[sn[row] - 1] < global_blocks, op_name, ": slash diagonal ",
                          text(list[sn[row] - 1]), " is beyond the ", text(global_blocks),
                          " blocks of the sequence; the index was built for another length");
        const int32_t* cols = vt + row * vertical_width;
        TORCH_CHECK_VALUE(vn[row] >= 0 && vn[row] <= vertical_width, op_name,
                          ": vertical_count ", text(vn[row]), " is outside [0, ",
                          text(vertical_width), "]");
        for (int64_t e = 0; e < vn[row]; ++e)
            TORCH_CHECK_VALUE(cols[e] >= 0 && cols[e] < global_len && (e == 0 || cols[e] > cols[e - 1]),
                              op_name, ": vertical list ", text(row),
                              " must be strictly ascending key positions in [0, ",
                              text(global_len),
                              "); the index was built for another length or is not sorted");
    }
}

}  // namespace mtraining
