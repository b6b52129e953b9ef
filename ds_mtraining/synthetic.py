"""Synthetic RoPE'd queries and keys with a planted vertical-slash pattern (tests, demo, benchmarks)."""
from __future__ import annotations

import torch

from .rope import apply_rotary, rotary_tables


def planted_qk(seq_len: int, heads: int, kv_heads: int, dim: int, offsets, columns,
               sharp: float = 2.0, column_gain: float = 5.0, noise: float = 0.05,
               batch: int = 1, seed: int = 0, dtype=torch.float32):
    """q [B, S, H, D] and k [B, S, Hkv, D] whose attention has slash ``offsets[kv]`` and vertical
    ``columns[kv]`` for the query heads of kv head ``kv``.

    Before RoPE, q = 1 and k = e^{i t theta} on the fast frequency pairs, so q.k peaks where
    query - key = t (a slash); the four slowest pairs barely rotate, so a large value there in the
    chosen keys makes them attract every query (vertical columns).
    """
    g = torch.Generator().manual_seed(seed)
    half, slow = dim // 2, 4
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)
    q = torch.zeros(batch, seq_len, heads, dim, dtype=torch.float64)
    k = torch.zeros(batch, seq_len, kv_heads, dim, dtype=torch.float64)
    q[..., : half - slow] = sharp
    q[..., half - slow: half] = column_gain
    for kv in range(kv_heads):
        angle = offsets[kv] * freqs[: half - slow]
        k[:, :, kv, : half - slow] = sharp * angle.cos()
        k[:, :, kv, half: dim - slow] = sharp * angle.sin()
        for c in columns[kv]:
            k[:, c, kv, half - slow: half] = column_gain
    q = q + noise * torch.randn(q.shape, generator=g, dtype=torch.float64)
    k = k + noise * torch.randn(k.shape, generator=g, dtype=torch.float64)
    cos, sin = rotary_tables(torch.arange(seq_len), dim)
    return apply_rotary(q, cos, sin).to(dtype), apply_rotary(k, cos, sin).to(dtype)
