"""Sliding-window attention as the sparse kernels run it: the one statement of a window.

A layer with a window of ``W`` tokens (transformers' ``sliding_window``: query i sees key j iff
``i - W < j <= i``) is a band of token diagonals 0 .. W-1. The kernels run it exactly with two
pieces they already take:

* the index: the block diagonals the band touches, ``0 .. (W + B - 2) // B`` for block ``B``
  (:func:`window_index`; no columns, nothing estimated);
* the per-query first visible key, the kernels' document limit ``doc_start`` (any
  non-decreasing row with ``doc_start[i] <= i``): ``max(doc_start[i], i - W + 1)``
  (:func:`window_key_start`), which cuts the band's far block diagonal per token, and intersects
  the window with document masking when documents are packed.

Drawn for 4 blocks of 4 tokens and W = 6 (``#`` seen, ``.`` not; block diagonals 0..1 read)::

    q  0 #
       1 ##
       2 ###
       3 ####
       4 #####
       5 ######
       6 .######
       7 ..######
       8 ...######
       ...

Nothing else changes: the ring rotates the same K/V and merges the same out/LSE, so windowed
layers of a hybrid model (Gemma-2/3, Mistral, Qwen2 with ``use_sliding_window``) train through
the same kernels and ring as its global layers.
"""
from __future__ import annotations

import torch

from .index import SparseIndex


def check_window(window) -> int:
    """``window`` as an int after checking it is a positive token count."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding window {window!r} must be a positive number of tokens")
    return window


def window_block_diagonals(window: int, block_size: int) -> int:
    """How many block diagonals (0 .. n-1) hold some pair of a ``window``-token band."""
    return (check_window(window) + block_size - 2) // block_size + 1


def window_index(batch: int, heads: int, seq_len: int, block_size: int, window: int, device=None) -> SparseIndex:
    """The band's block diagonals for [batch, heads], clipped to the sequence (a window as long as
    the sequence is full causal attention)."""
    num_blocks = -(-seq_len // block_size)
    diagonals = torch.arange(min(window_block_diagonals(window, block_size), num_blocks), device=device)
    slash = diagonals.expand(batch, heads, -1)
    vertical = torch.full((batch, heads, 1), -1, dtype=torch.long, device=device)
    return SparseIndex.from_blocks(slash, vertical, seq_len, block_size)


def window_key_start(window: int, batch: int, seq_len: int, device, doc_start: torch.Tensor | None = None):
    """int32 [batch, seq_len]: the first key each (global) query sees, ``max(doc_start, i - W + 1)``
    (``doc_start`` [batch, seq_len], a checked packing, or None: one document per row)."""
    first = (torch.arange(seq_len, device=device) - check_window(window) + 1).clamp(min=0)
    first = first.expand(batch, seq_len)
    if doc_start is not None:
        first = torch.maximum(first, doc_start.to(device).long())
    return first.to(torch.int32).contiguous()
