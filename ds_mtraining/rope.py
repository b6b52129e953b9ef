"""Rotate-half rotary position embedding (RoPE), the HF Llama/Qwen2 convention."""
from __future__ import annotations

import torch


def rotary_tables(positions: torch.Tensor, dim: int, base: float = 10000.0):
    """(cos, sin), float64 [1, S, 1, dim], of the token ``positions`` [S]."""
    freqs = base ** (-torch.arange(0, dim // 2, dtype=torch.float64, device=positions.device) * 2 / dim)
    angle = positions.double()[:, None] * freqs[None, :]
    angle = torch.cat((angle, angle), dim=-1)[None, :, None, :]
    return angle.cos(), angle.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` channels of x [B, S, H, D];
    cos/sin broadcast to [B, S, 1, D_rot]."""
    rot = cos.shape[-1]
    rotated = x[..., :rot] * cos + _rotate_half(x[..., :rot]) * sin
    return torch.cat((rotated, x[..., rot:]), dim=-1) if rot < x.shape[-1] else rotated
