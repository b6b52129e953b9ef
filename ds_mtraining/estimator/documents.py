"""The document-aware estimate's inputs on a ring (rules 1'-2' of :mod:`.rule`, with ``doc_start``).

Each document is scored by its own last queries against its own keys, so a rank's striped shard
is not enough: :func:`gather_document_inputs` all-gathers every key and only the query rows the
rule reads (each document's last ``last_q``: :func:`~.rule.document_query_positions`), after which
every rank computes the index of the whole sequence, as one device would (the choice of the fused
masses or the torch rule is the dispatcher's, :mod:`.dispatch`). Exact and simple, but the keys
cost O(S) memory per rank (``S x Hkv x D``; a sharded version is future work). With the step's
documents read once (its first layer), nothing here synchronises with the host.
"""
from __future__ import annotations

import torch

from ..config import SparseConfig
from ..distributed.comm import RingComm
from ..documents import check_doc_start, remember_last
from ..layout import StripedLayout
from .distributed import _all_gather
from .rule import check_qk, document_query_positions


@remember_last
def _gather_plan(positions: torch.Tensor, seq_len: int, world: int, rank: int, block_size: int):
    """How :func:`_rows_at` gathers the rows at ``positions``: per rank, the slots of
    ``positions`` it holds (device indices; their count, a host int), and this rank's local rows
    of its own. Remembered for the last ``positions`` object, which
    :func:`~ds_mtraining.estimator.rule.document_query_positions` remembers per ``doc_start``: a step's
    later layers read nothing on the host here."""
    layout = StripedLayout(world, block_size)
    held = [layout.positions(seq_len, r, device=positions.device) for r in range(world)]
    slots = [torch.isin(positions, rows).nonzero().squeeze(1) for rows in held]
    counts = [len(s) for s in slots]
    return slots, counts, torch.searchsorted(held[rank], positions[slots[rank]])


def _rows_at(x: torch.Tensor, layout: StripedLayout, comm: RingComm, positions: torch.Tensor) -> torch.Tensor:
    """[B, len(positions), ...] on every rank: the rows of the sharded ``x`` [B, S/W, ...] at the
    global ``positions`` (ascending, the same on every rank), each rank sending the ones it holds
    (one all-gather, padded to the largest share)."""
    slots, counts, mine = _gather_plan(positions, x.shape[1] * comm.world, comm.world, comm.rank,
                                       layout.block_size)
    part = x.new_zeros(x.shape[0], max(counts), *x.shape[2:])
    part[:, :counts[comm.rank]] = x.index_select(1, mine)  # index_select/index_copy_: no host sync on GPUs
    parts = _all_gather(part, comm)
    rows = x.new_empty(x.shape[0], len(positions), *x.shape[2:])
    for rank in range(comm.world):
        rows.index_copy_(1, slots[rank], parts[rank][:, :counts[rank]])
    return rows


def gather_document_inputs(q, k, config: SparseConfig, comm: RingComm, doc_start):
    """(query rows, every key, doc_start, their global positions) of the striped shards ``q``/``k``:
    what the document-aware rule reads of the whole sequence, on every rank (collective)."""
    check_qk(q, k)
    b, local = q.shape[:2]
    layout = StripedLayout(comm.world, config.block_size)
    doc_start = check_doc_start(doc_start, b, local * comm.world, q.device)
    k_all = layout.unshard(list(_all_gather(k, comm).unbind(0)))
    positions = document_query_positions(doc_start, config.last_q)
    return _rows_at(q, layout, comm, positions), k_all, doc_start, positions
