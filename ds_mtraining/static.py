"""Fixed (not estimated) attention patterns: the baselines MTraining is compared against.

Both give a :class:`~ds_mtraining.index.SparseIndex` for any shape, so they run through the same
kernels, ring and striping as the estimated pattern (``mtraining.attention`` in the training
config, :mod:`ds_mtraining.training.run_config`):

* :class:`DensePattern`: every block diagonal, i.e. full causal attention (density exactly 1).
  On one CUDA device without documents :func:`ds_mtraining.layer.striped_sparse_attention` runs
  it with a dense causal kernel instead of the sparse kernel (SDPA or FlashAttention-4:
  :mod:`ds_mtraining.dense_backend`); elsewhere the sparse kernel runs the full index (the same
  ring as the sparse mode).
* :class:`StaticPattern`: attention sinks plus a local window, the StreamingLLM-style static
  sparse baseline. Query ``q`` attends key ``k <= q`` iff ``k < sink_tokens`` or
  ``block(q) - block(k) < local_blocks``: its own block (causally) and the ``local_blocks - 1``
  blocks before it, i.e. a window of between ``(local_blocks - 1) * block + 1`` and
  ``local_blocks * block`` tokens. The window is given either directly (``window_tokens``, a
  multiple of the block: ``local_blocks = window_tokens / block``) or by a target ``density``
  (computed entries / causal entries, as :meth:`SparseIndex.density` counts them): the number of
  local blocks whose density is nearest the target at the run's sequence length (ties: fewer
  blocks). Density moves in steps of about ``2 block / S`` per block diagonal, so the achieved
  density is within half such a step of the target (:meth:`StaticPattern.density_at` says it).
"""
from __future__ import annotations


import torch

from .index import SparseIndex

ATTENTION_MODES = ("sparse", "dense", "static")


def _index(batch: int, heads: int, seq_len: int, block_size: int, local_blocks: int, sink_tokens: int,
           device=None) -> SparseIndex:
    blocks = torch.empty(batch, heads, 0, dtype=torch.long, device=device)
    sinks = torch.arange(min(sink_tokens, seq_len), device=device)
    vertical = sinks.expand(batch, heads, -1) if sinks.numel() else \
        torch.full((batch, heads, 1), -1, dtype=torch.long, device=device)
    return SparseIndex.from_blocks(blocks, vertical, seq_len, block_size, local_blocks)


class _Cached:
    """Caches the index per (batch, heads, seq_len, block, device): every layer reuses it."""

    def __init__(self):
        self._cache = {}

    def index(self, batch: int, heads: int, seq_len: int, block_size: int, device=None) -> SparseIndex:
        key = (batch, heads, seq_len, block_size, str(device))
        if key not in self._cache:
            self._cache.clear()
            self._cache[key] = self._build(batch, heads, seq_len, block_size, device)
        return self._cache[key]


class DensePattern(_Cached):
    """Full causal attention as an index (all block diagonals); ``dense`` tells the attention
    layer that it may run a dense kernel instead."""

    name = "dense"
    dense = True

    def _build(self, batch, heads, seq_len, block_size, device):
        nb = -(-seq_len // block_size)
        blocks = torch.arange(nb, device=device).expand(batch, heads, nb)
        vertical = torch.full((batch, heads, 1), -1, dtype=torch.long, device=device)
        return SparseIndex.from_blocks(blocks, vertical, seq_len, block_size)

    def describe(self, seq_len: int, block_size: int) -> str:
        return "full causal, density 1"


class StaticPattern(_Cached):
    """Sinks + local window (see the module docstring). Give exactly one of ``density`` (in
    (0, 1]) and ``window_tokens`` (a positive multiple of the block size)."""

    name = "static"
    dense = False
    KEYS = ("density", "window_tokens", "sink_tokens")

    def __init__(self, density: float | None = None, window_tokens: int | None = None, sink_tokens: int = 4):
        super().__init__()
        if (density is None) == (window_tokens is None):
            raise ValueError("give exactly one of 'density' (target share of the causal entries) and "
                             "'window_tokens' (local window, a multiple of the stripe block)")
        if density is not None and (isinstance(density, bool) or not isinstance(density, (int, float))
                                    or not 0.0 < density <= 1.0):
            raise ValueError(f"density={density!r} must be a number in (0, 1]")
        if window_tokens is not None and (type(window_tokens) is not int or window_tokens < 1):
            raise ValueError(f"window_tokens={window_tokens!r} must be a positive integer")
        if type(sink_tokens) is not int or sink_tokens < 0:
            raise ValueError(f"sink_tokens={sink_tokens!r} must be an integer >= 0")
        self.density = None if density is None else float(density)
        self.window_tokens = window_tokens
        self.sink_tokens = sink_tokens

    @classmethod
    def from_dict(cls, values) -> "StaticPattern":
        if not isinstance(values, dict):
            raise ValueError(f"must be an object like {{\"density\": 0.1, \"sink_tokens\": 4}}, got {values!r}")
        unknown = sorted(set(values) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; valid keys are {list(cls.KEYS)}")
        return cls(**values)

    def to_dict(self) -> dict:
        values = {"sink_tokens": self.sink_tokens}
        values.update({"density": self.density} if self.density is not None else
                      {"window_tokens": self.window_tokens})
        return values

    def local_blocks(self, seq_len: int, block_size: int) -> int:
        """Block diagonals of the window at this sequence length (see the module docstring)."""
        nb = -(-seq_len // block_size)
        if self.window_tokens is not None:
            if self.window_tokens % block_size:
                raise ValueError(f"window_tokens={self.window_tokens} is not a multiple of the stripe "
                                 f"block {block_size}; use {max(1, self.window_tokens // block_size) * block_size}")
            return min(nb, self.window_tokens // block_size)
        density = lambda n: _index(1, 1, seq_len, block_size, n, self.sink_tokens).density()
        low, high = 1, nb  # smallest n with density(n) >= target (density grows with n)
        while low < high:
            middle = (low + high) // 2
            if density(middle) >= self.density:
                high = middle
            else:
                low = middle + 1
        if low > 1 and self.density - density(low - 1) <= density(low) - self.density:
            return low - 1
        return low

    def density_at(self, seq_len: int, block_size: int) -> float:
        """The density the pattern has at this sequence length."""
        return _index(1, 1, seq_len, block_size, self.local_blocks(seq_len, block_size),
                      self.sink_tokens).density()

    def _build(self, batch, heads, seq_len, block_size, device):
        return _index(batch, heads, seq_len, block_size, self.local_blocks(seq_len, block_size),
                      self.sink_tokens, device)

    def describe(self, seq_len: int, block_size: int) -> str:
        n = self.local_blocks(seq_len, block_size)
        return (f"{self.sink_tokens} sinks + {n} local blocks of {block_size}, density "
                f"{self.density_at(seq_len, block_size):.4f} at {seq_len} tokens")

    def __repr__(self):
        return f"StaticPattern({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


def attention_pattern(mode: str, static: dict | None = None):
    """The fixed pattern of an attention mode: None for ``"sparse"`` (estimated every call),
    :class:`DensePattern` or :class:`StaticPattern` (from its ``static`` settings)."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode {mode!r} is unknown; use one of {list(ATTENTION_MODES)}")
    if mode == "sparse":
        return None
    if mode == "dense":
        return DensePattern()
    return StaticPattern.from_dict(static or {})
