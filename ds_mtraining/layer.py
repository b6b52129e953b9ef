"""Sequence-parallel MTraining attention, and a drop-in for DeepSpeed-Ulysses' ``DistributedAttention``.

:func:`striped_sparse_attention` is the one entry point that models (this module's
:class:`DistributedAttention`, the transformers integration in :mod:`ds_mtraining.hf`) call:
it checks that the tokens are striped, estimates this step's vertical-slash index from the
shards, runs the balanced sparse ring (flat or hierarchical) and records sparsity statistics.

Differences from ``deepspeed.sequence.layer.DistributedAttention`` (Ulysses):

* Inputs are **block-striped** shards, not contiguous ones: rank ``r`` of the sequence-parallel
  group holds global blocks ``r, r + W, ...`` of ``block_size`` tokens (stripe token ids and
  position ids once, in the data loader: :class:`ds_mtraining.ring.layout.StripedLayout`,
  :mod:`ds_mtraining.data`). Pass ``position_ids=`` (the global positions of the local tokens) so
  the layer can verify this; contiguous shards raise an error saying how to stripe.
* There is no all-to-all: heads stay whole on every rank, so the number of heads need not be
  divisible by the sequence-parallel size; attention is causal dynamic sparse attention.
* ``local_attention`` is not run (the ring replaces it); its ``softmax_scale`` attribute (or
  ``scale``), if it has one, sets the softmax scale, and a local attention declaring
  ``causal = False`` or a nonzero ``dropout_p`` is refused.
* ``sp_stream`` is accepted for signature compatibility; the ring overlaps its own transfers.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import SparseConfig
from .index import SparseIndex
from .ring import ring_sparse_attention
from .ring.ring_attention import estimate_index
from .ring.layout import StripedLayout
from .ring.work import imbalance, pair_work, step_work

logger = logging.getLogger(__name__)


class LayoutError(ValueError):
    """The tokens handed to MTraining attention are not this rank's block-striped shard."""


@dataclass
class AttentionStats:
    """Sparsity and balance of the attention calls since the last :meth:`reset` (one training
    step): ``density`` = computed entries / causal entries, ``imbalance`` = worker-level
    imbalance of the ring (slowest worker's work summed over ring steps / the mean worker's),
    both from the compact index, averaged over the calls."""

    enabled: bool = True
    densities: list = field(default_factory=list)
    imbalances: list = field(default_factory=list)

    def record(self, index: SparseIndex, world: int):
        self.densities.append(index.density())
        if world > 1:
            pairs = pair_work(index, StripedLayout(world, index.block_size))
            self.imbalances.append(imbalance(step_work(pairs))["worker_level"])
        else:
            self.imbalances.append(1.0)

    def summary(self) -> dict:
        """Mean density and imbalance over the recorded calls (NaN if none)."""
        def mean(values):
            return sum(values) / len(values) if values else float("nan")
        return {"density": mean(self.densities), "imbalance": mean(self.imbalances)}

    def reset(self):
        self.densities.clear()
        self.imbalances.clear()


@dataclass
class MTrainingAttentionSettings:
    """What every MTraining attention call of a model needs.

    Attributes:
        sparse: the vertical-slash budgets; ``sparse.block_size`` is the stripe width.
        group: the sequence-parallel process group (None: the default group, or a single device
            when torch.distributed is not initialised).
        hierarchy: this rank's hierarchical ring groups (``ParallelGroups.hierarchy``, from
            :func:`ds_mtraining.distributed.initialize_groups`), or None for the flat ring.
        stats: where sparsity statistics go (None: not recorded).
    """

    sparse: SparseConfig = field(default_factory=SparseConfig)
    group: object = None
    hierarchy: object = None
    stats: AttentionStats | None = None

    @classmethod
    def from_groups(cls, sparse: SparseConfig, groups, stats: AttentionStats | None = None):
        """Settings for the groups made by :func:`ds_mtraining.distributed.initialize_groups`."""
        return cls(sparse, groups.sequence_group, groups.hierarchy, stats)

    @property
    def world(self) -> int:
        """Ranks sharing the sequence (``group`` None: the default group, as in DeepSpeed)."""
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0


def check_striped(position_ids: torch.Tensor, settings: MTrainingAttentionSettings):
    """Raises :class:`LayoutError` unless ``position_ids`` ([S/W] or [B, S/W], the global
    positions of this rank's tokens) are this rank's block-striped positions."""
    world, rank, block = settings.world, settings.rank, settings.sparse.block_size
    position_ids = position_ids.reshape(-1, position_ids.shape[-1])
    local = position_ids.shape[-1]
    seq_len = local * world
    if seq_len % (world * block) != 0:
        raise LayoutError(
            f"this rank holds {local} tokens, so the sequence has {seq_len} = {world} ranks x {local}; "
            f"it must be divisible by ranks x stripe block = {world} x {block} = {world * block}: "
            f"pad or cut the sequence (mtraining.seq_len) to a multiple of {world * block}")
    expected = StripedLayout(world, block).positions(seq_len, rank, position_ids.device)
    if bool((position_ids == expected).all()):
        return
    contiguous = torch.arange(rank * local, (rank + 1) * local, device=position_ids.device)
    if bool((position_ids == contiguous).all()):
        raise LayoutError(
            f"rank {rank} of {world} was handed a contiguous shard (positions {rank * local}.."
            f"{(rank + 1) * local - 1}, as DeepSpeed-Ulysses or a plain split gives); MTraining's ring "
            f"needs block-striped shards: rank r holds blocks r, r+{world}, ... of {block} tokens. "
            f"Stripe token ids, labels and position ids once in the data loader with "
            f"ds_mtraining.ring.layout.StripedLayout({world}, {block}).shard(x, rank) "
            f"(ds_mtraining.data does this)")
    raise LayoutError(
        f"rank {rank} of {world}: position ids {position_ids[0, :8].tolist()}... are not the "
        f"block-striped positions {expected[:8].tolist()}... of a {seq_len}-token sequence with stripe "
        f"block {block}; stripe with ds_mtraining.ring.layout.StripedLayout({world}, {block})")


def striped_sparse_attention(q, k, v, settings: MTrainingAttentionSettings,
                             softmax_scale: float | None = None,
                             position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal dynamic sparse attention of this rank's striped shard over the whole sequence.

    Args:
        q: [B, S/W, H, D] (after RoPE with the global positions); k, v: [B, S/W, Hkv, D].
        settings: sparse budgets, groups, statistics.
        softmax_scale: defaults to 1/sqrt(D).
        position_ids: global positions of the local tokens, checked to be the striped ones.
    Returns:
        [B, S/W, H, D], this rank's output, in q's dtype.
    """
    if position_ids is not None:
        check_striped(position_ids, settings)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    index = estimate_index(q.detach(), k.detach(), settings.sparse, settings.group, scale)
    if settings.stats is not None and settings.stats.enabled:
        settings.stats.record(index, settings.world)
    return ring_sparse_attention(q, k, v, settings.sparse, settings.group, softmax_scale=scale,
                                 index=index, hierarchy=settings.hierarchy)


# ----------------------------------------------------------------------------- Ulysses drop-in
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` channels of x [B, S, H, D];
    cos/sin broadcast to [B, S, 1, D_rot]."""
    rot = cos.shape[-1]
    rotated = x[..., :rot] * cos + _rotate_half(x[..., :rot]) * sin
    return torch.cat((rotated, x[..., rot:]), dim=-1) if rot < x.shape[-1] else rotated


class DistributedAttention(torch.nn.Module):
    """Drop-in for ``deepspeed.sequence.layer.DistributedAttention`` running MTraining's
    balanced sparse ring instead of Ulysses' all-to-all (see the module docstring for the
    differences: striped inputs, no head split, causal sparse attention).

    Args:
        local_attention: the model's local attention module/function; not run, but its
            ``softmax_scale``/``scale``, ``causal`` and ``dropout_p`` attributes are honoured.
        sequence_process_group: the sequence-parallel group (e.g. ``mpu.get_sequence_parallel_group()``).
        scatter_idx: the heads dimension of q/k/v (Ulysses scatters it); must be 2.
        gather_idx: Ulysses' sequence gather dimension; accepted for compatibility (0 or 1).
        sp_stream: accepted for compatibility; the ring overlaps its own transfers.
        sparse_config: the vertical-slash budgets (keyword only; default :class:`SparseConfig`).
        hierarchy: the hierarchical ring's groups (keyword only; default: flat ring).
        stats: an :class:`AttentionStats` to record sparsity into (keyword only).

    Forward, in the two call forms Megatron-DeepSpeed and the DeepSpeed tutorial use::

        out = attn(q, k, v, batch_dim_idx, rotary_pos_emb=None, position_ids=pos)
        out = attn(q, k, v, attention_mask)          # Megatron core attention, [S/W, B, H, D]

    ``batch_dim_idx`` 0 means q is [B, S/W, H, D], 1 means [S/W, B, H, D]; the output has q's
    layout. A tensor in place of ``batch_dim_idx`` (or of ``rotary_pos_emb``) is an attention
    mask: it must be causal (checked on this rank's rows), since MTraining attention is.
    ``rotary_pos_emb`` is ``(cos, sin)``, each [B or 1, L, 1, D_rot] with L the local length (already
    this rank's positions) or the global length (this rank's striped rows are taken).
    Keyword arguments: ``position_ids`` (verified striped), ``softmax_scale``, ``causal``
    (must be true), ``dropout_p`` (must be 0).
    """

    def __init__(self, local_attention, sequence_process_group, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream=None, *, sparse_config: SparseConfig | None = None,
                 hierarchy=None, stats: AttentionStats | None = None):
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(f"scatter_idx={scatter_idx}: MTraining attention takes q/k/v with heads "
                             f"in dimension 2 ([B, S, H, D] or [S, B, H, D]); pass scatter_idx=2")
        if gather_idx not in (0, 1):
            raise ValueError(f"gather_idx={gather_idx}: the sequence dimension must be 0 or 1")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx, self.sp_stream = scatter_idx, gather_idx, sp_stream
        self.settings = MTrainingAttentionSettings(sparse_config or SparseConfig(),
                                                   sequence_process_group, hierarchy, stats)
        self._warned_unverified = False
        _check_local_attention(local_attention)

    def forward(self, query, key, value, batch_dim_idx=0, rotary_pos_emb=None, *args, **kwargs):
        if args:
            raise TypeError(f"MTraining DistributedAttention got {len(args)} extra positional "
                            f"argument(s); pass softmax_scale=/causal=/dropout_p=/position_ids= by name")
        mask = None
        if isinstance(batch_dim_idx, torch.Tensor):  # dist_attn(q, k, v, attention_mask): sbhd
            mask, batch_dim_idx = batch_dim_idx, 1
        if isinstance(rotary_pos_emb, torch.Tensor):  # dist_attn(q, k, v, batch_dim_idx, mask)
            mask, rotary_pos_emb = rotary_pos_emb, None
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx={batch_dim_idx!r} must be 0 ([B, S, H, D]) or 1 ([S, B, H, D])")
        scale = self._options(kwargs)
        position_ids = kwargs.get("position_ids")
        q, k, v = (x.transpose(0, 1) if batch_dim_idx == 1 else x for x in (query, key, value))
        local = q.shape[1]
        if position_ids is None and not self._warned_unverified and self.settings.world > 1:
            logger.warning("MTraining DistributedAttention: no position_ids given, so the striped "
                           "layout of q/k/v cannot be verified; pass position_ids=")
            self._warned_unverified = True
        if mask is not None:
            _check_causal_mask(mask, self._positions(local, position_ids, mask.device))
        if rotary_pos_emb is not None:
            cos, sin = (self._local_rows(t, local, position_ids) for t in rotary_pos_emb)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = striped_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.settings,
                                       scale, position_ids)
        return out.transpose(0, 1) if batch_dim_idx == 1 else out

    def _options(self, kwargs) -> float | None:
        unknown = set(kwargs) - {"position_ids", "softmax_scale", "causal", "dropout_p"}
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; MTraining "
                            f"DistributedAttention takes position_ids, softmax_scale, causal, dropout_p")
        if not kwargs.get("causal", True):
            raise ValueError("causal=False: MTraining attention is causal only")
        if kwargs.get("dropout_p", 0.0) and self.training:
            raise ValueError("dropout_p > 0: attention dropout is not supported; pass dropout_p=0")
        return kwargs.get("softmax_scale", _attribute_scale(self.local_attn))

    def _positions(self, local: int, position_ids, device) -> torch.Tensor:
        if position_ids is not None:
            return position_ids.reshape(-1, local)[0].to(device)
        settings = self.settings
        layout = StripedLayout(settings.world, settings.sparse.block_size)
        return layout.positions(local * settings.world, settings.rank, device)

    def _local_rows(self, table: torch.Tensor, local: int, position_ids) -> torch.Tensor:
        """cos/sin rows [B|1, local, 1, D] of this rank's tokens from a local or global table."""
        length = table.shape[1]
        if length == local:
            return table
        if length == local * self.settings.world:
            return table.index_select(1, self._positions(local, position_ids, table.device))
        raise ValueError(f"rotary_pos_emb covers {length} positions along dim 1; expected this rank's "
                         f"{local} or the global {local * self.settings.world}")


def _attribute_scale(local_attention) -> float | None:
    for name in ("softmax_scale", "scale"):
        value = getattr(local_attention, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _check_local_attention(local_attention):
    if getattr(local_attention, "causal", True) is False:
        raise ValueError("local_attention.causal is False: MTraining attention is causal only")
    dropout = getattr(local_attention, "dropout_p", 0.0)
    if isinstance(dropout, (int, float)) and dropout > 0:
        raise ValueError(f"local_attention.dropout_p={dropout}: attention dropout is not supported")


def _check_causal_mask(mask: torch.Tensor, positions: torch.Tensor):
    """A Megatron/HF attention mask must be the causal one on this rank's query rows: bool with
    True = masked (Megatron), or additive float with -inf/min = masked."""
    seq_len = mask.shape[-1]
    rows = mask.index_select(-2, positions) if mask.shape[-2] == seq_len else mask
    if rows.shape[-2] != positions.numel():
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} matches neither the global "
                         f"sequence ({seq_len}) nor this rank's {positions.numel()} rows")
    masked = rows if rows.dtype == torch.bool else rows < 0
    causal_masked = positions[:, None] < torch.arange(seq_len, device=mask.device)[None, :]
    if not bool((masked == causal_masked).all()):
        raise ValueError("the attention mask is not the causal mask; MTraining attention computes causal "
                         "attention only (no padding or document masks: pack sequences instead)")
