"""Distributed vertical-slash estimation: :func:`~ds_mtraining.estimator.rule.estimate_vertical_slash`
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
  all-gather). Ties break by position exactly as in :func:`~ds_mtraining.estimator.rule.select_top_p`.

Every rank ends with the same global :class:`~ds_mtraining.index.SparseIndex`.

With document masking (``doc_start``), :func:`estimate_documents_gathered` all-gathers k and only
the query rows the document-aware rule reads (each document's last ``last_q``:
:func:`~ds_mtraining.estimator.rule.document_query_positions`) and runs the rule on every rank: exact
and simple, but the keys cost O(S) memory per rank (``S x Hkv x D``; a sharded version is
future work).

On CUDA inputs the fused estimator takes (:func:`fused_estimator_takes`),
:func:`estimate_vertical_slash_cuda_distributed` computes the same index from the fused passes
with fixed-size collectives only, so that nothing waits for the GPU on the host: after the
diagonal spill every rank all-gathers both complete local mass lists (``W x 2 x B x H x S/W``
floats: 128 MB received per rank at 1M tokens and 16 heads) and runs the single-device top-p selection
kernel on the global lists, so the index equals the single-device one. Sorting the local lists
for candidates (the torch path above) costs more GPU time than these bytes. :func:`estimate_index`
picks the path.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention import resolve_softmax_scale
from ..config import SparseConfig
from ..distributed.comm import RingComm
from ..index import SparseIndex
from ..layout import StripedLayout
from . import fused
from .rule import check_qk, last_key_mass, last_query_scores, sink_columns, top_p_count

def _tail_runs(seq_len: int, world: int, block: int, count: int) -> list[tuple[int, int, int, int]]:
    """(owner rank, local start, local end, offset in the tail) of each run of the last ``count``
    global positions, one run per global block (host arithmetic: no device index tensors)."""
    first = seq_len - count
    runs = []
    for g in range(first // block, -(-seq_len // block)):
        start, end = max(first, g * block), min(seq_len, (g + 1) * block)
        local = (g // world) * block - g * block
        runs.append((g % world, local + start, local + end, start - first))
    return runs


def held_last_queries(q: torch.Tensor, comm: RingComm, block_size: int, count: int,
                      dtype=torch.float32) -> torch.Tensor:
    """[B, n, H, D] in ``dtype``: the rows of the last ``count`` global queries that this rank's
    shard ``q`` holds (n = 0 on ranks holding none), in global order. Only slices."""
    b, local, h, d = q.shape
    runs = _tail_runs(local * comm.world, comm.world, block_size, count)
    mine = [q[:, start:end] for owner, start, end, _ in runs if owner == comm.rank]
    if not mine:
        return q.new_empty(b, 0, h, d, dtype=dtype)
    return torch.cat(mine, 1).to(dtype).contiguous()


def broadcast_last_queries(held: torch.Tensor, comm: RingComm, seq_len: int, block_size: int,
                           count: int) -> torch.Tensor:
    """[B, count, H, D]: the queries at global positions S - count .. S - 1 on every rank, from
    each rank's :func:`held_last_queries` (one broadcast per holding rank: one when count <=
    block_size). No host synchronisation."""
    b, _, h, d = held.shape
    last_queries = torch.empty(b, count, h, d, dtype=held.dtype, device=held.device)
    runs = _tail_runs(seq_len, comm.world, block_size, count)
    for owner in range(comm.world):
        theirs = [r for r in runs if r[0] == owner]
        if not theirs:
            continue
        size = sum(end - start for _, start, end, _ in theirs)
        part = held if owner == comm.rank else held.new_empty(b, size, h, d)
        dist.broadcast(part, dist.get_global_rank(comm.group, owner), group=comm.group)
        at = 0
        for _, start, end, offset in theirs:
            last_queries[:, offset:offset + end - start] = part[:, at:at + end - start]
            at += end - start
    return last_queries


def _last_queries(q: torch.Tensor, layout: StripedLayout, comm: RingComm, count: int,
                  dtype=torch.float32) -> torch.Tensor:
    """[B, count, H, D] in ``dtype``: the last ``count`` global queries, on every rank."""
    held = held_last_queries(q, comm, layout.block_size, count, dtype)
    return broadcast_last_queries(held, comm, q.shape[1] * comm.world, layout.block_size, count)


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
    """:func:`~ds_mtraining.estimator.rule.select_top_p` over the concatenation of every rank's
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


# ---------------------------------------------------------------------- fused CUDA, distributed
def merge_row_stats(row_max: torch.Tensor, row_sum: torch.Tensor, group=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's :func:`ds_mtraining.estimator.fused.row_stats` combined into the global ones
    (collective, on the GPU): one all-gather of the (max, sum) pairs, then on every rank, in rank
    order, the max over ranks and each rank's sum rescaled to it, summed."""
    world = dist.get_world_size(group)
    local = torch.stack([row_max, row_sum.to(row_max.dtype)])
    parts = torch.empty((world * 2, *row_max.shape), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(parts, local.contiguous(), group=group)
    maxes, sums = parts.view(world, 2, *row_max.shape).unbind(1)
    global_max = maxes.amax(0)
    finite = torch.isfinite(maxes)
    scaled = torch.where(finite, sums * torch.exp(torch.where(finite, maxes, global_max) - global_max),
                         torch.zeros_like(sums))
    return global_max, scaled.sum(0)


def owned_diagonals_from_shares(shares: torch.Tensor, layout: StripedLayout, comm: RingComm,
                                count: int) -> torch.Tensor:
    """The complete token-diagonal masses [B, H, S/W] of the diagonals whose last key this rank
    holds, in its key order, from ``shares`` [B, H, S]: this rank's keys' share of every diagonal
    (index t = query - key; the fused estimator's pass B).

    A diagonal's ``count`` keys end at its last key e; only the first ``count - 1`` keys of a
    block can share a diagonal with earlier blocks, which other ranks hold (up to
    ``ceil((count - 1) / block)`` blocks back). So each rank sends to each of the next
    ``hops = min(W - 1, ceil((count - 1) / block))`` ranks its shares of the diagonals ending in
    the first ``min(block, count - 1)`` keys of that rank's blocks (``B x H x S/(W block) x
    min(block, count - 1)`` each, all hops in one batch of P2P transfers), and adds what it
    receives: exact, fixed sizes, no host synchronisation."""
    b, h, seq_len = shares.shape
    world, rank, block = comm.world, comm.rank, layout.block_size
    local = seq_len // world

    def shares_ending_at(owner: int, leading: int | None = None) -> torch.Tensor:
        ends = layout.positions(seq_len, owner, device=shares.device)
        if leading is not None:
            ends = ends.view(local // block, block)[:, :leading].reshape(-1)
        return shares.index_select(-1, seq_len - 1 - ends)

    owned = shares_ending_at(rank)
    leading = min(block, count - 1)
    hops = min(world - 1, -(-(count - 1) // block))
    if leading <= 0 or hops <= 0:
        return owned
    ops, received = [], []
    for hop in range(1, hops + 1):
        to, source = (rank + hop) % world, (rank - hop) % world
        outgoing = shares_ending_at(to, leading)
        incoming = torch.empty_like(outgoing)
        ops.append(dist.P2POp(dist.isend, outgoing, dist.get_global_rank(comm.group, to), comm.group, hop))
        ops.append(dist.P2POp(dist.irecv, incoming, dist.get_global_rank(comm.group, source), comm.group, hop))
        received.append(incoming)
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    head = owned.view(b, h, local // block, block)[..., :leading]
    for incoming in received:
        head += incoming.view(b, h, local // block, leading)
    return owned


@torch.no_grad()
def estimate_vertical_slash_cuda_distributed(q: torch.Tensor, k: torch.Tensor, config: SparseConfig,
                                             comm: RingComm, softmax_scale: float | None = None,
                                             passes=None) -> SparseIndex:
    """:func:`estimate_vertical_slash_distributed` with the fused CUDA estimator's passes
    (:mod:`ds_mtraining.estimator.fused`) and without host synchronisation. Collectives per call
    (elements): broadcast of the last L queries (``L x H x D``), an all-gather of the row
    statistics (``W x 2 x B x H x L``, :func:`merge_row_stats`), the diagonal spill to the next
    rank(s) (:func:`owned_diagonals_from_shares`, about ``(L - 1) / block`` of a local mass list)
    and one all-gather of both complete mass lists (``W x 2 x B x H x S/W``), which every rank
    then selects from as on one device: four collectives. The result is exact (the rule on the
    global masses) and identical on every rank.

    ``passes``: an object with the functions ``row_stats``, ``masses``, ``select_top_p_padded_pair`` and
    ``build_index`` of
    :mod:`ds_mtraining.estimator.fused` (the default); tests pass torch versions to run this on CPU."""
    check_qk(q, k)
    return estimate_from_held_queries(held_estimator_queries(q, k, config, comm), k, config, comm,
                                      resolve_softmax_scale(q.shape[-1], softmax_scale), passes)


def held_estimator_queries(q: torch.Tensor, k: torch.Tensor, config: SparseConfig, comm: RingComm) -> torch.Tensor:
    """This rank's share of the last ``last_q`` queries that the fused estimator scores
    (:func:`held_last_queries`, in the keys' dtype)."""
    return held_last_queries(q, comm, config.block_size, min(config.last_q, q.shape[1] * comm.world), k.dtype)


@torch.no_grad()
def estimate_from_held_queries(held: torch.Tensor, k: torch.Tensor, config: SparseConfig, comm: RingComm,
                               scale: float, passes=None) -> SparseIndex:
    """:func:`estimate_vertical_slash_cuda_distributed` from this rank's
    :func:`held_last_queries` and keys: every launch of the path, with fixed shapes and no host
    synchronisation (what :mod:`ds_mtraining.estimator.graphs` captures)."""
    passes = passes if passes is not None else fused
    seq_len = k.shape[1] * comm.world
    world, rank, block = comm.world, comm.rank, config.block_size
    layout = StripedLayout(world, block)
    count = min(config.last_q, seq_len)
    first = seq_len - count
    q_last = broadcast_last_queries(held, comm, seq_len, block, count)
    stats = passes.row_stats(q_last, k, first, seq_len, scale, world, rank, block)
    row_max, row_sum = merge_row_stats(*stats, group=comm.group)
    columns, shares = passes.masses(q_last, k, row_max, row_sum, first, seq_len, scale, world, rank, block)
    diagonals = owned_diagonals_from_shares(shares, layout, comm, count)  # by last key
    local = torch.stack([columns.float(), diagonals.float()])            # [2, B, H, S/W]
    gathered = local.new_empty(world * 2, *local.shape[1:])
    dist.all_gather_into_tensor(gathered, local.contiguous(), group=comm.group)
    columns, by_last_key = layout.unshard_stacked(gathered.view(world, *local.shape))
    (vertical, vertical_count), (slash, slash_count) = passes.select_top_p_padded_pair(
        columns, config.p_vertical, config.max_vertical,
        by_last_key.flip(-1), config.p_slash, config.max_slash_diagonals)  # by t = S - 1 - last key
    return passes.build_index(slash, slash_count, vertical, vertical_count, seq_len, config)
