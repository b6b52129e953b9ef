"""The compact vertical-slash index and everything derived from it.

Per (batch, query head) the pattern is two short sorted lists:

* ``slash``: block diagonals ``d`` (query block minus key block), always containing 0;
* ``vertical``: key token positions (columns).

Query token ``q`` attends key token ``k`` iff ``k <= q`` and either ``block(q) - block(k)`` is in
``slash`` or ``k`` is in ``vertical``. Drawn for 4 blocks, slash = {0, 2}, vertical = {column x}::

          key blocks ->        (D = diagonal block, token-causal; S = slash block; x = column)
    qb0   D . . .
    qb1   . D . .
    qb2   S x D .
    qb3   x S x D

Lists padded to the longest row hold ``PAD`` at their tail. Nothing here is ever ``S x S`` (the
dense views for tests are in :mod:`ds_mtraining.reference`); the kernels derive each query block's
key blocks and leftover columns from the two lists, also under striping (:class:`Stripe`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SUPPORTED_BLOCK_SIZES

PAD = 1 << 30


@dataclass(frozen=True)
class Stripe:
    """Which tokens the local queries and keys are, under block striping over ``world`` ranks.

    Rank ``r`` holds global blocks ``r, r + world, r + 2 world, ...`` (their token positions:
    :class:`~ds_mtraining.layout.StripedLayout`); a ring step pairs the queries of ``q_rank``
    with the keys of ``k_rank``. ``Stripe()`` is the single-device case.
    """

    world: int = 1
    q_rank: int = 0
    k_rank: int = 0


def causal_entries(seq_len: int) -> float:
    """The entries of causal attention over ``seq_len`` tokens, S (S + 1) / 2: every density's
    denominator."""
    return seq_len * (seq_len + 1) / 2


def _sorted_unique(values: torch.Tensor) -> torch.Tensor:
    """Sorts the last dim, turns repeats and negatives into PAD, trims trailing all-PAD columns."""
    values = torch.where(values < 0, torch.full_like(values, PAD), values)
    values = values.sort(dim=-1).values
    if values.shape[-1] > 1:
        repeat = torch.zeros_like(values, dtype=torch.bool)
        repeat[..., 1:] = values[..., 1:] == values[..., :-1]
        values = torch.where(repeat, torch.full_like(values, PAD), values).sort(dim=-1).values
    width = int((values != PAD).sum(-1).max()) if values.numel() else 0
    return values[..., :max(width, 1)].to(torch.int32).contiguous()


def membership(lists: torch.Tensor, size: int) -> torch.Tensor:
    """[B, H, size] bool: which values of ``range(size)`` each PAD-padded list holds (a dense view, O(size): recall
    and tests)."""
    present = torch.zeros(*lists.shape[:-1], size + 1, dtype=torch.bool, device=lists.device)
    present.scatter_(-1, lists.long().clamp(max=size), True)
    return present[..., :size]


class SparseIndex:
    """A vertical-slash pattern for a ``[B, S, H, D]`` attention, in O(selected entries) memory.

    Args:
        slash: int [B, H, Ls], sorted block diagonals per head, PAD-padded, each row holding 0.
        vertical: int [B, H, Lv], sorted key token positions per head, PAD-padded.
        seq_len: global sequence length S.
        block_size: kernel granularity (64 or 128).
    """

    def __init__(self, slash: torch.Tensor, vertical: torch.Tensor, seq_len: int, block_size: int):
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size={block_size} is unsupported; use one of {SUPPORTED_BLOCK_SIZES}")
        if slash.dim() != 3 or vertical.dim() != 3 or slash.shape[:2] != vertical.shape[:2]:
            raise ValueError(
                f"slash and vertical must be [B, H, n] with the same B, H; got {tuple(slash.shape)} "
                f"and {tuple(vertical.shape)}")
        self.seq_len = int(seq_len)
        self.block_size = int(block_size)
        self.slash = slash.to(torch.int32).contiguous()
        self.vertical = vertical.to(torch.int32).contiguous()
        if not bool((self.slash[..., 0] == 0).all()):
            raise ValueError("every head's slash list must hold block diagonal 0 (keeps rows non-empty)")
        if bool(((self.slash != PAD) & (self.slash >= self.num_blocks)).any()):
            raise ValueError(f"slash block diagonals must be < num_blocks={self.num_blocks}")
        if bool(((self.vertical != PAD) & (self.vertical >= self.seq_len)).any()):
            raise ValueError(f"vertical key positions must be < seq_len={self.seq_len}")
        for name, lists in (("slash", self.slash), ("vertical", self.vertical)):
            # the kernels walk each list in order and stop at the first PAD
            later = lists[..., 1:]
            if bool((lists < 0).any()) or bool(((later <= lists[..., :-1]) & (later != PAD)).any()):
                raise ValueError(
                    f"{name} lists must be strictly increasing non-negative values with PAD only at "
                    f"their tail; build the index with SparseIndex.from_vertical_slash or from_blocks")
        self.slash_count = (self.slash != PAD).sum(-1).to(torch.int32)
        self.vertical_count = (self.vertical != PAD).sum(-1).to(torch.int32)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_blocks(cls, slash_blocks, vertical, seq_len, block_size, local_blocks: int = 1):
        """From block diagonals and key tokens (-1 = padding); adds diagonals 0..local_blocks-1.

        A column that every later query block already reads through the leading run of
        diagonals 0..L-1 (it lies in the last L blocks) adds no entry, so it is dropped: the
        kernels would otherwise still pay for visiting it."""
        local = torch.arange(local_blocks, device=slash_blocks.device)
        local = local.expand(*slash_blocks.shape[:2], local_blocks)
        nb = -(-seq_len // block_size)
        slash_blocks = torch.cat([slash_blocks.long(), local.long()], -1)
        slash_blocks = torch.where(slash_blocks < nb, slash_blocks, torch.full_like(slash_blocks, -1))
        slash = _sorted_unique(slash_blocks)
        leading_run = (slash == torch.arange(slash.shape[-1], device=slash.device)).int().cumprod(-1).sum(-1)
        vertical = vertical.long()
        redundant = vertical // block_size >= nb - leading_run[..., None]
        vertical = torch.where(redundant, torch.full_like(vertical, -1), vertical)
        return cls(slash, _sorted_unique(vertical), seq_len, block_size)

    @classmethod
    def from_vertical_slash(cls, vertical, slash, seq_len: int, block_size: int, local_blocks: int = 1):
        """From key token columns and token diagonals (query minus key); -1 entries are padding.

        A token diagonal ``t`` crosses block diagonal ``t // block`` and, unless ``t`` is a
        multiple of the block, also the next one: both are kept so the diagonal is covered.
        """
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size={block_size} is unsupported; use one of {SUPPORTED_BLOCK_SIZES}")
        for name, t in (("vertical", vertical), ("slash", slash)):
            if t.dim() != 3 or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be an integer tensor [B, H, n], got {t.dtype} {tuple(t.shape)}")
            if bool((t >= seq_len).any()) or bool((t < -1).any()):
                raise ValueError(f"{name} entries must lie in [0, seq_len={seq_len}) or be -1 (padding)")
        slash = slash.long()
        first = torch.where(slash >= 0, slash // block_size, -1)
        second = torch.where((slash >= 0) & (slash % block_size != 0), first + 1, -1)
        return cls.from_blocks(torch.cat([first, second], -1), vertical, seq_len, block_size, local_blocks)

    # ------------------------------------------------------------------ shape and checks
    @property
    def batch(self) -> int:
        return self.slash.shape[0]

    @property
    def heads(self) -> int:
        return self.slash.shape[1]

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def device(self):
        return self.slash.device

    def to(self, device) -> "SparseIndex":
        return SparseIndex(self.slash.to(device), self.vertical.to(device), self.seq_len, self.block_size)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.slash, self.vertical, self.slash_count, self.vertical_count))

    def check_matches(self, batch: int, seq_len: int, heads: int):
        """Raises if this index was built for another attention shape."""
        if (batch, seq_len, heads) != (self.batch, self.seq_len, self.heads):
            raise ValueError(
                f"index was built for batch={self.batch}, seq_len={self.seq_len}, heads={self.heads} "
                f"but the attention has batch={batch}, seq_len={seq_len}, heads={heads}; "
                f"estimate the index from these q/k")

    # ------------------------------------------------------------------ sizes
    def _block_len(self, blocks: torch.Tensor) -> torch.Tensor:
        start = blocks * self.block_size
        return (torch.clamp(self.seq_len - start, max=self.block_size)).clamp(min=0)

    def num_entries(self) -> torch.Tensor:
        """Int64 [B, H]: attention entries (q, k) the kernel computes, from the lists alone."""
        nb, bs = self.num_blocks, self.block_size
        last = self.seq_len - (nb - 1) * bs
        d = self.slash.long()
        valid = d != PAD
        diag = (nb - 1) * bs * (bs + 1) // 2 + last * (last + 1) // 2
        off = (nb - d - 1).clamp(min=0) * bs * bs + last * bs  # the last query block may be partial
        slash_entries = torch.where(valid & (d > 0), off, 0).sum(-1) + diag
        # a column in block c is read by the rows of blocks g > c whose offset g - c is no slash
        col = self.vertical.long()
        cvalid = col != PAD
        cblock = torch.where(cvalid, col // bs, nb)
        rows_after = (self.seq_len - (cblock + 1) * bs).clamp(min=0)
        target = cblock[..., :, None] + d[..., None, :]
        covered = self._block_len(target) * (valid & (d > 0))[..., None, :] * (target < nb)
        vertical_entries = torch.where(cvalid, rows_after - covered.sum(-1), 0).sum(-1)
        return slash_entries + vertical_entries

    def head_density(self) -> torch.Tensor:
        """Float64 [B, H]: computed entries over the causal entries, per head."""
        return self.num_entries().double() / causal_entries(self.seq_len)

    def density(self) -> float:
        """:meth:`head_density` averaged over batch and heads."""
        return float(self.head_density().mean())

    def __repr__(self):
        return (f"SparseIndex(batch={self.batch}, heads={self.heads}, seq_len={self.seq_len}, "
                f"block_size={self.block_size}, slash<= {self.slash.shape[-1]}, "
                f"vertical<= {self.vertical.shape[-1]})")
