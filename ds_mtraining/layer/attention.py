"""MTraining attention for models: :func:`striped_sparse_attention`, its settings
(:class:`MTrainingAttentionSettings`), statistics (:class:`AttentionStats`) and per-module index
cache (:class:`IndexCache`).

:func:`striped_sparse_attention` is the one entry point that models (the Ulysses drop-in
:class:`~ds_mtraining.layer.ulysses.DistributedAttention`, the transformers integration in
:mod:`ds_mtraining.hf`) call: it checks that the tokens are striped, estimates this step's
vertical-slash index from the shards (:func:`ds_mtraining.estimator.estimate_index`), runs the
balanced sparse ring (flat or hierarchical) and records sparsity statistics.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..attention import padded_to_kernel_head_dim, resolve_softmax_scale
from ..config import SparseConfig
from ..dense_backend import dense_causal_attention
from ..distributed.comm import ring_comm
from ..documents import document_positions
from ..estimator import estimate_index
from ..index import SparseIndex
from ..layout import StripedLayout, check_divisible
from ..ring.agreement import check_due, in_backward, mark_checked
from ..ring.ring_attention import prepare_ring_call
from ..ring.work import imbalance, pair_work, step_work
from ..step import current_step
from ..window import window_index

class LayoutError(ValueError):
    """The tokens handed to MTraining attention are not this rank's block-striped shard."""


@dataclass
class AttentionStats:
    """Sparsity and balance of the attention calls since the last :meth:`reset` (one training
    step): ``density`` = computed entries / causal entries, ``imbalance`` = worker-level
    imbalance of the ring (slowest worker's work summed over ring steps / the mean worker's),
    both from the compact index, averaged over the calls. With document masking both count only
    the entries inside documents (the density's denominator too: the document-masked causal
    entries).

    :meth:`record` only keeps the call's index (O(selected)); the numbers are computed when read
    (:meth:`summary`, ``densities``, ``imbalances``), so that recording never waits for the GPU.
    :meth:`reset` only clears them: a new training step is :func:`ds_mtraining.step.new_step`."""

    enabled: bool = True
    _recorded: list = field(default_factory=list, repr=False)
    _values: list = field(default_factory=list, repr=False)  # (density, imbalance) of _recorded

    def record(self, index: SparseIndex, world: int, doc_start: torch.Tensor | None = None):
        self._recorded.append((index, world, doc_start))

    def _computed(self) -> list:
        for index, world, doc_start in self._recorded[len(self._values):]:
            density, balance = index.density(), 1.0
            if world > 1 or doc_start is not None:
                pairs = pair_work(index, StripedLayout(world, index.block_size), doc_start)
                balance = imbalance(step_work(pairs))["worker_level"]
            if doc_start is not None:
                allowed = float((document_positions(doc_start) + 1).sum()) * index.heads  # per row: keys seen
                density = float(pairs.sum()) / allowed
            self._values.append((density, balance))
        return self._values

    @property
    def densities(self) -> list:
        return [d for d, _ in self._computed()]

    @property
    def imbalances(self) -> list:
        return [i for _, i in self._computed()]

    def summary(self) -> dict:
        """Mean density and imbalance over the recorded calls (NaN if none)."""
        def mean(values):
            return sum(values) / len(values) if values else float("nan")
        return {"density": mean(self.densities), "imbalance": mean(self.imbalances)}

    def reset(self):
        self._recorded.clear()
        self._values.clear()


class IndexCache:
    """The indices estimated by one attention module's forward calls in the current step, so
    that the forward recomputed under activation checkpointing (called by the autograd engine
    during backward) reuses its forward's index instead of estimating it again; with
    ``keep_output`` (:class:`MTrainingAttentionSettings`) an entry also holds the call's output
    and LSE, so the recompute runs no attention either. An entry is (index, kept (out, lse) or None).

    A recompute takes (and removes) the entry of its call's shapes when exactly one is held;
    with none or several (e.g. two micro-batches forwarded before one backward) it estimates
    again, which gives the same index (the estimators are deterministic). Every rank of a group
    holds the same entries, so they all take the same branch (the estimation is collective).
    Entries of earlier steps (:func:`ds_mtraining.step.new_step`) are dropped."""

    MAX_ENTRIES = 8

    def __init__(self):
        self._entries: list = []  # (step, key, (index, kept))

    def store(self, key, entry):
        """Adds (index, kept); a kept output releases the older entries' ones, so a module holds
        at most one (forwards without a backward between them, as in evaluation, hold no more)."""
        step = current_step()
        held = [e for e in self._entries if e[0] == step][-(self.MAX_ENTRIES - 1):]
        if entry[1] is not None:
            held = [(s, k, (index, None)) for s, k, (index, _) in held]
        self._entries = held + [(step, key, entry)]

    def take(self, key):
        matches = [i for i, (_, k, _) in enumerate(self._entries) if k == key]
        if len(matches) != 1:
            return None
        return self._entries.pop(matches[0])[2]

    def __len__(self):
        return len(self._entries)


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
        pattern: None (default): estimate the vertical-slash index every call (MTraining); else a
            fixed pattern of :mod:`ds_mtraining.static` (``DensePattern``, ``StaticPattern``:
            the baselines) whose index is used instead, through the same kernels and ring.
        keep_output: under activation checkpointing, keep each call's output and LSE from the
            forward until the recomputed forward takes them, so attention runs once per layer
            and step instead of twice (the sparse forward, and on a ring its K/V rotation). Costs
            B x S/W x H x D elements in the model's dtype plus the fp32 LSE per layer, held from
            the forward to that layer's backward. Without checkpointing it only holds each
            module's last output a step longer.
        dense_backend: the kernel of the dense pattern on one GPU without documents, resolved
            (:func:`ds_mtraining.dense_backend.resolve_dense_backend`): ``"sdpa"`` or ``"fa4"``.
    """

    sparse: SparseConfig = field(default_factory=SparseConfig)
    group: object = None
    hierarchy: object = None
    stats: AttentionStats | None = None
    pattern: object = None
    keep_output: bool = False
    dense_backend: str = "sdpa"

    @classmethod
    def from_groups(cls, sparse: SparseConfig, groups, stats: AttentionStats | None = None, pattern=None,
                    keep_output: bool = False, dense_backend: str = "sdpa"):
        """Settings for the groups made by :func:`ds_mtraining.distributed.initialize_groups`."""
        return cls(sparse, groups.sequence_group, groups.hierarchy, stats, pattern, keep_output, dense_backend)

    @property
    def world(self) -> int:
        """Ranks sharing the sequence (``group`` None: the default group, as in DeepSpeed)."""
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0


def _checked_seq_len(local: int, world: int, block: int) -> int:
    """The sequence length of ``world`` ranks holding ``local`` tokens each; :class:`LayoutError`
    unless it stripes into whole blocks."""
    try:
        check_divisible(local * world, world, block, factors="ranks x stripe block")
    except ValueError as error:
        raise LayoutError(f"this rank holds {local} tokens of a {world}-rank sequence: {error}") from None
    return local * world


def check_striped(position_ids: torch.Tensor, settings: MTrainingAttentionSettings, doc_start=None):
    """Raises :class:`LayoutError` unless ``position_ids`` ([S/W] or [B, S/W], the global
    positions of this rank's tokens) are this rank's block-striped positions. With document
    masking (``doc_start`` [B, S]) RoPE positions restart per document: they must then be
    ``t - doc_start[t]`` for this rank's striped places ``t`` in the sequence."""
    world, rank, block = settings.world, settings.rank, settings.sparse.block_size
    position_ids = position_ids.reshape(-1, position_ids.shape[-1])
    local = position_ids.shape[-1]
    seq_len = _checked_seq_len(local, world, block)
    expected = StripedLayout(world, block).positions(seq_len, rank, position_ids.device)
    if doc_start is not None:
        restarted = expected - doc_start.to(position_ids.device).long()[:, expected]
        if bool((position_ids == restarted).all()):
            return
        raise LayoutError(
            f"rank {rank} of {world}: with document masking the position ids must restart in each document "
            f"at this rank's block-striped places (t - doc_start[t]: {restarted[0, :8].tolist()}...), got "
            f"{position_ids[0, :8].tolist()}...; build them with ds_mtraining.documents.document_positions "
            f"and stripe with ds_mtraining.layout.StripedLayout({world}, {block})")
    if bool((position_ids == expected).all()):
        return
    contiguous = torch.arange(rank * local, (rank + 1) * local, device=position_ids.device)
    if bool((position_ids == contiguous).all()):
        raise LayoutError(
            f"rank {rank} of {world} was handed a contiguous shard (positions {rank * local}.."
            f"{(rank + 1) * local - 1}, as DeepSpeed-Ulysses or a plain split gives); MTraining's ring "
            f"needs block-striped shards: rank r holds blocks r, r+{world}, ... of {block} tokens. "
            f"Stripe token ids, labels and position ids once in the data loader with "
            f"ds_mtraining.layout.StripedLayout({world}, {block}).shard(x, rank) "
            f"(ds_mtraining.data does this)")
    raise LayoutError(
        f"rank {rank} of {world}: position ids {position_ids[0, :8].tolist()}... are not the "
        f"block-striped positions {expected[:8].tolist()}... of a {seq_len}-token sequence with stripe "
        f"block {block}; stripe with ds_mtraining.layout.StripedLayout({world}, {block})")


def striped_sparse_attention(q, k, v, settings: MTrainingAttentionSettings,
                             softmax_scale: float | None = None,
                             position_ids: torch.Tensor | None = None,
                             cache: IndexCache | None = None,
                             doc_start: torch.Tensor | None = None,
                             window: int | None = None,
                             sinks: torch.Tensor | None = None,
                             softcap: float | None = None) -> torch.Tensor:
    """Causal dynamic sparse attention of this rank's striped shard over the whole sequence, or,
    with ``window``, exact sliding-window attention through the same kernels and ring.

    Args:
        q: [B, S/W, H, D] (after RoPE with the global positions); k, v: [B, S/W, Hkv, D].
        settings: sparse budgets, groups, statistics.
        softmax_scale: defaults to 1/sqrt(D).
        position_ids: global positions of the local tokens, checked to be the striped ones (on
            CUDA once per training step, see :func:`ds_mtraining.step.new_step`, since
            the check reads the device; on CPU every call).
        cache: the calling module's :class:`IndexCache`: the forward stores its index there and
            the forward recomputed under activation checkpointing reuses it (one estimation per
            layer and step); with ``settings.keep_output`` also its output (one attention).
        doc_start: document masking: int32 [B, S] for the whole sequence
            (:mod:`ds_mtraining.documents`); position ids then restart per document.
        window: a sliding-window layer's window in tokens (:mod:`ds_mtraining.window`): its band,
            exactly; nothing is estimated and the statistics leave it out.
        sinks: attention sinks [H], a learned logit per query head in every row's softmax
            (:mod:`ds_mtraining.sinks`, gpt-oss's ``s_aux``).
        softcap: attention logit soft-capping (Gemma-2's ``attn_logit_softcapping``): logits
            ``softcap * tanh(logit / softcap)``, in the kernels' forward and backward.
    Returns:
        [B, S/W, H, D], this rank's output, in q's dtype.

    float32 inputs on CUDA run in bfloat16 (:func:`kernel_inputs`), as transformers' own
    flash-attention path runs them; a head_dim the CUDA kernels lack runs zero-padded to the next
    one they take (:func:`ds_mtraining.attention.padded_to_kernel_head_dim`).

    On CUDA inputs nothing here waits for the GPU (estimation by the fused CUDA estimator, the
    ring, the statistics), apart from the once-per-step checks.
    """
    recompute = in_backward()
    input_dtype, head_dim = q.dtype, q.shape[-1]
    scale = resolve_softmax_scale(head_dim, softmax_scale)
    q, k, v, _ = padded_to_kernel_head_dim(*kernel_inputs(q, k, v))  # once, before the estimate and the ring
    key = (tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), scale, settings.sparse,
           id(settings.group), None if doc_start is None else doc_start.data_ptr(), window)
    index, kept = (cache.take(key) if (cache is not None and recompute) else None) or (None, None)
    # the call's one ring and all its checks, the ranks' agreement first: before any collective
    call = prepare_ring_call(q, k, v, settings.sparse, ring_comm(settings.group), scale, index, doc_start, kept)
    if position_ids is not None:
        if not position_ids.is_cuda:
            check_striped(position_ids, settings, doc_start)
        elif check_due("positions"):
            check_striped(position_ids, settings, doc_start)
            mark_checked("positions")
    if index is None and window is not None:  # the layer's band, exactly
        index = window_index(q.shape[0], q.shape[2], q.shape[1] * settings.world, settings.sparse.block_size,
                             window, q.device)
    elif index is None and settings.pattern is None:
        index = estimate_index(q.detach(), k.detach(), settings.sparse, call.comm, call.scale, doc_start)
    elif index is None:  # a fixed baseline pattern (ds_mtraining.static), global [B, S, H]
        index = settings.pattern.index(q.shape[0], q.shape[2], q.shape[1] * settings.world,
                                       settings.sparse.block_size, q.device)
    if settings.stats is not None and settings.stats.enabled and not recompute and window is None:
        settings.stats.record(index, settings.world, doc_start)
    if (getattr(settings.pattern, "dense", False) and settings.world == 1 and q.is_cuda and doc_start is None
            and window is None and sinks is None and softcap is None):
        return dense_causal_attention(q, k, v, scale, settings.dense_backend)[..., :head_dim].to(input_dtype)
    out, lse, _ = call.run(index, settings.hierarchy, window, sinks, softcap)
    if cache is not None and not recompute:
        cache.store(key, (index, (out.detach(), lse.detach()) if settings.keep_output else None))
    return out[..., :head_dim].to(input_dtype)


_warned_float32 = []


def kernel_inputs(q, k, v):
    """q, k, v in a dtype the kernels take: float32 on CUDA becomes bfloat16, with one warning per
    process (the CUDA kernels and the fused estimator take bfloat16 and float16 only)."""
    if not (q.is_cuda and q.dtype == torch.float32):
        return q, k, v
    if not _warned_float32:
        _warned_float32.append(True)
        warnings.warn("ds_mtraining: the model runs in float32 but MTraining's CUDA kernels take bfloat16 or "
                      "float16, so attention runs in bfloat16 (inputs cast, output cast back), as transformers' "
                      "flash-attention path does; to train in bfloat16 and silence this, add "
                      "\"bf16\": {\"enabled\": true} to the DeepSpeed JSON", stacklevel=3)
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))

