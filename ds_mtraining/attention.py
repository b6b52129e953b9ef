"""Single-device dynamic sparse attention: the autograd Function and its thin wrappers.

Layout is FlashAttention's ``[batch, seq, heads, head_dim]``; attention is causal and restricted to
the entries of a :class:`~ds_mtraining.index.SparseIndex`. The forward and backward run in the
op builder's kernels (C++/OpenMP on CPU, CUDA on GPU), accumulating in fp32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import ops
from .documents import check_doc_start
from .index import SparseIndex, Stripe
from .sinks import check_sinks, sink_gradient, with_sinks
from .window import window_key_start

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_softmax_scale(head_dim: int, softmax_scale: float | None = None) -> float:
    """``softmax_scale`` if given, else the standard 1/sqrt(head_dim)."""
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def op_softcap(softcap: float | None) -> float:
    """The ops' ``softcap`` argument (0.0: none) of a user's logit soft-capping value (None: none;
    Gemma-2's ``attn_logit_softcapping``): logits become ``softcap * tanh(logit / softcap)``."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
            or softcap <= 0:
        raise ValueError(f"softcap must be a positive number (the logit cap) or None, got {softcap!r}")
    return float(softcap)


def check_attention_inputs(q, k, v, index: SparseIndex | None = None, local_index_len: int | None = None):
    """One clear error for each way q/k/v/index can be wrong."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-d tensor [batch, seq, heads, head_dim], got {shape}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use one of float32, bfloat16, float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, seq and head_dim "
            f"(layout [batch, seq, heads, head_dim]; transpose from [batch, heads, seq, head_dim])")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads "
                         f"({k.shape[2]}) for GQA")
    if index is not None:
        if index.device != q.device:
            raise ValueError(f"index is on {index.device} but q is on {q.device}; use index.to(q.device)")
        seq = local_index_len if local_index_len is not None else q.shape[1]
        index.check_matches(q.shape[0], seq, q.shape[2])


def kernel_head_dim(head_dim: int, device_type: str) -> int:
    """The head_dim the kernels run ``head_dim`` at: itself on the CPU; on CUDA the smallest of
    :data:`ds_mtraining.ops.CUDA_HEAD_DIMS` that holds it (ValueError above the largest)."""
    if device_type != "cuda":
        return head_dim
    fitting = [d for d in ops.CUDA_HEAD_DIMS if d >= head_dim]
    if not fitting:
        raise ValueError(f"head_dim={head_dim}: MTraining's CUDA kernels take head_dim up to "
                         f"{max(ops.CUDA_HEAD_DIMS)}; train this model on CPU")
    return fitting[0]


def padded_to_kernel_head_dim(q, k, v, kept=None) -> tuple:
    """(q, k, v, kept) ([..., D]; ``kept``: an (out, lse) of an earlier call, or None) with D
    zero-padded to :func:`kernel_head_dim`: zero columns change no score q.k, and the output's
    extra columns are zero (crop with ``out[..., :D]``). The softmax scale stays the caller's:
    resolve it from D first."""
    head_dim = q.shape[-1]
    target = kernel_head_dim(head_dim, q.device.type)
    if target == head_dim:
        return q, k, v, kept
    q, k, v = (F.pad(t, (0, target - head_dim)) for t in (q, k, v))
    if kept is not None:
        kept = (F.pad(kept[0], (0, target - head_dim)), kept[1])
    return q, k, v, kept


class SparseAttentionFunction(torch.autograd.Function):
    """Causal vertical-slash sparse attention, within the documents of ``doc_start`` when given,
    with attention ``sinks`` [H] when given (:mod:`ds_mtraining.sinks`), logits soft-capped at
    ``softcap`` (:func:`op_softcap`; 0: none); returns (out in q's
    dtype, lse fp32 [B, H, S]). ``kept``: the (out, lse) this call returned before (a forward
    recomputed under activation checkpointing): returned again with the backward attached,
    without running the kernel."""

    @staticmethod
    def forward(ctx, q, k, v, index: SparseIndex, scale: float, doc_start=None, kept=None, sinks=None,
                softcap: float = 0.0):
        if kept is not None:
            out, lse = kept
        else:  # out (and dq) in q's dtype straight from the kernels: no float32 copy to convert
            out, lse = ops.attention_forward(q, k, v, index, scale, Stripe(), doc_start=doc_start, input_dtype=True,
                                             softcap=softcap)
            if sinks is not None:
                out, lse = with_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.index, ctx.scale, ctx.doc_start, ctx.softcap = index, scale, doc_start, softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        delta = ops.attention_delta(dout, out)
        dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, ctx.index, ctx.scale, Stripe(),
                                            doc_start=ctx.doc_start, delta=delta, input_dtype=True,
                                            softcap=ctx.softcap)
        dsinks = sink_gradient(delta, lse, sinks) if sinks is not None and ctx.needs_input_grad[7] else None
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dsinks, None


def sparse_attention_with_lse(q, k, v, index: SparseIndex, softmax_scale: float | None = None, *,
                              doc_start: torch.Tensor | None = None, window: int | None = None,
                              sinks: torch.Tensor | None = None, softcap: float | None = None, kept=None):
    """Sparse causal attention of q [B, S, H, D] over k, v [B, S, Hkv, D] on ``index``; with
    ``doc_start`` [B, S] (ds_mtraining.documents) each query sees only its own document; with
    ``window`` only the last ``window`` keys up to itself (:mod:`ds_mtraining.window`); with
    ``sinks`` [H] a learned logit per head joins each row's softmax (:mod:`ds_mtraining.sinks`);
    with ``softcap`` the logits are ``softcap * tanh(logit / softcap)`` (Gemma-2).
    ``kept``: (out, lse) that this call returned before, for the same inputs (activation
    checkpointing's recompute): returned with the backward attached, no kernel runs.

    Returns (out [B, S, H, D] in q's dtype, lse [B, H, S] float32). On CUDA a head_dim the
    kernels lack runs zero-padded to the next one they take (:func:`padded_to_kernel_head_dim`)."""
    check_attention_inputs(q, k, v, index)
    if doc_start is not None:
        doc_start = check_doc_start(doc_start, q.shape[0], q.shape[1], q.device)
    if window is not None:
        doc_start = window_key_start(window, q.shape[0], q.shape[1], q.device, doc_start)
    head_dim = q.shape[-1]
    scale = resolve_softmax_scale(head_dim, softmax_scale)
    if sinks is not None:
        sinks = check_sinks(sinks, q.shape[2])
    softcap = op_softcap(softcap)
    q, k, v, kept = padded_to_kernel_head_dim(q, k, v, kept)
    out, lse = SparseAttentionFunction.apply(q, k, v, index, scale, doc_start, kept, sinks, softcap)
    return out[..., :head_dim], lse


def sparse_attention(q, k, v, index: SparseIndex, softmax_scale: float | None = None, *,
                     doc_start: torch.Tensor | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None, softcap: float | None = None):
    """Like :func:`sparse_attention_with_lse`, returning only the output."""
    return sparse_attention_with_lse(q, k, v, index, softmax_scale, doc_start=doc_start, window=window,
                                     sinks=sinks, softcap=softcap)[0]
