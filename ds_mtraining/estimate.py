"""Online vertical-slash pattern estimation (the paper's Algorithm 1), vectorised over heads.

The last ``last_q`` queries are scored causally against every key; per head,

* vertical: the mass of each key column, summed over those rows; the fewest columns whose mass
  reaches ``p_vertical`` (top-p), capped by ``max_vertical``, plus the sink tokens;
* slash: the mass of each block diagonal (query block minus key block: exactly what one selected
  slash block of the kernel computes for those rows); the fewest reaching ``p_slash``, capped by
  ``max_slash_blocks``, plus the local diagonals.

Every budget is at least 1 (a head whose top entry alone reaches p keeps that entry). The pieces
(:func:`last_query_scores`, :func:`column_and_diagonal_mass`, :func:`top_p_count`) are shared
with the distributed estimator, which computes the same masses from sequence shards.
"""
from __future__ import annotations

import math

import torch

from .config import SparseConfig
from .index import SparseIndex


def check_qk(q: torch.Tensor, k: torch.Tensor):
    """Validates the [B, S, H, D] layout and GQA head counts of q and k."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be [batch, seq, heads, head_dim] (FlashAttention layout); got "
            f"{tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, seq and head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for GQA")


def last_query_scores(q_last: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Fp32 logits [B, H, Lq, Sk] of the trailing queries against keys, -inf where k_pos > q_pos.
    GQA is handled by grouping query heads, never by expanding K."""
    b, lq, h, d = q_last.shape
    hkv = k.shape[2]
    qg = q_last.float().view(b, lq, hkv, h // hkv, d)
    logits = torch.einsum("bqkgd,bskd->bkgqs", qg, k.float()).reshape(b, h, lq, k.shape[1])
    visible = q_pos.view(-1, 1) >= k_pos.view(1, -1)
    return logits.mul_(scale).masked_fill_(~visible, float("-inf"))


def column_and_diagonal_mass(probs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                             seq_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From probabilities [B, H, Lq, Sk] (rows sum to 1 over the whole sequence): the mass of
    each local key column [B, H, Sk] and of each global block diagonal [B, H, nb], both summed
    over the rows and divided by their number."""
    b, h, lq, _ = probs.shape
    nb = -(-seq_len // block_size)
    columns = probs.sum(2) / lq
    offset = q_pos.view(-1, 1) // block_size - k_pos.view(1, -1) // block_size
    offset = offset.clamp(0, nb - 1).expand(lq, -1).reshape(-1)
    diagonals = torch.zeros(b, h, nb, dtype=probs.dtype, device=probs.device)
    diagonals.scatter_add_(-1, offset.expand(b, h, -1), probs.reshape(b, h, -1))
    return columns, diagonals / lq


def top_p_count(sorted_mass: torch.Tensor, p: float, cap: int,
                total: torch.Tensor | None = None) -> torch.Tensor:
    """The fewest leading entries of a descending mass list [..., n] whose sum reaches p * total,
    clamped to [1, min(cap, n)]. ``total`` [...] defaults to the list's sum; the distributed
    estimator passes the all-reduced total when the list holds only the leading candidates."""
    total = sorted_mass.sum(-1, keepdim=True) if total is None else total[..., None]
    before = sorted_mass.cumsum(-1) - sorted_mass  # mass of the entries ahead of each one
    count = (before < p * total * (1 - 1e-6)).sum(-1)
    return count.clamp(min=1, max=min(cap, sorted_mass.shape[-1]))


def select_top_p(mass: torch.Tensor, p: float, cap: int) -> torch.Tensor:
    """Positions [..., <=cap] of the top-p entries of ``mass``, -1 padded (ties broken by
    position, so every caller selects the same set)."""
    values, order = mass.sort(dim=-1, descending=True, stable=True)
    count = top_p_count(values, p, cap)
    width = int(count.max())
    keep = torch.arange(width, device=mass.device) < count[..., None]
    return torch.where(keep, order[..., :width], -1)


def sink_columns(batch: int, heads: int, config: SparseConfig, seq_len: int, device) -> torch.Tensor:
    sinks = torch.arange(min(config.sink_tokens, seq_len), device=device)
    return sinks.expand(batch, heads, -1)


@torch.no_grad()
def estimate_vertical_slash(q: torch.Tensor, k: torch.Tensor, config: SparseConfig,
                            softmax_scale: float | None = None) -> SparseIndex:
    """Estimates the vertical-slash index of causal attention ``softmax(q k^T)`` for this step.

    Args:
        q: [B, S, H, D] queries (after RoPE); k: [B, S, Hkv, D] keys, H a multiple of Hkv.
        config: budgets and granularity.
    Returns:
        A :class:`SparseIndex` for [B, S, H].
    """
    check_qk(q, k)
    b, s, h, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    lq = min(config.last_q, s)
    pos = torch.arange(s, device=q.device)
    logits = last_query_scores(q[:, s - lq:], k, pos[s - lq:], pos, scale)
    probs = torch.softmax(logits, dim=-1)
    columns, diagonals = column_and_diagonal_mass(probs, pos[s - lq:], pos, s, config.block_size)
    vertical = select_top_p(columns, config.p_vertical, config.max_vertical)
    vertical = torch.cat([vertical, sink_columns(b, h, config, s, q.device)], -1)
    slash = select_top_p(diagonals, config.p_slash, config.max_slash_blocks)
    return SparseIndex.from_blocks(slash, vertical, s, config.block_size, config.local_blocks)
