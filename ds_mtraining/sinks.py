"""Attention sinks (gpt-oss's ``s_aux``): the one statement of them.

A sink is a learned logit per query head that joins every row's softmax denominator and
attends to nothing: with the row's keys ``j`` and its sink ``z``,

    p_j = exp(s_j) / (sum_j exp(s_j) + exp(z)),      out = sum_j p_j v_j

so the kernels run unchanged: their (out, lse) over the keys becomes, with
``lse' = logaddexp(lse, z)``, ``out' = out * exp(lse - lse')`` (:func:`with_sinks`: the out/LSE
merge of a partial result with the sink's, whose output is 0). The backward is the kernels' own
given (out', lse') (``P = exp(s - lse')`` is then the row's true probability and
``delta = rowsum(dout * out')`` the true one), and the sink's gradient is
``-sum over rows of exp(z - lse') * delta`` (:func:`sink_gradient`). The estimator needs
nothing: a sink scales every key's share of a row alike, so the top-p selection is unchanged.
On a ring the sink joins once, after the last step's merge.
"""
from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor, heads: int) -> torch.Tensor:
    """``sinks`` after checking it is one logit per query head."""
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != heads:
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"attention sinks must be a tensor of one logit per query head [{heads}], got {shape}")
    return sinks


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, H, D] in its dtype, lse fp32 [B, H, S]) of the keys, with the sinks [H] joined."""
    joined = torch.logaddexp(lse, sinks.detach().float()[None, :, None])
    share = torch.exp(lse - joined).transpose(1, 2)[..., None]  # [B, S, H, 1]: what the keys keep
    return (out.float() * share).to(out.dtype), joined


def sink_gradient(delta: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [H] in the sinks' dtype, from delta = rowsum(dout * out') and lse' (fp32
    [B, H, S], both after :func:`with_sinks`)."""
    return -(torch.exp(sinks.detach().float()[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)
