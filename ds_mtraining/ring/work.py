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
"""
from __future__ import annotations

import torch

from ..index import PAD, SparseIndex
from .layout import Layout

_DIAGONALS_PER_CHUNK = 256


def pair_work(index: SparseIndex, layout: Layout) -> torch.Tensor:
    """Float64 [W, W]: entries computed for queries held by rank ``r`` (row) against keys held
    by rank ``s`` (column), summed over batch and heads: row sums are per-rank totals.

    Equal to ``reference.mask_between(index, positions(r), positions(s)).sum()`` (tests check it
    at small S).
    """
    if index.seq_len % index.block_size != 0:
        raise ValueError(f"seq_len={index.seq_len} must be whole blocks of {index.block_size}")
    if layout.block_size != index.block_size:
        raise ValueError(f"the layout's block_size={layout.block_size} differs from the index's "
                         f"{index.block_size}")
    nb, bs, world = index.num_blocks, index.block_size, layout.world
    owner = layout.block_owner(nb).to(index.device)
    work = torch.zeros(world * world, dtype=torch.float64, device=index.device)

    def add(query_blocks, key_blocks, weight):
        flat = (owner[query_blocks] * world + owner[key_blocks]).flatten()
        work.index_add_(0, flat, torch.as_tensor(weight, dtype=torch.float64,
                                                 device=index.device).expand_as(query_blocks).flatten())

    blocks = torch.arange(nb, device=index.device)
    add(blocks, blocks, bs * (bs + 1) / 2 * index.batch * index.heads)

    slash = index.slash.long()
    heads_per_diagonal = torch.bincount(slash[slash != PAD], minlength=nb)[:nb].double()
    diagonals = (heads_per_diagonal > 0).nonzero().flatten()
    diagonals = diagonals[diagonals > 0]
    for chunk in diagonals.split(_DIAGONALS_PER_CHUNK):
        query = blocks[None, :].expand(len(chunk), nb)
        key = query - chunk[:, None]
        valid = key >= 0
        weight = (heads_per_diagonal[chunk][:, None] * bs * bs).expand(-1, nb)
        add(query[valid], key[valid], weight[valid])

    column = index.vertical.long()
    has_column = column != PAD
    cblock = torch.where(has_column, column // bs, 0)
    # later query blocks per owner: ranks x (nb + 1) prefix counts of block ownership
    owned_before = torch.zeros(world, nb + 1, dtype=torch.float64, device=index.device)
    owned_before[:, 1:] = torch.cumsum(torch.nn.functional.one_hot(owner, world).double().T, -1)
    later = owned_before[:, nb, None, None, None] - owned_before[:, cblock + 1]  # [W, B, H, Lv]
    later = later * has_column * bs
    key_owner = owner[cblock]
    for query_rank in range(world):
        work.index_add_(0, (query_rank * world + key_owner)[has_column], later[query_rank][has_column])
    # minus the later blocks already read through a slash diagonal
    target = cblock[..., :, None] + slash[..., None, :]                      # [B, H, Lv, Ls]
    covered = has_column[..., None] & (slash != PAD)[..., None, :] & (slash > 0)[..., None, :] \
        & (target < nb)
    target = target.clamp(max=nb - 1)
    key_blocks = cblock[..., None].expand_as(target)
    flat = (owner[target] * world + owner[key_blocks])[covered]
    work.index_add_(0, flat, torch.full(flat.shape, -float(bs), dtype=torch.float64,
                                        device=index.device))
    return work.view(world, world)


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
