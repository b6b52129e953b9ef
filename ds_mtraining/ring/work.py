"""Attention work per (query rank, key rank) pair and per (worker, ring step), from the compact
index alone: O(selected blocks) time, never a dense mask.

Each rank's tokens are whole blocks (:meth:`Layout.block_owner`), so every selected entry is
attributed by the owners of its query block and key block:

* slash diagonal ``d > 0``: the full blocks (g, g - d) for g >= d, ``bs^2`` entries each; the
  owner pairs of one diagonal do not depend on the head, so each distinct diagonal is counted
  once and weighted by the number of heads that select it;
* diagonal 0: ``bs (bs + 1) / 2`` token-causal entries per block, on the block owner's pair;
* vertical column c (block cb): ``bs`` entries for every later query block g whose offset
  g - cb is no slash diagonal, i.e. all later blocks per owner (prefix counts) minus the
  slash-covered ones.

With document masking (``doc_start``, :mod:`ds_mtraining.documents`) the same walk counts only
the entries inside documents: a slash block keeps ``bs^2`` entries when every query row's
document starts at or before the key block (only blocks that a document start cuts are counted
row by row), diagonal-0 blocks count token-causal entries from each row's document start, and a
column c is read only by the rows of its own document after it (up to the document's end, so its
last query block may be partial).
"""
from __future__ import annotations

import torch

from ..documents import document_ends
from ..index import PAD, SparseIndex
from ..layout import Layout

_DIAGONALS_PER_CHUNK = 256


def pair_work(index: SparseIndex, layout: Layout, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 [W, W]: entries computed for queries held by rank ``r`` (row) against keys held
    by rank ``s`` (column), summed over batch and heads: row sums are per-rank totals. With
    ``doc_start`` [B, S], only the entries inside documents (what the kernels compute).

    Equal to ``reference.mask_between(index, positions(r), positions(s)).sum()`` (with documents,
    intersected with ``documents.document_causal_mask``; tests check it at small S).
    """
    if index.seq_len % index.block_size != 0:
        raise ValueError(f"seq_len={index.seq_len} must be whole blocks of {index.block_size}")
    if layout.block_size != index.block_size:
        raise ValueError(f"the layout's block_size={layout.block_size} differs from the index's "
                         f"{index.block_size}")
    nb, bs, world, seq = index.num_blocks, index.block_size, layout.world, index.seq_len
    device = index.device
    owner = layout.block_owner(nb).to(device)
    work = torch.zeros(world * world, dtype=torch.float64, device=device)
    starts = (torch.zeros(index.batch, seq, dtype=torch.long, device=device) if doc_start is None
              else doc_start.to(device).long())
    ends = torch.full_like(starts, seq) if doc_start is None else document_ends(starts)

    def add(query_blocks, key_blocks, weight):
        flat = (owner[query_blocks] * world + owner[key_blocks]).flatten()
        work.index_add_(0, flat, torch.as_tensor(weight, dtype=torch.float64,
                                                 device=device).expand_as(query_blocks).flatten())

    blocks = torch.arange(nb, device=device)
    rows = torch.arange(seq, device=device)
    # owned_before[r, g]: query blocks of rank r before block g (prefix counts of block ownership)
    owned_before = torch.zeros(world, nb + 1, dtype=torch.float64, device=device)
    owned_before[:, 1:] = torch.cumsum(torch.nn.functional.one_hot(owner, world).double().T, -1)
    for batch in range(index.batch):  # documents differ per row of the batch
        start, end = starts[batch], ends[batch]
        # diagonal 0: token-causal entries from each row's first visible key, every head
        causal = (rows - torch.maximum(start, rows // bs * bs) + 1).view(nb, bs).sum(-1).double()
        add(blocks, blocks, causal * index.heads)

        slash = index.slash[batch].long()
        heads_per_diagonal = torch.bincount(slash[slash != PAD], minlength=nb)[:nb].double()
        diagonals = (heads_per_diagonal > 0).nonzero().flatten()
        diagonals = diagonals[diagonals > 0]
        block_starts = start.view(nb, bs)  # each query block's rows' document starts (ascending)
        for chunk in diagonals.split(_DIAGONALS_PER_CHUNK):
            query = blocks[None, :].expand(len(chunk), nb)
            key = query - chunk[:, None]
            valid = key >= 0
            query, key = query[valid], key[valid]
            entries = _slash_block_entries(block_starts, query, key * bs)
            add(query, key, heads_per_diagonal[chunk][:, None].expand(-1, nb)[valid] * entries)

        column = index.vertical[batch].long()  # [H, Lv]
        has_column = column != PAD
        safe = torch.where(has_column, column, 0)
        cblock = safe // bs
        column_end = end[safe]  # the rows after the column that read it end with its document
        whole_end = torch.maximum(column_end // bs, cblock + 1)  # first query block not wholly inside
        later = (owned_before[:, whole_end] - owned_before[:, cblock + 1]) * bs  # [W, H, Lv]
        tail = torch.where(whole_end * bs < column_end, column_end - whole_end * bs, 0).double()
        key_owner = owner[cblock]
        for query_rank in range(world):
            mine = later[query_rank] + tail * (owner[whole_end.clamp(max=nb - 1)] == query_rank)
            work.index_add_(0, (query_rank * world + key_owner)[has_column], mine[has_column])
        # minus the later blocks already read through a slash diagonal (their rows in the document)
        target = cblock[..., :, None] + slash[..., None, :]                      # [H, Lv, Ls]
        covered = has_column[..., None] & (slash != PAD)[..., None, :] & (slash > 0)[..., None, :] \
            & (target < nb)
        target = target.clamp(max=nb - 1)
        read_rows = (column_end[..., None] - target * bs).clamp(0, bs).double()
        key_blocks = cblock[..., None].expand_as(target)
        flat = (owner[target] * world + owner[key_blocks])[covered]
        work.index_add_(0, flat, -read_rows[covered])
    return work.view(world, world)


def _slash_block_entries(block_starts: torch.Tensor, query: torch.Tensor, key_first: torch.Tensor) -> torch.Tensor:
    """Float64 [n]: entries of the full (below-diagonal) blocks of query blocks ``query`` [n]
    against keys ``key_first .. key_first + bs - 1`` [n], where ``block_starts`` [nb, bs] holds
    every query row's document start (ascending within a block): ``bs^2`` where every row's
    document starts at or before the keys, 0 where every row's starts after them, and row by
    row only for the blocks that a document start cuts."""
    bs = block_starts.shape[1]
    first, last = block_starts[query, 0], block_starts[query, -1]
    entries = torch.where(last <= key_first, float(bs * bs), 0.0).double()
    cut = (last > key_first) & (first < key_first + bs)
    if bool(cut.any()):
        keys = key_first[cut, None]
        seen = (keys + bs - torch.maximum(block_starts[query[cut]], keys)).clamp(0, bs)
        entries[cut] = seen.sum(-1).double()
    return entries


def step_work(pairs: torch.Tensor) -> torch.Tensor:
    """[W workers, W steps] from [W, W] pair work: at ring step t worker r holds the keys of
    rank (r - t) mod W."""
    world = pairs.shape[0]
    ranks = torch.arange(world)
    steps = torch.arange(world)
    return pairs[ranks[:, None], (ranks[:, None] - steps[None, :]) % world]


def imbalance(steps: torch.Tensor) -> dict:
    """Imbalance metrics of a [workers, steps] work table.

    * ``worker_level``: sum over steps of the slowest worker / sum over steps of the mean worker
      (the ring waits for the slowest worker at every step);
    * ``worker_total``: max / mean of the per-worker totals;
    * ``step_level_worst`` / ``step_level_mean``: per worker, max over its steps / mean over its
      steps, the worst and the mean over workers.
    """
    steps = steps.double()
    per_worker_step = steps.max(1).values / steps.mean(1)
    totals = steps.sum(1)
    return {
        "worker_level": float(steps.max(0).values.sum() / steps.mean(0).sum()),
        "worker_total": float(totals.max() / totals.mean()),
        "step_level_worst": float(per_worker_step.max()),
        "step_level_mean": float(per_worker_step.mean()),
    }
