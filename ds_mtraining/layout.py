"""Which rank of a sequence-parallel group holds which tokens.

Two layouts of a length-``S`` sequence over ``world`` ranks, both expressed as the global token
positions each rank holds (ascending), so one pair of helpers shards and unshards any tensor:

* :class:`StripedLayout` (what the ring uses): rank ``r`` holds global blocks
  ``r, r + world, r + 2 world, ...`` of ``block_size`` tokens, the striping that
  :class:`~ds_mtraining.index.Stripe` names to the kernels. Slash diagonals then spread evenly
  over ranks and ring steps.
* :class:`ZigzagLayout` (the baseline): the sequence cut into ``2 world`` equal chunks, rank ``r``
  holding chunks ``r`` and ``2 world - 1 - r``: balanced for dense causal attention only;
* :class:`ContiguousLayout`: rank ``r`` holds the ``r``-th of ``world`` equal runs, the split
  DeepSpeed-Ulysses expects (the loader's shards for the Ulysses baseline).

Stripe once, in the data loader (token ids and RoPE position ids), never per layer::

    layout = StripedLayout(world, block_size)
    input_ids_r = layout.shard(input_ids, rank)          # [B, S/W]
    position_ids_r = layout.shard_positions(S, rank)     # RoPE angles of the global positions
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def check_divisible(seq_len: int, parts: int, block_size: int, what: str = "seq_len",
                    factors: str = "world x block_size"):
    """Raises ValueError unless ``seq_len`` cuts into ``parts`` whole runs of ``block_size``-token
    blocks; ``what`` and ``factors`` name the length and the two factors in the message."""
    unit = parts * block_size
    if seq_len % unit != 0:
        lower, upper = seq_len // unit * unit, (seq_len // unit + 1) * unit
        raise ValueError(f"{what}={seq_len} is not divisible by {factors} = {parts} x {block_size} = "
                         f"{unit}; pad or cut the sequence to a multiple of {unit} (e.g. "
                         f"{lower or upper} or {upper})")


class Layout:
    """Base of the layouts: subclasses define :meth:`check` and :meth:`positions`."""

    world: int

    def check(self, seq_len: int):
        raise NotImplementedError

    def positions(self, seq_len: int, rank: int, device=None) -> torch.Tensor:
        """Int64 global positions (ascending) of the tokens ``rank`` holds."""
        raise NotImplementedError

    def _check_rank(self, rank: int):
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a group of {self.world} ranks")

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """The part of the global tensor ``x`` (sequence along ``dim``) that ``rank`` holds."""
        pos = self.positions(x.shape[dim], rank, device=x.device)
        return x.index_select(dim, pos)

    def shard_positions(self, seq_len: int, rank: int, device=None) -> torch.Tensor:
        """RoPE position ids [S/W] for ``rank``: its tokens' global positions."""
        return self.positions(seq_len, rank, device=device)

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Reassembles the global tensor from every rank's shard (index = rank), e.g. outputs
        gathered for inspection."""
        if len(shards) != self.world:
            raise ValueError(f"expected {self.world} shards (one per rank), got {len(shards)}")
        local = shards[0].shape[dim]
        seq_len = local * self.world
        shape = list(shards[0].shape)
        shape[dim] = seq_len
        full = shards[0].new_empty(shape)
        for rank, part in enumerate(shards):
            if part.shape != shards[0].shape:
                raise ValueError(f"shard {rank} has shape {tuple(part.shape)}, shard 0 "
                                 f"{tuple(shards[0].shape)}; every rank holds S/W tokens")
            full.index_copy_(dim, self.positions(seq_len, rank, device=part.device), part)
        return full

    def block_owner(self, num_blocks: int) -> torch.Tensor:
        """Int64 [num_blocks]: the rank holding each global block of ``block_size`` tokens
        (used to count work per rank without dense masks)."""
        seq_len = num_blocks * self.block_size
        self.check(seq_len)
        owner = torch.empty(num_blocks, dtype=torch.int64)
        for rank in range(self.world):
            owner[self.positions(seq_len, rank)[::self.block_size] // self.block_size] = rank
        return owner


@dataclass(frozen=True)
class StripedLayout(Layout):
    """Block striping: rank ``r`` holds global blocks ``r, r + world, ...``."""

    world: int
    block_size: int

    def check(self, seq_len: int):
        check_divisible(seq_len, self.world, self.block_size)

    def positions(self, seq_len: int, rank: int, device=None) -> torch.Tensor:
        self.check(seq_len)
        self._check_rank(rank)
        local = torch.arange(seq_len // self.world, device=device)
        block, offset = local // self.block_size, local % self.block_size
        return (block * self.world + rank) * self.block_size + offset

    def unshard_stacked(self, stacked: torch.Tensor) -> torch.Tensor:
        """[..., S] from every rank's shard along the last dim, stacked rank-major as
        [W, ..., S/W] (an all-gather's output): one permuting copy, no index tensors (local block
        j of rank r is global block j W + r)."""
        world, *lead, local = stacked.shape
        if world != self.world or local % self.block_size:
            raise ValueError(f"expected [W={self.world}, ..., S/W] with S/W a multiple of {self.block_size}, "
                             f"got {tuple(stacked.shape)}")
        blocks = stacked.reshape(world, *lead, local // self.block_size, self.block_size)
        return blocks.movedim(0, -2).reshape(*lead, world * local)


@dataclass(frozen=True)
class ZigzagLayout(Layout):
    """Zigzag: ``2 world`` chunks, rank ``r`` holds chunks ``r`` and ``2 world - 1 - r``.
    ``block_size`` only matters for :meth:`block_owner` (chunks must then be whole blocks)."""

    world: int
    block_size: int = 1

    def check(self, seq_len: int):
        check_divisible(seq_len, 2 * self.world, self.block_size, factors="2 x world x block_size")

    def positions(self, seq_len: int, rank: int, device=None) -> torch.Tensor:
        self.check(seq_len)
        self._check_rank(rank)
        chunk = seq_len // (2 * self.world)
        local = torch.arange(chunk, device=device)
        return torch.cat([rank * chunk + local, (2 * self.world - 1 - rank) * chunk + local])


@dataclass(frozen=True)
class ContiguousLayout(Layout):
    """Contiguous shards, the split DeepSpeed-Ulysses expects (what its data-loader adapter
    cuts): rank ``r`` holds positions ``r S/W .. (r+1) S/W - 1``. ``block_size`` only sets the
    divisibility that :meth:`check` asks for (the runs it is compared with stripe the same data)."""

    world: int
    block_size: int = 1

    def check(self, seq_len: int):
        check_divisible(seq_len, self.world, self.block_size)

    def positions(self, seq_len: int, rank: int, device=None) -> torch.Tensor:
        self.check(seq_len)
        self._check_rank(rank)
        local = seq_len // self.world
        return torch.arange(rank * local, (rank + 1) * local, device=device)
