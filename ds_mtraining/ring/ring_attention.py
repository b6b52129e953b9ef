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
from .comm import RingComm
from .estimate import estimate_vertical_slash_distributed
from .merge import merge_partial

KV_TAG, GRAD_TAG = 1, 2


def _key_rank(comm: RingComm, step: int) -> int:
    """The rank whose K/V this rank holds at ``step``."""
    return (comm.rank - step) % comm.world


def ring_forward(comm: RingComm, q, k, v, index: SparseIndex, scale: float):
    """(out float32 [B, S/W, H, D], lse float32 [B, H, S/W]) of this rank's queries over all keys."""
    out = lse = None
    for step in range(comm.world):
        pending = comm.rotate([k, v], KV_TAG) if step + 1 < comm.world else None
        stripe = Stripe(comm.world, comm.rank, _key_rank(comm, step))
        step_out, step_lse = ops.attention_forward(q, k, v, index, scale, stripe)
        if out is None:
            out, lse = step_out, step_lse
        else:
            out, lse = merge_partial(out, lse, step_out, step_lse)
        if pending is not None:
            k, v = pending.wait()
    return out, lse


def ring_backward(comm: RingComm, dout, q, k, v, out, lse, index: SparseIndex, scale: float):
    """(dq, dk, dv) float32 for this rank's shards; ``out``/``lse`` are the merged forward ones."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads_in_flight = None
    for step in range(comm.world):
        kv_in_flight = comm.rotate([k, v], KV_TAG) if step + 1 < comm.world else None
        stripe = Stripe(comm.world, comm.rank, _key_rank(comm, step))
        dq_step, dk_step, dv_step = ops.attention_backward(dout, q, k, v, out, lse, index, scale, stripe)
        dq += dq_step
        if grads_in_flight is None:  # step 0: this rank starts the accumulators of its own keys
            dk_sum, dv_sum = dk_step.float(), dv_step.float()
        else:  # the accumulators of the keys held now, carrying the previous ranks' shares
            dk_sum, dv_sum = grads_in_flight.wait()
            dk_sum += dk_step
            dv_sum += dv_step
        grads_in_flight = comm.rotate([dk_sum, dv_sum], GRAD_TAG)
        if kv_in_flight is not None:
            k, v = kv_in_flight.wait()
    dk, dv = grads_in_flight.wait()  # the last hop brings every rank its own keys' gradients
    return dq, dk, dv


class RingSparseAttentionFunction(torch.autograd.Function):
    """Ring sparse attention on striped shards; returns (out in q's dtype, lse fp32 [B, H, S/W])."""

    @staticmethod
    def forward(ctx, q, k, v, index: SparseIndex, scale: float, comm: RingComm):
        out, lse = ring_forward(comm, q, k, v, index, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.index, ctx.scale, ctx.comm = index, scale, comm
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.comm, dout.contiguous(), q, k, v, out, lse, ctx.index,
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


def _single_device(q, k, v, config: SparseConfig, softmax_scale, index: SparseIndex | None):
    check_attention_inputs(q, k, v, index)
    scale = _default_scale(q, softmax_scale)
    if index is None:
        index = estimate_vertical_slash(q, k, config, scale)
    return sparse_attention_with_lse(q, k, v, index, scale)


def ring_sparse_attention_with_lse(q, k, v, config: SparseConfig, group=None,
                                   softmax_scale: float | None = None,
                                   index: SparseIndex | None = None):
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
        index = estimate_vertical_slash_distributed(q, k, config, comm, scale)
    else:
        if index.block_size != config.block_size:
            raise ValueError(f"index.block_size={index.block_size} differs from config.block_size="
                             f"{config.block_size}, the stripe width the data was sharded with")
        check_attention_inputs(q, k, v, index, local_index_len=local * comm.world)
    return RingSparseAttentionFunction.apply(q, k, v, index, scale, comm)


def ring_sparse_attention(q, k, v, config: SparseConfig, group=None,
                          softmax_scale: float | None = None, index: SparseIndex | None = None):
    """Like :func:`ring_sparse_attention_with_lse`, returning only this rank's output."""
    return ring_sparse_attention_with_lse(q, k, v, config, group, softmax_scale, index)[0]
