"""Exact fp32 merge of partial attention results (out, LSE) from ring steps: the rule the ops
apply in place when given a running out/lse (the ring loop), here as a function of tensors."""
from __future__ import annotations

import torch


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row that saw no key) becomes 0, so that subtracting it cannot make NaN."""
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


def merge_lse(lse_a: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """log(exp(a) + exp(b)) as ``max + log1p(exp(min - max))``; -inf when both are -inf."""
    high = torch.maximum(lse_a, lse_b)
    low = torch.minimum(lse_a, lse_b)
    return high + torch.log1p(torch.exp(low - _finite_or_zero(high)))


def merge_partial(out: torch.Tensor, lse: torch.Tensor, step_out: torch.Tensor,
                  step_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges a step's partial attention into the running one.

    Args:
        out, step_out: float32 [B, S, H, D] outputs, each normalised over its own keys.
        lse, step_lse: float32 [B, H, S] log-sum-exps of those keys (-inf: no key seen).
    Returns:
        (out, lse) over the union of the keys; rows that saw no key in either stay 0 / -inf.
    """
    merged = merge_lse(lse, step_lse)
    anchor = _finite_or_zero(merged)
    weight = torch.exp(lse - anchor).transpose(1, 2).unsqueeze(-1)
    step_weight = torch.exp(step_lse - anchor).transpose(1, 2).unsqueeze(-1)
    # one full-size temporary fewer: 5 tensor-sized reads/writes instead of 7 (memory-bound on GPUs)
    return torch.addcmul(out * weight, step_out, step_weight), merged
