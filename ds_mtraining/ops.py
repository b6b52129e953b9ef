"""The only Python code that calls the compiled sparse attention ops (docs/KERNEL_CONTRACT.md).

The op is picked by ``q.device.type`` and loaded once per device type: prebuilt if the package
was installed with ``DS_BUILD_MTRAINING=1``, otherwise JIT-compiled by the DeepSpeed op builder.
Each call is a ``mtraining::<function>`` range for torch.profiler (on CPU the op's own time is
only visible there).
"""
from __future__ import annotations

import threading

import torch
from torch.profiler import record_function

from .index import SparseIndex, Stripe

# the head dims and dtypes csrc/cuda's kernels (and its fused estimator) are instantiated for
# (csrc/cuda/generate_kernels.py; tests/test_cuda_kernel_list.py holds them equal); the CPU op
# takes any head_dim and float32 too
CUDA_HEAD_DIMS = (64, 128, 256)
CUDA_DTYPES = (torch.bfloat16, torch.float16)

_modules: dict[str, object] = {}
_lock = threading.Lock()


def op_module(device_type: str):
    """The compiled module for ``device_type``, loaded (or compiled) on first use."""
    module = _modules.get(device_type)
    if module is None:
        with _lock:
            module = _modules.get(device_type)
            if module is None:
                from ds_mtraining_op_builder import builder_for_device
                module = builder_for_device(device_type)().load()
                _modules[device_type] = module
    return module


def op_index(index: SparseIndex, stripe: Stripe = Stripe(), doc_start: torch.Tensor | None = None) -> dict:
    """The ``index`` argument of the compiled ops: the compact lists, the block size, the ring
    position and ``doc_start`` (int32 [B, S_global], see ds_mtraining.documents; None: no document
    masking, passed as an empty tensor), one entry per field of ``OpIndex``
    (csrc/include/mtraining/op_index.h)."""
    if not isinstance(index, SparseIndex):
        raise TypeError(f"index must be a ds_mtraining.SparseIndex, got {type(index).__name__}")
    if doc_start is None:
        doc_start = torch.empty(0, dtype=torch.int32, device=index.device)
    return dict(slash=index.slash, slash_count=index.slash_count, vertical=index.vertical,
                vertical_count=index.vertical_count, block_size=index.block_size,
                world=stripe.world, q_rank=stripe.q_rank, k_rank=stripe.k_rank, doc_start=doc_start)


def _call_index(q: torch.Tensor, index: SparseIndex, stripe: Stripe, doc_start) -> dict:
    """op_index after checking that the index fits this call's queries."""
    op_args = op_index(index, stripe, doc_start)
    if q.dim() == 4:
        index.check_matches(q.shape[0], q.shape[1] * stripe.world, q.shape[2])
    return op_args


def attention_forward(q, k, v, index: SparseIndex, scale: float, stripe: Stripe = Stripe(), *,
                      doc_start: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None, input_dtype: bool = False, softcap: float = 0.0):
    """Sparse attention of ``stripe.q_rank``'s queries over ``stripe.k_rank``'s keys, within the
    documents of ``doc_start`` when given; the logits are ``scale * q.k``, or with ``softcap`` > 0
    (attention logit soft-capping) ``softcap * tanh(scale * q.k / softcap)``.

    Returns (out float32 [B, Sq, H, D], lse float32 [B, H, Sq]); rows that see no key in this
    call get out 0 and lse -inf. Given ``out`` and ``lse``, the running result of earlier calls
    for the same queries over other keys, the call merges its own into them in place (as
    :func:`ds_mtraining.ring.merge_partial` would) and returns them. ``input_dtype``: out in
    q's dtype (rounded as ``.to(q.dtype)`` rounds; on CUDA written so by the kernel, with no
    float32 copy); with a running ``out`` and ``lse``, the merged out in a new tensor (the
    running ``out`` read, not written; ``lse`` merged in place): a ring's last step."""
    module = op_module(q.device.type)
    with record_function("mtraining::forward"):
        return tuple(module.forward(q, k, v, _call_index(q, index, stripe, doc_start), float(scale), out=out,
                                    lse=lse, input_dtype=input_dtype, softcap=float(softcap)))


def attention_backward(dout, q, k, v, out, lse, index: SparseIndex, scale: float,
                       stripe: Stripe = Stripe(), *, doc_start: torch.Tensor | None = None,
                       dq: torch.Tensor | None = None, delta: torch.Tensor | None = None,
                       input_dtype: bool = False, softcap: float = 0.0):
    """Gradients (dq, dk, dv) of one call given the final output ``out`` (float32, or q's
    dtype), its ``lse`` and ``dout`` (``doc_start`` and ``softcap`` as in the forward); float32. Given ``dq``
    (float32, a running sum over earlier calls), the call adds its dq into it in place and
    returns it. Given ``delta`` (:func:`attention_delta` of this ``dout`` and ``out``), the call
    does not compute it again. ``input_dtype``: dq in q's dtype; with a running ``dq``, the sum
    in a new tensor (the running ``dq`` read, not written): a ring's last step."""
    module = op_module(q.device.type)
    with record_function("mtraining::backward"):
        return tuple(module.backward(dout, q, k, v, out, lse, _call_index(q, index, stripe, doc_start),
                                     float(scale), dq=dq, delta=delta, input_dtype=input_dtype,
                                     softcap=float(softcap)))


def attention_delta(dout, out) -> torch.Tensor:
    """rowsum(dout * out), float32 [B, H, S]: what every backward call computes first, computed
    once for several calls with the same ``dout`` and final ``out`` (a ring's steps)."""
    with record_function("mtraining::delta"):
        return op_module(dout.device.type).delta(dout, out)
