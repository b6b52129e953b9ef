"""Distributed vertical-slash estimation: :func:`~ds_mtraining.estimate.estimate_vertical_slash`
on the unstriped sequence, computed from the ranks' striped shards with small collectives
(sizes in elements, L = last_q, W ranks, S/W local tokens, nb_local = S / (W block) blocks):

* the last L queries are broadcast from the rank(s) holding them (``L x H x D``);
* each rank scores them against its own keys; the softmax max and sum are all-reduced
  (``B x H x L`` each);
* token diagonals: a rank sums, per local key block, the diagonals its keys lie on and files each
  under the diagonal's last key (the key of row L - 1). A diagonal's L keys are consecutive, so its
  earlier part may lie in the previous block(s); that spill (``B x H x nb_local x (L - 1)``, about
  ``(L - 1) / block`` of a local mass list) is sent one rank ahead along the ring (one hop when
  L <= block + 1). Afterwards each rank holds the complete mass of the S/W diagonals whose last
  key it holds;
* vertical columns and token diagonals are then each selected without gathering the lists: every
  rank sorts its own masses and all-gathers only its leading candidates (mass, position; ``W x B x
  H x width`` each, width <= cap). A merged prefix is exact up to the first rank whose candidate list
  ran out; if the top-p count reaches past it, the ranks widen their lists to the cap (one more
  all-gather). Ties break by position exactly as in :func:`~ds_mtraining.estimate.select_top_p`.

Every rank ends with the same global :class:`~ds_mtraining.index.SparseIndex`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention import resolve_softmax_scale
from ..config import SparseConfig
from ..estimate import (check_qk, estimate_vertical_slash, last_key_mass, last_query_scores,
                        sink_columns, top_p_count)
from ..index import SparseIndex
from .comm import RingComm, ring_comm
from .layout import StripedLayout

def _last_queries(q: torch.Tensor, layout: StripedLayout, comm: RingComm, count: int) -> torch.Tensor:
    """Float32 [B, count, H, D]: the queries at global positions S - count .. S - 1, on every
    rank, broadcast by the ranks that hold them (one rank when count <= block_size)."""
    b, local, h, d = q.shape
    seq_len = local * comm.world
    first = seq_len - count
    last_queries = torch.empty(b, count, h, d, dtype=torch.float32, device=q.device)
    for owner in range(comm.world):
        pos = layout.positions(seq_len, owner, device=q.device)
        held = (pos >= first).nonzero().flatten()
        if held.numel() == 0:
            continue
        part = (q[:, held].float().contiguous() if owner == comm.rank
                else torch.empty(b, held.numel(), h, d, dtype=torch.float32, device=q.device))
        dist.broadcast(part, dist.get_global_rank(comm.group, owner), group=comm.group)
        last_queries[:, pos[held] - first] = part
    return last_queries


def _all_gather(tensor: torch.Tensor, comm: RingComm) -> torch.Tensor:
    """[W, *tensor.shape]: every rank's tensor, in group-rank order."""
    parts = [torch.empty_like(tensor) for _ in range(comm.world)]
    dist.all_gather(parts, tensor.contiguous(), group=comm.group)
    return torch.stack(parts)


def _candidate_widths(local_len: int, cap: int, world: int) -> list[int]:
    """List lengths each rank offers, in rounds: a fair share first, then the cap (always exact)."""
    full = min(local_len, cap)
    first = min(full, max(64, 2 * -(-cap // world)))
    return sorted({first, full})


def select_top_p_across_ranks(local_mass: torch.Tensor, local_positions: torch.Tensor, p: float,
                              cap: int, comm: RingComm) -> torch.Tensor:
    """:func:`~ds_mtraining.estimate.select_top_p` over the concatenation of every rank's
    ``local_mass`` [B, H, n] (global ``local_positions`` [n], ascending), without gathering it.

    Returns global positions [B, H, <=cap], -1 padded, identical on every rank.
    """
    total = local_mass.sum(-1)
    dist.all_reduce(total, group=comm.group)
    local_sorted, local_order = local_mass.sort(dim=-1, descending=True, stable=True)
    local_sorted_pos = local_positions[local_order]
    for width in _candidate_widths(local_mass.shape[-1], cap, comm.world):
        mass = _all_gather(local_sorted[..., :width], comm)          # [W, B, H, width]
        pos = _all_gather(local_sorted_pos[..., :width], comm)
        boundary = pos[..., -1].movedim(0, -1)                        # [B, H, W]: last offered
        mass, pos = (t.movedim(0, -2).flatten(-2) for t in (mass, pos))  # [B, H, W * width]
        # sort by position, then stably by mass: ties break by position as in select_top_p
        by_pos = pos.argsort(dim=-1)
        mass, pos = mass.gather(-1, by_pos), pos.gather(-1, by_pos)
        mass, order = mass.sort(dim=-1, descending=True, stable=True)
        pos = pos.gather(-1, order)
        count = top_p_count(mass, p, cap, total=total)
        if width == local_mass.shape[-1]:
            exact_prefix = torch.full_like(count, pos.shape[-1])
        else:
            # a rank's unseen entries all sort after the last one it offered
            boundary_at = (pos[..., None, :] == boundary[..., :, None]).int().argmax(-1)
            exact_prefix = boundary_at.min(-1).values + 1
        if bool((count <= exact_prefix).all()):
            break
    else:
        raise AssertionError("the widest candidate round is always exact")
    keep = torch.arange(int(count.max()), device=pos.device) < count[..., None]
    return torch.where(keep, pos[..., :keep.shape[-1]], -1)


def owned_diagonal_mass(probs: torch.Tensor, block_size: int, comm: RingComm) -> torch.Tensor:
    """Token-diagonal masses [B, H, S/W] (undivided by L) of the diagonals whose last key this
    rank holds, in its key order, from ``probs`` [B, H, L, S/W] of the last L queries against its
    striped keys. The spill into following global blocks travels ahead along the ring."""
    b, h, lq, local = probs.shape
    blocks = local // block_size
    per_block = last_key_mass(probs.view(b, h, lq, blocks, block_size).transpose(2, 3))
    owned = per_block[..., :block_size].clone()       # [B, H, blocks, block]
    spill = per_block[..., block_size:]               # lands in the next global block(s)
    while spill.shape[-1]:
        if comm.world > 1:
            spill = comm.rotate([spill]).wait()[0]
        if comm.rank == 0:  # from the last rank: global block l W + W - 1 is followed by our l + 1
            spill = torch.cat([torch.zeros_like(spill[:, :, :1]), spill[:, :, :-1]], 2)
        arrived = spill[..., :block_size]
        owned[..., :arrived.shape[-1]] += arrived
        spill = spill[..., block_size:]
    return owned.flatten(2)


@torch.no_grad()
def estimate_vertical_slash_distributed(q: torch.Tensor, k: torch.Tensor, config: SparseConfig,
                                        comm: RingComm, softmax_scale: float | None = None
                                        ) -> SparseIndex:
    """The global vertical-slash index of the striped sequence whose shards q [B, S/W, H, D],
    k [B, S/W, Hkv, D] this rank holds; equal to ``estimate_vertical_slash`` on the unstriped
    q, k (up to float summation order). Collective: every rank of ``comm`` must call it."""
    check_qk(q, k)
    b, local, h, d = q.shape
    seq_len = local * comm.world
    layout = StripedLayout(comm.world, config.block_size)
    scale = resolve_softmax_scale(d, softmax_scale)
    count = min(config.last_q, seq_len)
    q_pos = torch.arange(seq_len - count, seq_len, device=q.device)
    k_pos = layout.positions(seq_len, comm.rank, device=q.device)

    logits = last_query_scores(_last_queries(q, layout, comm, count), k, q_pos, k_pos, scale)
    row_max = logits.amax(-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=comm.group)
    probs = torch.exp(logits - row_max[..., None])
    row_sum = probs.sum(-1)
    dist.all_reduce(row_sum, group=comm.group)
    probs /= row_sum[..., None]

    columns = probs.sum(-2) / count
    diagonals = owned_diagonal_mass(probs, config.block_size, comm).flip(-1) / count
    diagonal_pos = (seq_len - 1 - k_pos).flip(0)  # t = S - 1 - last key, ascending
    slash = select_top_p_across_ranks(diagonals, diagonal_pos, config.p_slash,
                                      config.max_slash_diagonals, comm)
    vertical = select_top_p_across_ranks(columns, k_pos, config.p_vertical, config.max_vertical, comm)
    vertical = torch.cat([vertical, sink_columns(b, h, config, seq_len, q.device)], -1)
    return SparseIndex.from_vertical_slash(vertical, slash, seq_len, config.block_size,
                                           config.local_blocks)


def estimate_index(q, k, config: SparseConfig, group=None, softmax_scale: float | None = None
                   ) -> SparseIndex:
    """This step's global vertical-slash index: from the striped shards of ``group`` with small
    collectives, or on one device when there is no group of several ranks."""
    comm = ring_comm(group)
    if comm is None:
        return estimate_vertical_slash(q, k, config, softmax_scale)
    return estimate_vertical_slash_distributed(q, k, config, comm, softmax_scale)
