"""Independent references the tests compare against: float64 dense masked attention, the dense
mask of a :class:`~ds_mtraining.index.SparseIndex` (exactly the entries the kernels compute) and
the per-block lists the kernels derive from its two compact lists. Small sizes only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import resolve_softmax_scale
from .index import PAD, SparseIndex, Stripe, membership
from .layout import StripedLayout

MAX_DENSE_ELEMENTS = 1 << 28


def dense_attention_with_lse(q, k, v, mask, softmax_scale=None, softcap=None):
    """Attention of q [B, Sq, H, D] over k, v [B, Sk, Hkv, D] restricted to ``mask``
    [B, H, Sq, Sk] (bool), computed in float64 with K/V expanded for GQA; with ``softcap`` the
    logits are ``softcap * tanh(logit / softcap)``.

    Returns (out [B, Sq, H, D], lse [B, H, Sq]); rows with no visible key give out 0, lse -inf.
    """
    h, hkv = q.shape[2], k.shape[2]
    scale = resolve_softmax_scale(q.shape[-1], softmax_scale)
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd = kd.repeat_interleave(h // hkv, dim=1)
    vd = vd.repeat_interleave(h // hkv, dim=1)
    logits = qd @ kd.transpose(-1, -2) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = (probs @ vd).transpose(1, 2)
    return out, lse


def dense_attention(q, k, v, mask, softmax_scale=None, softcap=None):
    return dense_attention_with_lse(q, k, v, mask, softmax_scale, softcap)[0]


def outputs_and_grads(attention, q, k, v, dout):
    """``attention(q, k, v)``'s output and the gradients of ``(out * dout).sum()`` with respect to
    fresh leaf copies of q, k, v: what the checks compare between implementations."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    out.backward(dout.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


# ---------------------------------------------------------------------- dense views of an index
def mask_between(index: SparseIndex, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bool [B, H, len(q_pos), len(k_pos)]: the entries computed between these global positions."""
    elements = index.batch * index.heads * q_pos.numel() * k_pos.numel()
    if elements > MAX_DENSE_ELEMENTS:
        raise ValueError(f"a dense mask of {elements} entries is too large; it is for tests only")
    q_pos, k_pos = q_pos.to(index.device).long(), k_pos.to(index.device).long()
    in_slash = membership(index.slash, index.num_blocks)
    in_vertical = membership(index.vertical, index.seq_len)
    offset = q_pos[:, None] // index.block_size - k_pos[None, :] // index.block_size
    slash_hit = in_slash[..., offset.clamp(min=0)] & (offset >= 0)
    vertical_hit = in_vertical[..., None, k_pos].expand_as(slash_hit)
    return (slash_hit | vertical_hit) & (q_pos[:, None] >= k_pos[None, :])


def dense_mask(index: SparseIndex, stripe: Stripe = Stripe()) -> torch.Tensor:
    """Bool [B, H, Sq, Sk]: exactly the entries the kernel computes in a call with ``stripe``:
    the whole sequence by default, else the local queries of ``q_rank`` against the keys of
    ``k_rank``."""
    if stripe.world == 1:  # any length, also one that is no whole number of blocks
        positions = torch.arange(index.seq_len)
        return mask_between(index, positions, positions)
    layout = StripedLayout(stripe.world, index.block_size)
    return mask_between(index, layout.positions(index.seq_len, stripe.q_rank),
                        layout.positions(index.seq_len, stripe.k_rank))


# ---------------------------------------------------------------------- per-block lists
@dataclass(frozen=True)
class BlockCSR:
    """Compressed rows: row ``i`` of the flattened (batch, head, block) grid is
    ``indices[ptr[i]:ptr[i+1]]``."""

    ptr: torch.Tensor
    indices: torch.Tensor
    shape: tuple

    @classmethod
    def from_selection(cls, keep: torch.Tensor, values: torch.Tensor) -> "BlockCSR":
        """Rows of ``keep`` [B, H, nb, n] (bool) picking from ``values`` (same shape), in order."""
        counts = keep.sum(-1).flatten()
        ptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=keep.device)
        ptr[1:] = counts.cumsum(0)
        return cls(ptr, values[keep].to(torch.int32), tuple(keep.shape[:3]))

    def row(self, b: int, h: int, i: int) -> torch.Tensor:
        flat = (b * self.shape[1] + h) * self.shape[2] + i
        return self.indices[self.ptr[flat]:self.ptr[flat + 1]]


def _slash_block_lists(index: SparseIndex, sign: int) -> BlockCSR:
    """Rows i of [B, H, nb]: blocks i + sign * d for d in slash that lie in [0, nb)."""
    nb = index.num_blocks
    d = index.slash.long()
    order = d.flip(-1) if sign < 0 else d  # keep each row's values ascending
    values = torch.arange(nb, device=d.device).view(1, 1, nb, 1) + sign * order[..., None, :]
    keep = (order != PAD)[..., None, :] & (values >= 0) & (values < nb)
    return BlockCSR.from_selection(keep, values)


def query_block_lists(index: SparseIndex) -> BlockCSR:
    """Per query block, the key blocks it reads through slash diagonals (ascending)."""
    return _slash_block_lists(index, -1)


def key_block_lists(index: SparseIndex) -> BlockCSR:
    """The transpose: per key block, the query blocks that read it (ascending)."""
    return _slash_block_lists(index, +1)


def vertical_lists(index: SparseIndex) -> BlockCSR:
    """Per query block, the vertical key tokens it reads beyond its slash blocks."""
    nb = index.num_blocks
    in_slash = membership(index.slash, nb)
    col = index.vertical.long()
    cblock = torch.where(col != PAD, col // index.block_size, nb)
    g = torch.arange(nb, device=index.device).view(1, 1, nb, 1)
    offset = g - cblock[..., None, :]
    covered = torch.gather(in_slash, -1, offset.clamp(0, nb - 1).flatten(2)).view_as(offset)
    keep = (offset > 0) & ~covered & (cblock < nb)[..., None, :]
    return BlockCSR.from_selection(keep, col[..., None, :].expand_as(keep))
