"""The one place that picks an estimator: :func:`estimate_index`, which both the single-device
path and the ring (:mod:`ds_mtraining.ring.ring_attention`, :mod:`ds_mtraining.layer`) call.

The pick, by inputs (never by a setting):

* without documents, where the fused estimator takes the inputs (:func:`fused_estimator_takes`:
  CUDA, bf16/fp16, head dim 64/128/256, ``last_q`` <= 256): on one device
  :func:`.fused.estimate_vertical_slash_cuda`; on a ring :func:`.graphs.captured_estimate` (or,
  with the graphs off, :func:`.distributed.estimate_vertical_slash_cuda_distributed`);
* without documents, otherwise: :func:`.rule.estimate_vertical_slash` on one device,
  :func:`.distributed.estimate_vertical_slash_distributed` on a ring (torch);
* with ``doc_start``: :func:`document_index`, on a ring after
  :func:`.documents.gather_document_inputs`.

:func:`document_index` in turn takes the fused document masses and selection
(:func:`.fused.document_masses`, :func:`.fused.index_from_document_masses`) where the fused
estimator takes the inputs, else the torch rule's (:func:`.rule.document_column_and_diagonal_mass`,
:func:`.rule.index_from_masses`).
"""
from __future__ import annotations

from ..attention import resolve_softmax_scale
from ..config import SparseConfig
from ..distributed.comm import RingComm
from ..documents import check_doc_start
from ..index import SparseIndex
from . import fused, graphs
from .distributed import estimate_vertical_slash_cuda_distributed, estimate_vertical_slash_distributed
from .documents import gather_document_inputs
from .rule import check_qk, document_column_and_diagonal_mass, estimate_vertical_slash, index_from_masses


def fused_estimator_takes(q, k, config: SparseConfig, seq_len: int) -> bool:
    """Whether the fused CUDA estimator takes these inputs (:func:`.fused.supports`)."""
    return q.is_cuda and fused.supports(q, k, config, seq_len) is None


def document_index(q, k, doc_start, config: SparseConfig, scale: float, q_positions=None) -> SparseIndex:
    """The document-aware index of whole-sequence keys ``k`` (``q``: every query, or only the rows
    at ``q_positions``). Where the fused estimator takes the inputs (CUDA), its masses (all
    documents in the same launches), selection and finalize; else the torch rule's masses and
    selection. With the step's documents read once (its first layer), neither path synchronises
    with the host."""
    if fused_estimator_takes(q, k, config, k.shape[1]):
        columns, diagonals = fused.document_masses(q, k, doc_start, config.last_q, scale, q_positions)
        return fused.index_from_document_masses(columns, diagonals, config, doc_start)
    columns, diagonals = document_column_and_diagonal_mass(q, k, doc_start, config.last_q, scale,
                                                           q_positions=q_positions)
    return index_from_masses(columns, diagonals, config, doc_start)


def estimate_index(q, k, config: SparseConfig, comm: RingComm | None = None,
                   softmax_scale: float | None = None, doc_start=None) -> SparseIndex:
    """This step's global vertical-slash index of the shards ``q``/``k`` over ``comm``'s ring (None:
    one device; :func:`ds_mtraining.distributed.comm.ring_comm` makes it from a group): the fused
    CUDA estimator (no host synchronisation, its index built trusted) when it takes the inputs
    (on a ring, replayed from a CUDA graph: :mod:`.graphs`), else the torch rule (CPU; on CUDA it
    synchronises). With ``doc_start`` (document masking) the document-aware rule
    (:func:`document_index`; on a ring after :func:`.documents.gather_document_inputs`), the
    document list read on the host once per ``doc_start``. Collective on a ring."""
    if doc_start is not None:
        scale = resolve_softmax_scale(q.shape[-1], softmax_scale)
        if comm is None:
            check_qk(q, k)
            doc_start = check_doc_start(doc_start, q.shape[0], q.shape[1], q.device)
            return document_index(q, k, doc_start, config, scale)
        rows, keys, doc_start, positions = gather_document_inputs(q, k, config, comm, doc_start)
        return document_index(rows, keys, doc_start, config, scale, positions)
    world = 1 if comm is None else comm.world
    if fused_estimator_takes(q, k, config, q.shape[1] * world):
        if comm is None:
            return fused.estimate_vertical_slash_cuda(q, k, config, softmax_scale)
        if graphs.graphs_enabled():
            check_qk(q, k)
            return graphs.captured_estimate(q, k, config, comm, resolve_softmax_scale(q.shape[-1], softmax_scale))
        return estimate_vertical_slash_cuda_distributed(q, k, config, comm, softmax_scale)
    if comm is None:
        return estimate_vertical_slash(q, k, config, softmax_scale)
    return estimate_vertical_slash_distributed(q, k, config, comm, softmax_scale)
