"""Balanced (block-striped) sparse ring attention: the API a layer calls.

Each rank keeps its striped queries and, step by step, attends to the keys/values of another rank
while the next step's K/V are already travelling (:class:`~ds_mtraining.distributed.comm.RingComm`
rotates, :mod:`.merge` merges partial outputs, :mod:`.loop` runs the steps of a :mod:`.schedule`,
flat or hierarchical).

A call has two parts. :func:`prepare_ring_call` runs all of the call's checks, the only place
they run, before any collective of the call: the ranks' agreement (:mod:`.agreement`, at the
group's first call of each training step), then the inputs, the striping, a given index and the
documents; it resolves the default scale (once) and pads to the kernels' head dim.
:meth:`RingCall.run` estimates the index where none was given and runs the ring. One
:class:`~ds_mtraining.distributed.comm.RingComm`, made by the caller, serves the whole call: the
agreement check, the estimate and the flat ring (a hierarchical ring's inner and outer groups
have their own). :func:`ring_sparse_attention_with_lse` runs the two parts back to back; the
layer (:func:`ds_mtraining.layer.striped_sparse_attention`) runs its position check and picks its
index (cached, windowed, a fixed pattern's or estimated on the call's ring) between them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import (check_attention_inputs, op_softcap, padded_to_kernel_head_dim, resolve_softmax_scale,
                         sparse_attention_with_lse)
from ..config import SparseConfig
from ..documents import check_doc_start
from ..index import SparseIndex
from ..distributed.comm import RingComm, ring_comm
from ..distributed.topology import HierarchicalGroups
from ..estimator import estimate_index
from ..layout import StripedLayout
from ..sinks import check_sinks
from ..window import window_key_start
from .agreement import check_due, check_ranks_agree, mark_checked, ranks_check_key
from .loop import RingSparseAttentionFunction
from .schedule import ring_schedule


def _single_device(q, k, v, config: SparseConfig, scale: float, index: SparseIndex | None, doc_start, window,
                   sinks, softcap, kept) -> tuple:
    check_attention_inputs(q, k, v, index)
    if index is None:  # the estimator and the attention each check doc_start
        index = estimate_index(q.detach(), k.detach(), config, None, scale, doc_start)
    out, lse = sparse_attention_with_lse(q, k, v, index, scale, doc_start=doc_start, window=window, sinks=sinks,
                                         softcap=softcap, kept=kept)
    return out, lse, index


def _check_index(index: SparseIndex, config: SparseConfig, q, k, v, seq_len: int):
    if index.block_size != config.block_size:
        raise ValueError(f"index.block_size={index.block_size} differs from config.block_size="
                         f"{config.block_size}, the stripe width the data was sharded with")
    check_attention_inputs(q, k, v, index, local_index_len=seq_len)


@dataclass
class RingCall:
    """One attention call with its checks passed (:func:`prepare_ring_call`), ready to :meth:`run`:
    its one ring ``comm`` (None: the single-device path), its one ``scale``, q/k/v (and ``kept``)
    padded to the kernels' head dim on a ring, ``doc_start`` checked there. A caller that runs a
    collective of its own between the two parts (the layer's estimate) runs it on ``comm``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    config: SparseConfig
    comm: RingComm | None
    scale: float
    head_dim: int  # the inputs' head dim: the output is cropped back to it
    index: SparseIndex | None = None  # the index given to prepare_ring_call, checked there
    doc_start: torch.Tensor | None = None
    kept: tuple | None = None

    def run(self, index: SparseIndex | None = None, hierarchy: HierarchicalGroups | None = None,
            window: int | None = None, sinks=None, softcap: float | None = None) -> tuple:
        """(out [B, S/W, H, D] in q's dtype, lse float32 [B, H, S/W], the index it used): ``index``,
        else the one given to :func:`prepare_ring_call`, else one estimated here on ``comm``."""
        q, k, v, comm = self.q, self.k, self.v, self.comm
        index = index if index is not None else self.index
        if comm is None:
            return _single_device(q, k, v, self.config, self.scale, index, self.doc_start, window, sinks, softcap,
                                  self.kept)
        seq_len = q.shape[1] * comm.world
        if index is None:
            index = estimate_index(q.detach(), k.detach(), self.config, comm, self.scale, self.doc_start)
        elif index is not self.index:  # the caller's own (every rank's alike after the agreement check)
            _check_index(index, self.config, q, k, v, seq_len)
        # the kernels' per-query first key: the document's start, or later within a window
        key_start = (self.doc_start if window is None
                     else window_key_start(window, q.shape[0], seq_len, q.device, self.doc_start))
        if sinks is not None:
            sinks = check_sinks(sinks, q.shape[2])
        out, lse = RingSparseAttentionFunction.apply(q, k, v, index, self.scale, ring_schedule(comm, hierarchy),
                                                     key_start, self.kept, sinks, op_softcap(softcap))
        return out[..., :self.head_dim], lse, index


def prepare_ring_call(q, k, v, config: SparseConfig, comm: RingComm | None, softmax_scale: float | None = None,
                      index: SparseIndex | None = None, doc_start=None, kept=None) -> RingCall:
    """A call's checks, the one place they run, before any collective of the call: the ranks'
    agreement (:func:`~.agreement.check_ranks_agree`, at the group's first call of each training
    step), then q/k/v, the striping, ``index`` (if given) and ``doc_start``; a call that raised
    leaves the next one checked. The default scale is resolved here, once (1/sqrt(D),
    :func:`ds_mtraining.attention.resolve_softmax_scale`). ``comm``: the call's ring, made once by
    the caller (:func:`ds_mtraining.distributed.comm.ring_comm`; None: one device). The arguments
    are :func:`ring_sparse_attention_with_lse`'s."""
    if not isinstance(config, SparseConfig):
        raise TypeError(f"config must be a SparseConfig, got {type(config).__name__}")
    checking = comm is not None and check_due(ranks_check_key(comm))
    if checking:
        check_ranks_agree(comm, q, k, v, config, index)
    # After a passed check every rank holds the same shapes, so every check below fails everywhere
    # alike (between checks, see .agreement for what goes unnoticed).
    check_attention_inputs(q, k, v)
    head_dim = q.shape[-1]
    scale = resolve_softmax_scale(head_dim, softmax_scale)
    if comm is None:  # the single-device attention pads, and checks the index and doc_start, itself
        return RingCall(q, k, v, config, None, scale, head_dim, index, doc_start, kept)
    q, k, v, kept = padded_to_kernel_head_dim(q, k, v, kept)  # before the K/V rotate, so once per call
    seq_len = q.shape[1] * comm.world
    StripedLayout(comm.world, config.block_size).check(seq_len)
    if index is not None:
        _check_index(index, config, q, k, v, seq_len)
    if doc_start is not None:
        if tuple(doc_start.shape) != (q.shape[0], seq_len):
            raise ValueError(f"doc_start must be [B, S] = [{q.shape[0]}, {seq_len}] for the whole sequence "
                             f"(every rank passes all of it), got {tuple(doc_start.shape)}")
        if checking or not q.is_cuda:  # its values: read on the host, so once per step on CUDA
            doc_start = check_doc_start(doc_start, q.shape[0], seq_len, q.device)
        doc_start = doc_start.to(device=q.device, dtype=torch.int32).contiguous()
    if checking:
        mark_checked(ranks_check_key(comm))
    return RingCall(q, k, v, config, comm, scale, head_dim, index, doc_start, kept)


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

    The call's checks run first, before any collective of the call (:func:`prepare_ring_call`):
    the ranks' agreement on shapes, dtypes, config and index at the group's first call of each
    training step (:mod:`.agreement`: ``DS_MTRAINING_CHECK_RANKS``), then the inputs. Apart from
    that agreement check, a call on CUDA inputs does not synchronise with the host. One ring
    (``RingComm`` of ``group``) serves the whole call, the estimate included.
    """
    call = prepare_ring_call(q, k, v, config, ring_comm(group), softmax_scale, index, doc_start, kept)
    out, lse, _ = call.run(hierarchy=hierarchy, window=window, sinks=sinks, softcap=softcap)
    return out, lse


def ring_sparse_attention(q, k, v, config: SparseConfig, group=None,
                          softmax_scale: float | None = None, index: SparseIndex | None = None,
                          hierarchy: HierarchicalGroups | None = None, doc_start=None, window: int | None = None,
                          sinks=None, softcap: float | None = None):
    """Like :func:`ring_sparse_attention_with_lse`, returning only this rank's output."""
    return ring_sparse_attention_with_lse(q, k, v, config, group, softmax_scale, index, hierarchy,
                                          doc_start, window, sinks, softcap)[0]
