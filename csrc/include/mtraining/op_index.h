// The signature of the compiled op, defined once for the CPU and CUDA modules
// (docs/KERNEL_CONTRACT.md):
//
//   forward(q, k, v, index, scale, out=None, lse=None, input_dtype=False, softcap=0.0) -> [out, lse]
//   backward(dout, q, k, v, out, lse, index, scale, dq=None, delta=None, input_dtype=False, softcap=0.0)
//       -> [dq, dk, dv]
//   delta(dout, out) -> delta
//
// The logit of query i and key j is scale * q_i.k_j, or with softcap > 0 (attention logit
// soft-capping, Gemma-2) softcap * tanh(scale * q_i.k_j / softcap); lse is over these logits.
//
// Given a running out and lse (forward) or dq (backward), float32, a call adds its own result into
// them in place (the ring's steps: one accumulation, no separate merge pass) and returns them.
// input_dtype returns out (dq) in q's dtype instead of float32; with a running out (dq), the merged
// out (the sum) in a new tensor in q's dtype, the running out (dq) read and not written, the
// running lse updated in place (the ring's last step).
// delta = rowsum(dout * out) [B, H, S] float32 is what backward computes first; given to backward
// (the ring computes it once for all its steps), it is not computed again.
//
// `index` is a dict with one entry per field of OpIndex: the compact index of the call and its ring
// position (ds_mtraining.ops.op_index builds it). A new field is one line of
// MTRAINING_OP_INDEX_FIELDS: the struct, its contiguous copy and the reading from Python follow
// (then check it in checks.h and use it in the kernels).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and torch's tensor casters

#include <optional>
#include <string>
#include <type_traits>

// FIELD(type, name) for each field, in the order the docs list them.
#define MTRAINING_OP_INDEX_FIELDS(FIELD)                                                               \
    FIELD(at::Tensor, slash)          /* int32 [B, H, Ls]: sorted block diagonals, PAD-padded */      \
    FIELD(at::Tensor, slash_count)    /* int32 [B, H] */                                              \
    FIELD(at::Tensor, vertical)       /* int32 [B, H, Lv]: sorted global key tokens, PAD-padded */    \
    FIELD(at::Tensor, vertical_count) /* int32 [B, H] */                                              \
    FIELD(int64_t, block_size)        /* tokens per block, also the stripe width */                  \
    FIELD(int64_t, world)             /* ranks the sequence is striped over (1: one device) */        \
    FIELD(int64_t, q_rank)            /* rank whose queries q holds */                                \
    FIELD(int64_t, k_rank)            /* rank whose keys k and v hold */                              \
    FIELD(at::Tensor, doc_start)      /* int32 [B, S_global]: first token of each token's document; empty: none */

namespace mtraining {

inline at::Tensor contiguous_field(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }
inline int64_t contiguous_field(int64_t value) { return value; }

struct OpIndex {
#define MTRAINING_DECLARE_FIELD(type, name) type name{};
    MTRAINING_OP_INDEX_FIELDS(MTRAINING_DECLARE_FIELD)
#undef MTRAINING_DECLARE_FIELD

    // A copy whose tensors are contiguous (each one copied only if it is not already).
    OpIndex contiguous() const {
        OpIndex copy;
#define MTRAINING_COPY_FIELD(type, name) copy.name = contiguous_field(name);
        MTRAINING_OP_INDEX_FIELDS(MTRAINING_COPY_FIELD)
#undef MTRAINING_COPY_FIELD
        return copy;
    }
};

// Field `name` of a Python index dict, converted to Field.
template <typename Field>
Field read_index_field(const py::dict& fields, const char* name, const char* op_name) {
    TORCH_CHECK_VALUE(fields.contains(name), op_name, ": the index has no '", name,
                      "' entry; build it with ds_mtraining.ops.op_index");
    try {
        return fields[name].cast<Field>();
    } catch (const py::cast_error&) {
        const std::string type_name = py::str(py::type::of(fields[name]).attr("__name__"));
        throw py::type_error(std::string(op_name) + ": index entry '" + name + "' has type " + type_name +
                             (std::is_same_v<Field, at::Tensor> ? ", expected a tensor" : ", expected an int"));
    }
}

// The OpIndex of a Python index dict. Unknown entries are rejected, so that an index built for a
// newer contract never runs with a field silently ignored.
inline OpIndex op_index_from_python(const py::dict& fields, const char* op_name) {
    for (const auto& entry : fields) {
        const std::string key = py::str(entry.first);
        bool known = false;
#define MTRAINING_MATCH_FIELD(type, name) known = known || key == #name;
        MTRAINING_OP_INDEX_FIELDS(MTRAINING_MATCH_FIELD)
#undef MTRAINING_MATCH_FIELD
        TORCH_CHECK_VALUE(known, op_name, ": unknown index entry '", key, "'; this build takes ",
                          "the entries of ds_mtraining.ops.op_index (rebuild the op after updating)");
    }
    OpIndex index;
#define MTRAINING_READ_FIELD(type, name) index.name = read_index_field<type>(fields, #name, op_name);
    MTRAINING_OP_INDEX_FIELDS(MTRAINING_READ_FIELD)
#undef MTRAINING_READ_FIELD
    return index;
}

// Defines `forward`, `backward` and `delta` in module m with the signature above. The first two
// read their index from Python, then run forward(q, k, v, OpIndex, scale, softcap, running out,
// running lse, input_dtype) / backward(dout, q, k, v, out, lse, OpIndex, scale, softcap, running dq,
// delta, input_dtype) without the GIL (the optional tensors std::nullopt when not given); delta runs
// delta(dout, out). input_dtype: out (forward) or dq (backward) in q's dtype instead of float32
// (see the top of this file).
template <typename Forward, typename Backward, typename Delta>
void define_attention_ops(py::module_& m, const char* op_name, Forward forward, Backward backward, Delta delta) {
    m.def(
        "forward",
        [op_name, forward](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const py::dict& index,
                           double scale, const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& lse,
                           bool input_dtype, double softcap) {
            const OpIndex call_index = op_index_from_python(index, op_name);
            const py::gil_scoped_release no_gil;
            return forward(q, k, v, call_index, scale, softcap, out, lse, input_dtype);
        },
        "sparse attention forward -> (out fp32, or q's dtype with input_dtype; lse fp32), merged into the "
        "running out/lse when given",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("index"), py::arg("scale"), py::arg("out") = py::none(),
        py::arg("lse") = py::none(), py::arg("input_dtype") = false, py::arg("softcap") = 0.0);
    m.def(
        "backward",
        [op_name, backward](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const py::dict& index, double scale,
                            const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& delta,
                            bool input_dtype, double softcap) {
            const OpIndex call_index = op_index_from_python(index, op_name);
            const py::gil_scoped_release no_gil;
            return backward(dout, q, k, v, out, lse, call_index, scale, softcap, dq, delta, input_dtype);
        },
        "sparse attention backward -> (dq, dk, dv) fp32 (dq in q's dtype with input_dtype), dq added into the "
        "running dq when given",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("index"),
        py::arg("scale"), py::arg("dq") = py::none(), py::arg("delta") = py::none(), py::arg("input_dtype") = false,
        py::arg("softcap") = 0.0);
    m.def(
        "delta",
        [delta](const at::Tensor& dout, const at::Tensor& out) {
            const py::gil_scoped_release no_gil;
            return delta(dout, out);
        },
        "rowsum(dout * out) -> float32 [batch, heads, seq]", py::arg("dout"), py::arg("out"));
}

}  // namespace mtraining
