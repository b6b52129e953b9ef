"""Balanced (block-striped) sparse ring attention: the API a layer calls.

Each rank keeps its striped queries and, step by step, attends to the keys/values of another rank
while the next step's K/V are already travelling (:mod:`.comm` rotates, :mod:`.merge` merges
partial outputs, :mod:`.loop` runs the steps of a :mod:`.schedule`, flat or hierarchical).
"""
from __future__ import annotations

import torch

from ..attention import (check_attention_inputs, op_softcap, padded_to_kernel_head_dim, resolve_softmax_scale,
                         sparse_attention_with_lse)
from ..config import SparseConfig
from ..documents import check_doc_start
from ..index import SparseIndex
from ..distributed.comm import ring_comm
from ..distributed.topology import HierarchicalGroups
from ..estimator import estimate_index
from ..layout import StripedLayout
from ..sinks import check_sinks
from ..window import window_key_start
from .agreement import check_due, check_ranks_agree, mark_checked, ranks_check_key
from .loop import RingSparseAttentionFunction
from .schedule import ring_schedule


def _single_device(q, k, v, config: SparseConfig, softmax_scale, index: SparseIndex | None, doc_start, window,
                   sinks, softcap, kept):
    check_attention_inputs(q, k, v, index)
    scale = resolve_softmax_scale(q.shape[-1], softmax_scale)
    if index is None:  # the estimator and the attention each check doc_start
        index = estimate_index(q, k, config, None, scale, doc_start)
    return sparse_attention_with_lse(q, k, v, index, scale, doc_start=doc_start, window=window, sinks=sinks,
                                     softcap=softcap, kept=kept)


def ring_sparse_attention_with_lse(q, k, v, config: SparseConfig, group=None,
                                   softmax_scale: float | None = None,
                                   index: SparseIndex | None = None,
                                   hierarchy: HierarchicalGroups | None = None,
                                   doc_start=None, window: int | None = None, sinks=None,
                                   softcap: float | None = None, kept=None):
    """Causal vertical-slash sparse attention over a sequence striped across ``group``.

    Args:
        q: [B, S/W, H, D], this rank's striped shard of the queries (after RoPE with the global
            position ids, see :class:`~ds_mtraining.layout.StripedLayout`).
        k, v: [B, S/W, Hkv, D], H a multiple of Hkv.
        config: the sparse pattern's budgets; ``config.block_size`` is the stripe width.
        group: the sequence-parallel process group (``None``: the default group, or the
            single-device path when torch.distributed is not initialised). A group of one rank
            runs the single-device path.
        softmax_scale: defaults to 1/sqrt(D).
        index: a global :class:`SparseIndex` for [B, S, H] to use instead of estimating one
            (distributedly, each call: the fused CUDA estimator for CUDA inputs it takes, the
            torch rule otherwise).
        hierarchy: this rank's inner/outer groups of ``group``
            (:func:`~ds_mtraining.distributed.topology.create_hierarchical_groups`) to run the
            hierarchical ring; ``None`` runs the flat ring.
        doc_start: int32 [B, S] for the *whole* sequence (every rank passes the same): document
            masking, each query sees only its own document (:mod:`ds_mtraining.documents`).
        window: a sliding window (:mod:`ds_mtraining.window`): each query sees only the last
            ``window`` keys up to itself, within the index (and its document).
        sinks: attention sinks, a logit per query head [H] in every row's softmax
            (:mod:`ds_mtraining.sinks`); its gradient is this rank's rows' share.
        softcap: attention logit soft-capping (Gemma-2): logits ``softcap * tanh(logit / softcap)``.
            The estimate reads the uncapped logits (capping keeps their order within a row).
        kept: (out, lse) that this call returned before, for the same inputs and ``index`` (the
            forward recomputed under activation checkpointing, ``keep_output`` of
            :class:`~ds_mtraining.layer.MTrainingAttentionSettings`): returned again with the
            backward attached; no kernel and no ring step runs.
    Returns:
        (out [B, S/W, H, D] in q's dtype, lse float32 [B, H, S/W]) for this rank's queries. On
        CUDA a head_dim the kernels lack runs zero-padded (K/V rotate padded).

    The ranks' agreement on shapes, dtypes, config and index is checked at the group's first
    call of each training step (:mod:`.agreement`: ``DS_MTRAINING_CHECK_RANKS``); apart from that
    check, a call on CUDA inputs does not synchronise with the host.
    """
    if not isinstance(config, SparseConfig):
        raise TypeError(f"config must be a SparseConfig, got {type(config).__name__}")
    comm = ring_comm(group)
    if comm is None:
        return _single_device(q, k, v, config, softmax_scale, index, doc_start, window, sinks, softcap, kept)
    check_key = ranks_check_key(comm)
    checking = check_due(check_key)
    if checking:
        check_ranks_agree(comm, q, k, v, config, index)
    # After a passed check every rank holds the same shapes, so every check below fails everywhere
    # alike (between checks, see .agreement for what goes unnoticed).
    check_attention_inputs(q, k, v)
    head_dim = q.shape[-1]
    scale = resolve_softmax_scale(head_dim, softmax_scale)
    q, k, v, kept = padded_to_kernel_head_dim(q, k, v, kept)  # before the K/V rotate, so once per call
    seq_len = q.shape[1] * comm.world
    StripedLayout(comm.world, config.block_size).check(seq_len)
    if index is not None:
        if index.block_size != config.block_size:
            raise ValueError(f"index.block_size={index.block_size} differs from config.block_size="
                             f"{config.block_size}, the stripe width the data was sharded with")
        check_attention_inputs(q, k, v, index, local_index_len=seq_len)
    if doc_start is not None:
        if tuple(doc_start.shape) != (q.shape[0], seq_len):
            raise ValueError(f"doc_start must be [B, S] = [{q.shape[0]}, {seq_len}] for the whole sequence "
                             f"(every rank passes all of it), got {tuple(doc_start.shape)}")
        if checking or not q.is_cuda:  # its values: read on the host, so once per step on CUDA
            doc_start = check_doc_start(doc_start, q.shape[0], seq_len, q.device)
        doc_start = doc_start.to(device=q.device, dtype=torch.int32).contiguous()
    if checking:
        mark_checked(check_key)
    if index is None:
        index = estimate_index(q, k, config, comm, scale, doc_start)
    # the kernels' per-query first key: the document's start, or later within a window
    key_start = doc_start if window is None else window_key_start(window, q.shape[0], seq_len, q.device, doc_start)
    if sinks is not None:
        sinks = check_sinks(sinks, q.shape[2])
    out, lse = RingSparseAttentionFunction.apply(q, k, v, index, scale, ring_schedule(comm, hierarchy), key_start,
                                                 kept, sinks, op_softcap(softcap))
    return out[..., :head_dim], lse


def ring_sparse_attention(q, k, v, config: SparseConfig, group=None,
                          softmax_scale: float | None = None, index: SparseIndex | None = None,
                          hierarchy: HierarchicalGroups | None = None, doc_start=None, window: int | None = None,
                          sinks=None, softcap: float | None = None):
    """Like :func:`ring_sparse_attention_with_lse`, returning only this rank's output."""
    return ring_sparse_attention_with_lse(q, k, v, config, group, softmax_scale, index, hierarchy,
                                          doc_start, window, sinks, softcap)[0]
