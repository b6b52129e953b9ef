"""Mean token loss by position: how well a model uses long context, bucket by bucket.

For windows of ``L + 1`` tokens (input ids the first L, labels the last L), the loss at position
p is the cross-entropy of predicting token p + 1 from tokens 0..p. Positions are grouped into
buckets ``[edges[b], edges[b+1])`` with ``edges = round(linspace(0, L, buckets + 1))``; a bucket's
value is the mean loss over its positions and all windows.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..hf import output_head_inputs
from ..loss import soft_cap


def bucket_edges(length: int, buckets: int) -> list[int]:
    """``buckets + 1`` increasing position edges from 0 to ``length`` (fewer if L < buckets)."""
    if buckets < 1 or length < 1:
        raise ValueError(f"need length >= 1 and buckets >= 1, got {length} and {buckets}")
    return sorted({int(x) for x in np.rint(np.linspace(0, length, buckets + 1))})


@torch.no_grad()
def token_losses(model, input_ids: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 2048) -> torch.Tensor:
    """Float32 [B, L] cross-entropy per position, from the decoder's hidden states through the
    output head ``chunk_tokens`` positions at a time (never [L, vocab] logits of a long sequence)."""
    hidden, weight, softcap = output_head_inputs(model, model.base_model(input_ids=input_ids).last_hidden_state)
    losses = []
    for start in range(0, hidden.shape[1], chunk_tokens):
        logits = soft_cap((hidden[:, start:start + chunk_tokens] @ weight.T).float(), softcap)
        target = labels[:, start:start + chunk_tokens]
        losses.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none"))
    return torch.cat(losses, 1)


def loss_by_position(model, windows, buckets: int = 16, chunk_tokens: int = 2048, advance=None) -> dict:
    """Mean loss per position bucket over ``windows`` ([N, L + 1] token ids: tensor, array or
    list of arrays), one window per forward. Returns ``{"length", "edges", "mean_loss",
    "tokens", "overall", "windows"}`` (``mean_loss[b]`` for positions ``edges[b]..edges[b+1]-1``)."""
    device = next(model.parameters()).device
    windows = torch.as_tensor(np.asarray(windows), dtype=torch.long)
    length = windows.shape[1] - 1
    edges = bucket_edges(length, buckets)
    sums = torch.zeros(length, dtype=torch.float64)
    for window in windows:
        window = window.to(device)[None]
        sums += token_losses(model, window[:, :-1], window[:, 1:], chunk_tokens)[0].double().cpu()
        if advance is not None:
            advance()
    n = len(windows)
    means = [float(sums[a:b].sum() / ((b - a) * n)) for a, b in zip(edges[:-1], edges[1:])]
    return {"length": length, "edges": edges, "mean_loss": means,
            "tokens": [(b - a) * n for a, b in zip(edges[:-1], edges[1:])],
            "overall": float(sums.sum() / (length * n)), "windows": n}


def loss_windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """``count`` non-overlapping windows of ``length + 1`` tokens, evenly spread over ``stream``."""
    need = length + 1
    if len(stream) < need * count:
        raise ValueError(f"the held-out text holds {len(stream)} tokens, {count} windows of {need} need "
                         f"{need * count}; give more text (--data) or fewer/shorter windows")
    # spacing >= need, so flooring to multiples of need keeps the windows apart
    starts = [int(s) // need * need for s in np.linspace(0, len(stream) - need, count)]
    return np.stack([stream[s:s + need] for s in starts])
