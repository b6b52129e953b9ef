"""The only Python code that calls the compiled sparse attention ops (docs/KERNEL_CONTRACT.md).

The op is picked by ``q.device.type`` and loaded once per device type: prebuilt if the package
was installed with ``DS_BUILD_MTRAINING=1``, otherwise JIT-compiled by the DeepSpeed op builder.
"""
from __future__ import annotations

import threading

import torch

from .index import SparseIndex, Stripe

_modules: dict[str, object] = {}
_lock = threading.Lock()


def op_module(device_type: str):
    """The compiled module for ``device_type``, loaded (or compiled) on first use."""
    module = _modules.get(device_type)
    if module is None:
        with _lock:
            module = _modules.get(device_type)
            if module is None:
                from op_builder import builder_for_device
                module = builder_for_device(device_type)().load()
                _modules[device_type] = module
    return module


def _index_args(q: torch.Tensor, index: SparseIndex, stripe: Stripe) -> tuple:
    """The index lists and geometry the op takes, after checking the index fits this call."""
    if not isinstance(index, SparseIndex):
        raise TypeError(f"index must be a ds_mtraining.SparseIndex, got {type(index).__name__}")
    if q.dim() == 4:
        index.check_matches(q.shape[0], q.shape[1] * stripe.world, q.shape[2])
    return (index.slash, index.slash_count, index.vertical, index.vertical_count,
            index.block_size)


def attention_forward(q, k, v, index: SparseIndex, scale: float, stripe: Stripe = Stripe()):
    """Sparse attention of ``stripe.q_rank``'s queries over ``stripe.k_rank``'s keys.

    Returns (out float32 [B, Sq, H, D], lse float32 [B, H, Sq]); rows that see no key in this
    call get out 0 and lse -inf."""
    module = op_module(q.device.type)
    return tuple(module.forward(q, k, v, *_index_args(q, index, stripe), float(scale),
                                stripe.world, stripe.q_rank, stripe.k_rank))


def attention_backward(dout, q, k, v, out, lse, index: SparseIndex, scale: float,
                       stripe: Stripe = Stripe()):
    """Gradients (dq, dk, dv) of one call given the final output ``out``, its ``lse`` and
    ``dout``; on CPU they are float32."""
    module = op_module(q.device.type)
    return tuple(module.backward(dout, q, k, v, out, lse, *_index_args(q, index, stripe),
                                 float(scale), stripe.world, stripe.q_rank, stripe.k_rank))
