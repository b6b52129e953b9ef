"""Balanced (block-striped) sparse ring attention: forward, backward and the API a layer calls.

Each rank keeps its striped queries and, step by step, attends to the keys/values of rank
``(rank - step) mod W`` while the next step's K/V are already travelling (async P2P). Every step
calls the sparse kernel with the *global* compact index and a :class:`~ds_mtraining.index.Stripe`
naming the (query rank, key rank) pair; the kernel derives that pair's blocks and columns in
O(selected). Partial outputs merge exactly in fp32 through their LSEs.

Backward: dQ stays home; dK/dV accumulators (fp32) travel with K/V, each rank adding its share
for the keys it holds this step, and after the last step one more hop brings them home.
"""
from __future__ import annotations

import math
from dataclasses import fields

import torch
import torch.distributed as dist

from .. import ops
from ..attention import SUPPORTED_DTYPES, check_attention_inputs, sparse_attention_with_lse
from ..config import SparseConfig
from ..estimate import estimate_vertical_slash
from ..index import SparseIndex, Stripe
from .comm import PendingRotation, RingComm
from .estimate import estimate_vertical_slash_distributed
from .merge import merge_partial
from .topology import HierarchicalGroups

KV_TAG, GRAD_TAG = 1, 2


class RingSchedule:
    """Who holds which keys at each step: an inner ring over the ranks of one node nested in an
    outer ring over the nodes (the paper's Algorithm 2). The flat ring is one node (no outer ring).

    Ring position ``p = node * G + local`` is the stripe rank. At outer step ``o`` and inner step
    ``i`` position (n, l) holds the K/V of position ((n - o) mod N, (l - i) mod G), so over the
    N x G steps every (query rank, key rank) pair meets exactly once::

        2 nodes x 2, position 0:  o=0: keys of 0, 1 (inner ring)   o=1: keys of 2, 3
    """

    def __init__(self, inner: RingComm, outer: RingComm | None = None):
        self.inner, self.outer = inner, outer
        self.per_node = inner.world
        self.nodes = outer.world if outer is not None else 1
        self.node = outer.rank if outer is not None else 0
        self.world = self.nodes * self.per_node
        self.position = self.node * self.per_node + inner.rank

    def stripe(self, outer_step: int, inner_step: int) -> Stripe:
        key_node = (self.node - outer_step) % self.nodes
        key_local = (self.inner.rank - inner_step) % self.per_node
        return Stripe(self.world, self.position, key_node * self.per_node + key_local)


def ring_forward(schedule: RingSchedule, q, k, v, index: SparseIndex, scale: float):
    """(out float32 [B, S/W, H, D], lse float32 [B, H, S/W]) of this rank's queries over all keys.
    The next node's K/V travel (outer ring) during the whole inner ring over this node's K/V."""
    out = lse = None
    for outer_step in range(schedule.nodes):
        next_node_kv = (schedule.outer.rotate([k, v], KV_TAG)
                        if outer_step + 1 < schedule.nodes else None)
        inner_k, inner_v = k, v
        for inner_step in range(schedule.per_node):
            pending = (schedule.inner.rotate([inner_k, inner_v], KV_TAG)
                       if inner_step + 1 < schedule.per_node else None)
            step_out, step_lse = ops.attention_forward(q, inner_k, inner_v, index, scale,
                                                       schedule.stripe(outer_step, inner_step))
            if out is None:
                out, lse = step_out, step_lse
            else:
                out, lse = merge_partial(out, lse, step_out, step_lse)
            if pending is not None:
                inner_k, inner_v = pending.wait()
        if next_node_kv is not None:
            k, v = next_node_kv.wait()
    return out, lse


def _accumulate_and_pass(comm: RingComm | None, in_flight, dk, dv) -> PendingRotation:
    """Adds this rank's (dk, dv) share to the travelling accumulators (this rank starts them when
    none are in flight) and sends them on; on a one-rank ring (``comm`` None) they stay here."""
    if in_flight is None:
        dk_sum, dv_sum = dk.float(), dv.float()
    else:
        dk_sum, dv_sum = in_flight.wait()
        dk_sum += dk
        dv_sum += dv
    if comm is None:
        return PendingRotation([], [], [dk_sum, dv_sum])
    return comm.rotate([dk_sum, dv_sum], GRAD_TAG)


def ring_backward(schedule: RingSchedule, dout, q, k, v, out, lse, index: SparseIndex, scale: float):
    """(dq, dk, dv) float32 for this rank's shards; ``out``/``lse`` are the merged forward ones.

    dQ stays home. Inside a node, dK/dV accumulators travel with the K/V of the inner ring and
    one more hop brings them back to the rank that held those K/V at the outer step's start;
    that node share then joins the accumulator arriving over the outer ring (sent while the
    previous inner ring ran) and travels on, and a last outer hop brings it home."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    inner_comm = schedule.inner if schedule.per_node > 1 else None
    outer_comm = schedule.outer if schedule.nodes > 1 else None
    outer_grads = None
    for outer_step in range(schedule.nodes):
        next_node_kv = (schedule.outer.rotate([k, v], KV_TAG)
                        if outer_step + 1 < schedule.nodes else None)
        inner_k, inner_v, inner_grads = k, v, None
        for inner_step in range(schedule.per_node):
            pending = (schedule.inner.rotate([inner_k, inner_v], KV_TAG)
                       if inner_step + 1 < schedule.per_node else None)
            dq_step, dk_step, dv_step = ops.attention_backward(
                dout, q, inner_k, inner_v, out, lse, index, scale,
                schedule.stripe(outer_step, inner_step))
            dq += dq_step
            inner_grads = _accumulate_and_pass(inner_comm, inner_grads, dk_step, dv_step)
            if pending is not None:
                inner_k, inner_v = pending.wait()
        node_dk, node_dv = inner_grads.wait()
        outer_grads = _accumulate_and_pass(outer_comm, outer_grads, node_dk, node_dv)
        if next_node_kv is not None:
            k, v = next_node_kv.wait()
    dk, dv = outer_grads.wait()
    return dq, dk, dv


class RingSparseAttentionFunction(torch.autograd.Function):
    """Ring sparse attention on striped shards; returns (out in q's dtype, lse fp32 [B, H, S/W])."""

    @staticmethod
    def forward(ctx, q, k, v, index: SparseIndex, scale: float, schedule: RingSchedule):
        out, lse = ring_forward(schedule, q, k, v, index, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.index, ctx.scale, ctx.schedule = index, scale, schedule
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.schedule, dout.contiguous(), q, k, v, out, lse, ctx.index,
                                   ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# ---------------------------------------------------------------------- input agreement
_DESCRIPTOR_LEN = 16 + len(fields(SparseConfig))


def _describe(q, k, v, config: SparseConfig, index: SparseIndex | None) -> list[int]:
    """Ints that every rank's call must agree on: shapes, dtypes, config, index identity."""
    desc = []
    for t in (q, k, v):
        shape = list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else [-1] * 4
        desc += shape
        desc.append(SUPPORTED_DTYPES.index(t.dtype) if isinstance(t, torch.Tensor)
                    and t.dtype in SUPPORTED_DTYPES else -1)
    desc.append(-1 if index is None else index.seq_len)
    for value in config.to_dict().values():
        desc.append(round(value * 1_000_000) if isinstance(value, float) else int(value))
    assert len(desc) == _DESCRIPTOR_LEN
    return desc


def _index_fingerprint(index: SparseIndex | None, device) -> torch.Tensor:
    """Int64 [4]: sizes and sums of the index lists (O(selected)), zeros without an index."""
    if index is None:
        return torch.zeros(4, dtype=torch.int64, device=device)
    return torch.stack([torch.tensor(index.slash.numel(), device=device),
                        torch.tensor(index.vertical.numel(), device=device),
                        index.slash.to(device).long().sum(), index.vertical.to(device).long().sum()])


_DESCRIPTOR_NAMES = (["q.batch", "q.seq", "q.heads", "q.head_dim", "q.dtype",
                      "k.batch", "k.seq", "k.heads", "k.head_dim", "k.dtype",
                      "v.batch", "v.seq", "v.heads", "v.head_dim", "v.dtype", "index.seq_len"]
                     + [f"config.{f.name}" for f in fields(SparseConfig)]
                     + ["index.slash size", "index.vertical size", "index.slash sum",
                        "index.vertical sum"])


def check_ranks_agree(comm: RingComm, q, k, v, config: SparseConfig, index: SparseIndex | None):
    """One small all-gather before any ring step: raises the same error on every rank when the
    ranks' shapes, dtypes, configs or indices differ (instead of hanging in a mismatched ring)."""
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    mine = torch.cat([torch.tensor(_describe(q, k, v, config, index), dtype=torch.int64,
                                   device=device), _index_fingerprint(index, device)])
    parts = [torch.empty_like(mine) for _ in range(comm.world)]
    dist.all_gather(parts, mine, group=comm.group)
    table = torch.stack(parts).cpu()
    differ = (table != table[0]).any(0)
    if bool(differ.any()):
        lines = [f"  {_DESCRIPTOR_NAMES[i]}: " + ", ".join(
            f"rank {r}={int(table[r, i])}" for r in range(comm.world))
            for i in differ.nonzero().flatten().tolist()]
        raise ValueError("ring_sparse_attention: the ranks of the group were called with different "
                         "inputs; every rank must pass its S/W-token shard of the same attention "
                         "(same shapes, dtype, config and index):\n" + "\n".join(lines))


# ---------------------------------------------------------------------- API
def _default_scale(q, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def estimate_index(q, k, config: SparseConfig, group=None, scale: float | None = None) -> SparseIndex:
    """This step's global vertical-slash index: from the striped shards of ``group`` with small
    collectives, or on one device when there is no group of several ranks."""
    scale = _default_scale(q, scale)
    if (group is None and not dist.is_initialized()) or dist.get_world_size(group) == 1:
        return estimate_vertical_slash(q, k, config, scale)
    return estimate_vertical_slash_distributed(q, k, config, RingComm(group), scale)


def _single_device(q, k, v, config: SparseConfig, softmax_scale, index: SparseIndex | None):
    check_attention_inputs(q, k, v, index)
    scale = _default_scale(q, softmax_scale)
    if index is None:
        index = estimate_vertical_slash(q, k, config, scale)
    return sparse_attention_with_lse(q, k, v, index, scale)


def ring_schedule(group, hierarchy: HierarchicalGroups | None) -> RingSchedule:
    """The flat ring over ``group``, or the hierarchical one over ``hierarchy``'s inner and outer
    groups, checked to tile ``group`` with ring positions equal to the group ranks (the stripe)."""
    comm = RingComm(group)
    if hierarchy is None:
        return RingSchedule(comm)
    if (hierarchy.nodes * hierarchy.per_node, hierarchy.position) != (comm.world, comm.rank):
        raise ValueError(
            f"the hierarchical groups ({hierarchy.nodes} nodes x {hierarchy.per_node}, position "
            f"{hierarchy.position}) do not tile the sequence-parallel group (size {comm.world}, "
            f"this rank {comm.rank}); create them with create_hierarchical_groups from that group")
    return RingSchedule(RingComm(hierarchy.inner),
                        RingComm(hierarchy.outer) if hierarchy.nodes > 1 else None)


def ring_sparse_attention_with_lse(q, k, v, config: SparseConfig, group=None,
                                   softmax_scale: float | None = None,
                                   index: SparseIndex | None = None,
                                   hierarchy: HierarchicalGroups | None = None):
    """Causal vertical-slash sparse attention over a sequence striped across ``group``.

    Args:
        q: [B, S/W, H, D], this rank's striped shard of the queries (after RoPE with the global
            position ids, see :class:`~ds_mtraining.ring.layout.StripedLayout`).
        k, v: [B, S/W, Hkv, D], H a multiple of Hkv.
        config: the sparse pattern's budgets; ``config.block_size`` is the stripe width.
        group: the sequence-parallel process group (``None``: the default group, or the
            single-device path when torch.distributed is not initialised). A group of one rank
            runs the single-device path.
        softmax_scale: defaults to 1/sqrt(D).
        index: a global :class:`SparseIndex` for [B, S, H] to use instead of estimating one
            (distributedly, each call).
        hierarchy: this rank's inner/outer groups of ``group``
            (:func:`~ds_mtraining.ring.topology.create_hierarchical_groups`) to run the
            hierarchical ring; ``None`` runs the flat ring.
    Returns:
        (out [B, S/W, H, D] in q's dtype, lse float32 [B, H, S/W]) for this rank's queries.
    """
    if not isinstance(config, SparseConfig):
        raise TypeError(f"config must be a SparseConfig, got {type(config).__name__}")
    if group is None and not dist.is_initialized():
        return _single_device(q, k, v, config, softmax_scale, index)
    comm = RingComm(group)
    if comm.world == 1:
        return _single_device(q, k, v, config, softmax_scale, index)
    check_ranks_agree(comm, q, k, v, config, index)
    # From here on every rank holds the same shapes, so every check below fails everywhere alike.
    check_attention_inputs(q, k, v)
    scale = _default_scale(q, softmax_scale)
    local = q.shape[1]
    if local % config.block_size != 0:
        raise ValueError(
            f"each rank's shard holds {local} tokens, not a multiple of block_size="
            f"{config.block_size}: the sequence length S={local * comm.world} must be divisible by "
            f"world x block_size = {comm.world} x {config.block_size}; pad the sequence")
    if index is None:
        index = estimate_index(q, k, config, group, scale)
    else:
        if index.block_size != config.block_size:
            raise ValueError(f"index.block_size={index.block_size} differs from config.block_size="
                             f"{config.block_size}, the stripe width the data was sharded with")
        check_attention_inputs(q, k, v, index, local_index_len=local * comm.world)
    schedule = ring_schedule(group, hierarchy)
    return RingSparseAttentionFunction.apply(q, k, v, index, scale, schedule)


def ring_sparse_attention(q, k, v, config: SparseConfig, group=None,
                          softmax_scale: float | None = None, index: SparseIndex | None = None,
                          hierarchy: HierarchicalGroups | None = None):
    """Like :func:`ring_sparse_attention_with_lse`, returning only this rank's output."""
    return ring_sparse_attention_with_lse(q, k, v, config, group, softmax_scale, index, hierarchy)[0]
