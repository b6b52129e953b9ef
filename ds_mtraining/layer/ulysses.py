"""A drop-in for DeepSpeed-Ulysses' ``DistributedAttention`` running MTraining's sparse ring.

:class:`DistributedAttention` takes what ``deepspeed.sequence.layer.DistributedAttention``
(Ulysses) takes and returns what it returns:

* **Contiguous shards by default** (``input_layout="contiguous"``, Ulysses' split: rank ``r``
  holds tokens ``r S/W .. (r+1) S/W - 1``). The ring needs block-striped shards (rank ``r`` holds
  blocks ``r, r + W, ...`` of ``block_size`` tokens), so the layer re-stripes inside: one
  all-to-all carries q, k and v (concatenated) to the striped layout and one carries the output
  back; autograd runs the same two exchanges in reverse for the gradients. Each rank sends the
  ``(W-1)/W`` of its tokens that belong to other stripes: per layer and step
  ``2 (W-1)/W x S/W x (H + Hkv) x D`` elements forward and as many backward, against the ring's own
  ``2 (W-1) x S/W x Hkv x D`` (K/V) forward, i.e. ``(H + Hkv) / (W Hkv)`` of the ring's traffic,
  in one collective per direction that does not overlap compute. Measured on CPU with gloo
  (2 cores, fp32, B=1, H=8, Hkv=2, D=64, S=8192, block 64): the four exchanges of a forward +
  backward took 0.31 s at W=2 and 0.18 s at W=4, against 13 s and 11 s for the layer's forward +
  backward (2.4 % and 1.6 %, the CPU kernel dominating; on GPUs attention is far faster, so
  estimate the share there from the volumes). ``input_layout="striped"`` declares shards that
  are striped already (what :mod:`ds_mtraining.data` produces: stripe token ids, labels and
  position ids once with :class:`ds_mtraining.layout.StripedLayout`) and skips both
  exchanges. Given ``position_ids=``, the layer checks them against the declared layout; a
  mismatch is a :class:`LayoutError` naming the fix.
* Heads stay whole on every rank (no head all-to-all), so the number of heads need not be
  divisible by the sequence-parallel size; attention is causal dynamic sparse attention.
* ``local_attention`` is not run (the ring replaces it). The softmax scale comes from the call
  (``scale=`` or ``softmax_scale=``), else from ``local_attention``'s ``softmax_scale``/``scale``
  attribute (``None`` there means 1/sqrt(D), the flash-attn and SDPA convention), else from a
  known function (``torch.nn.functional.scaled_dot_product_attention`` or a flash-attn
  ``flash_attn_*`` function, optionally inside ``functools.partial``: 1/sqrt(D)); any other local
  attention without a scale is an error asking for one, never a guessed 1/sqrt(D). Non-causal
  attention and attention dropout are refused.
* ``sp_stream`` is accepted for signature compatibility; the ring overlaps its own transfers.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..attention import resolve_softmax_scale
from ..config import SparseConfig
from ..distributed.comm import ring_comm
from ..documents import doc_start_from_cu_seqlens
from ..layout import StripedLayout
from ..ring.agreement import check_due, check_ranks_before_collectives, mark_checked
from ..rope import apply_rotary
from .attention import (AttentionStats, IndexCache, LayoutError, MTrainingAttentionSettings, _checked_seq_len,
                        striped_sparse_attention)


INPUT_LAYOUTS = ("contiguous", "striped")
CALL_KEYWORDS = ("position_ids", "scale", "softmax_scale", "causal", "is_causal", "dropout_p", "cu_seqlens",
                 "doc_start")


class RestripePlan:
    """How one rank's contiguous shard of ``local`` tokens becomes its block-striped shard.

    Contiguous rank ``r`` holds positions ``r L .. (r+1) L - 1`` (``L = S/W``); striped rank ``j``
    holds the blocks ``g`` with ``g mod W = j``. Rank ``r`` sends rank ``j`` its tokens of blocks
    ``g = j mod W`` (in position order, ``send[j]`` of them) and receives from every rank ``i`` the
    tokens of its own stripe inside ``i``'s range; concatenated by source rank they are already
    in position order, i.e. the striped shard. The way back is the same exchange reversed.
    """

    def __init__(self, group, world: int, rank: int, local: int, block: int, device):
        self.group = group
        layout = StripedLayout(world, block)
        start = rank * local
        positions = torch.arange(start, start + local)
        destination = layout.block_owner(local * world // block)[positions // block]
        self.order = torch.argsort(destination, stable=True).to(device)
        self.inverse = torch.argsort(self.order)
        self.send = torch.bincount(destination, minlength=world).tolist()
        mine = layout.positions(local * world, rank)
        self.receive = torch.bincount(mine // local, minlength=world).tolist()

    def _exchange(self, rows: torch.Tensor, send: list, receive: list) -> torch.Tensor:
        out = rows.new_empty((sum(receive),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=self.group)
        return out

    def to_striped(self, rows: torch.Tensor) -> torch.Tensor:
        """[L, ...] contiguous-shard rows (position order) -> [L, ...] striped-shard rows."""
        return self._exchange(rows.index_select(0, self.order), self.send, self.receive)

    def to_contiguous(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_striped`."""
        return self._exchange(rows, self.receive, self.send).index_select(0, self.inverse)


class _Restripe(torch.autograd.Function):
    """Differentiable re-stripe of [L, ...] rows: the gradient takes the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, plan: RestripePlan, to_striped: bool):
        ctx.plan, ctx.to_striped = plan, to_striped
        return plan.to_striped(rows) if to_striped else plan.to_contiguous(rows)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        return (plan.to_contiguous(grad) if ctx.to_striped else plan.to_striped(grad)), None, None


class DistributedAttention(torch.nn.Module):
    """Drop-in for ``deepspeed.sequence.layer.DistributedAttention`` running MTraining's
    balanced sparse ring instead of Ulysses' all-to-all (see the module docstring: contiguous
    inputs re-striped inside, no head split, causal sparse attention, where the scale comes from).

    Args:
        local_attention: the model's local attention module/function; not run, but its
            ``softmax_scale``/``scale``, ``causal``/``is_causal`` and ``dropout_p`` are honoured.
        sequence_process_group: the sequence-parallel group (e.g. ``mpu.get_sequence_parallel_group()``).
        scatter_idx: the heads dimension of q/k/v (Ulysses scatters it); must be 2.
        gather_idx: Ulysses' sequence gather dimension; accepted for compatibility (0 or 1).
        sp_stream: accepted for compatibility; the ring overlaps its own transfers.
        num_kv_heads: key/value heads (as Ulysses); when given, k and v are checked to have them.
        num_heads: query heads (keyword only); when given, q is checked to have them.
        input_layout: ``"contiguous"`` (default, Ulysses' shards; re-striped inside) or
            ``"striped"`` (block-striped shards, e.g. from :mod:`ds_mtraining.data`; zero-copy).
        sparse_config: the vertical-slash budgets (keyword only; default :class:`SparseConfig`).
        hierarchy: the hierarchical ring's groups (keyword only; default: flat ring).
        stats: an :class:`AttentionStats` to record sparsity into (keyword only).

    Forward, in the call forms of Ulysses, Megatron-DeepSpeed and the DeepSpeed tutorial::

        out = attn(q, k, v, batch_dim_idx)
        out = attn(q, k, v, batch_dim_idx, (cos, sin), is_causal=True, scale=s, position_ids=pos)
        out = attn(q, k, v, attention_mask)          # Megatron core attention, [S/W, B, H, D]

    ``batch_dim_idx`` 0 means q is [B, S/W, H, D], 1 means [S/W, B, H, D]; the output has q's
    layout. A tensor in place of ``batch_dim_idx`` (or of ``rotary_pos_emb``) is an attention
    mask: it must be causal (checked on this rank's rows), since MTraining attention is.
    ``rotary_pos_emb`` is ``(cos, sin)`` in Ulysses' layout: after ``permute(1, 0, 2, 3)`` each
    broadcasts against q, i.e. [S, 1, 1, D_rot] for batch-first q and [1, S, 1, D_rot] for
    sequence-first q (a batch dimension of B instead of 1 is fine). S is the global length
    (Ulysses' form; rows of this rank's tokens are taken) or this rank's S/W (rows already of the
    local tokens, in the input order). Keyword arguments: ``position_ids`` ([S/W] or [B, S/W],
    global positions, verified against ``input_layout``), ``scale``/``softmax_scale``,
    ``causal``/``is_causal`` (must be true), ``dropout_p`` (must be 0 in training); document
    masking: ``cu_seqlens`` (the whole sequence's document boundaries, FlashAttention's form) or
    ``doc_start`` ([B, S], :mod:`ds_mtraining.documents`), the same on every rank; q/k must then
    carry RoPE of the positions within each document (``rotary_pos_emb`` is refused with it).
    """

    def __init__(self, local_attention, sequence_process_group, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream=None, num_kv_heads: int | None = None, *,
                 num_heads: int | None = None, input_layout: str = "contiguous",
                 sparse_config: SparseConfig | None = None, hierarchy=None,
                 stats: AttentionStats | None = None):
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(f"scatter_idx={scatter_idx}: MTraining attention takes q/k/v with heads "
                             f"in dimension 2 ([B, S, H, D] or [S, B, H, D]); pass scatter_idx=2")
        if gather_idx not in (0, 1):
            raise ValueError(f"gather_idx={gather_idx}: the sequence dimension must be 0 or 1")
        if input_layout not in INPUT_LAYOUTS:
            raise ValueError(f"input_layout={input_layout!r} is not a layout; use 'contiguous' (Ulysses' "
                             f"shards, re-striped inside) or 'striped' (block-striped shards)")
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int (or None: not checked)")
        if num_heads is not None and num_kv_heads is not None and num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
                             f"GQA needs whole groups of query heads per key/value head")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx, self.sp_stream = scatter_idx, gather_idx, sp_stream
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.input_layout = input_layout
        self.settings = MTrainingAttentionSettings(sparse_config or SparseConfig(),
                                                   sequence_process_group, hierarchy, stats)
        self._plans: dict = {}
        self._index_cache = IndexCache()
        _check_local_attention(local_attention)

    def forward(self, query, key, value, batch_dim_idx=0, rotary_pos_emb=None, *args, **kwargs):
        if args:
            raise TypeError(f"MTraining DistributedAttention got {len(args)} extra positional "
                            f"argument(s); pass {', '.join(CALL_KEYWORDS)} by name")
        mask = None
        if isinstance(batch_dim_idx, torch.Tensor):  # dist_attn(q, k, v, attention_mask): sbhd
            mask, batch_dim_idx = batch_dim_idx, 1
        if isinstance(rotary_pos_emb, torch.Tensor):  # dist_attn(q, k, v, batch_dim_idx, mask)
            mask, rotary_pos_emb = rotary_pos_emb, None
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx={batch_dim_idx!r} must be 0 ([B, S, H, D]) or 1 ([S, B, H, D])")
        scale = self._options(kwargs, query.shape[-1], mask is not None)
        self._check_shapes(query, key, value, batch_dim_idx)
        q, k, v = (x.transpose(0, 1) if batch_dim_idx == 1 else x for x in (query, key, value))
        local = q.shape[1]
        world, rank = self.settings.world, self.settings.rank
        doc_start = self._doc_start(kwargs, q.shape[0], local * world, q.device)
        if doc_start is not None and rotary_pos_emb is not None:
            raise ValueError("document masking with rotary_pos_emb: apply RoPE with the positions within each "
                             "document (ds_mtraining.documents.document_positions) before calling, and pass no "
                             "rotary_pos_emb")
        # position ids and mask are read on the host: on CUDA once per training step
        checking = check_due("positions") if q.is_cuda else True
        positions = self._input_positions(local, kwargs.get("position_ids") if checking else None, q.device)
        if mask is not None and checking:
            _check_causal_mask(mask, positions)
        if checking and q.is_cuda:
            mark_checked("positions")
        if rotary_pos_emb is not None:
            if not isinstance(rotary_pos_emb, (tuple, list)) or len(rotary_pos_emb) != 2:
                raise ValueError("rotary_pos_emb must be the pair (cos, sin), as Ulysses takes it")
            cos, sin = (self._rotary_rows(t, local, batch_dim_idx, positions, name)
                        for t, name in zip(rotary_pos_emb, ("cos", "sin")))
            q, k = (apply_rotary(x, cos, sin).to(x.dtype) for x in (q, k))
        restripe = self.input_layout == "contiguous" and world > 1
        if restripe:
            check_ranks_before_collectives(ring_comm(self.settings.group), q, k, v, self.settings.sparse)
            plan = self._plan(world, rank, local, q.device)
            q, k, v = self._qkv_to_striped(plan, q, k, v)
        out = striped_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.settings, scale,
                                       cache=self._index_cache, doc_start=doc_start)
        if restripe:
            rows = out.transpose(0, 1)
            out = _Restripe.apply(rows.reshape(local, rows.shape[1], -1), plan, False)
            out = out.view(rows.shape).transpose(0, 1)
        return out.transpose(0, 1) if batch_dim_idx == 1 else out

    # ------------------------------------------------------------------ helpers of forward
    def _options(self, kwargs, head_dim: int, masked: bool) -> float:
        """The softmax scale, from the call's keywords or the local attention; checks the rest."""
        unknown = set(kwargs) - set(CALL_KEYWORDS)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; MTraining "
                            f"DistributedAttention takes {', '.join(CALL_KEYWORDS)}")
        for name in ("causal", "is_causal"):
            if name in kwargs and not kwargs[name]:
                raise ValueError(f"{name}={kwargs[name]!r}: MTraining attention is causal only; "
                                 f"pass {name}=True or leave it out")
        if kwargs.get("dropout_p") and self.training:
            raise ValueError(f"dropout_p={kwargs['dropout_p']}: attention dropout is not supported; "
                             f"pass dropout_p=0")
        function, causal_keyword, keywords = _known_function(self.local_attn)
        causal_said = masked or any(kwargs.get(n) for n in ("causal", "is_causal", causal_keyword))
        if function is not None and not causal_said and not keywords.get(causal_keyword):
            raise ValueError(f"local_attention is {function}, which is not causal unless "
                             f"{causal_keyword}=True; pass {causal_keyword}=True to the call "
                             f"(MTraining attention is causal only)")
        scales = {n: kwargs[n] for n in ("scale", "softmax_scale") if kwargs.get(n) is not None}
        if len(set(scales.values())) > 1:
            raise ValueError(f"scale={scales['scale']} and softmax_scale={scales['softmax_scale']} "
                             f"differ; pass one softmax scale")
        if scales:
            return float(next(iter(scales.values())))
        return _local_attention_scale(self.local_attn, head_dim)

    def _check_shapes(self, query, key, value, batch_dim_idx: int):
        form = "[B, S/W, H, D] (batch_dim_idx=0)" if batch_dim_idx == 0 else "[S/W, B, H, D] (batch_dim_idx=1)"
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.dim() != 4:
                raise ValueError(f"{name} has shape {tuple(x.shape)}; q/k/v must be 4-D {form}")
        for name, x, heads, arg in (("query", query, self.num_heads, "num_heads"),
                                    ("key", key, self.num_kv_heads, "num_kv_heads"),
                                    ("value", value, self.num_kv_heads, "num_kv_heads")):
            if heads is not None and x.shape[2] != heads:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)} but the layer was built with {arg}={heads}: "
                    f"q/k/v must be {form} with heads in dimension 2 (a [B, H, S, D] tensor needs "
                    f".transpose(1, 2))")
        if key.shape != value.shape or key.shape[:2] != query.shape[:2] or key.shape[3] != query.shape[3]:
            raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                             f"{tuple(value.shape)} do not match: q/k/v must be {form}, k and v alike, "
                             f"H a multiple of Hkv")

    @staticmethod
    def _doc_start(kwargs, batch: int, seq_len: int, device):
        """The call's document masking as ``doc_start`` [B, S] (None without it)."""
        if "cu_seqlens" in kwargs and "doc_start" in kwargs:
            raise ValueError("pass cu_seqlens or doc_start, not both")
        if kwargs.get("cu_seqlens") is not None:
            return doc_start_from_cu_seqlens(kwargs["cu_seqlens"], seq_len, batch).to(device)
        return kwargs.get("doc_start")

    def _input_positions(self, local: int, position_ids, device) -> torch.Tensor:
        """Global positions [S/W] of this rank's tokens in the declared layout; ``position_ids``,
        if given, must equal them (in every batch row)."""
        world, rank, block = self.settings.world, self.settings.rank, self.settings.sparse.block_size
        seq_len = _checked_seq_len(local, world, block)
        contiguous = torch.arange(rank * local, (rank + 1) * local, device=device)
        striped = StripedLayout(world, block).positions(seq_len, rank, device)
        expected = contiguous if self.input_layout == "contiguous" else striped
        if position_ids is None:
            return expected
        if position_ids.shape[-1] != local or position_ids.dim() > 2:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected [S/W] or "
                             f"[B, S/W] with S/W = {local}, this rank's tokens")
        given = position_ids.reshape(-1, local).to(device)
        if bool((given == expected).all()):
            return expected
        where = f"rank {rank} of {world}"
        if self.input_layout == "contiguous" and bool((given == striped).all()):
            raise LayoutError(
                f"{where} got block-striped position_ids but DistributedAttention was built with "
                f"input_layout='contiguous' (the default, Ulysses' shards); pass input_layout='striped' "
                f"to use striped shards as they are")
        if self.input_layout == "striped" and bool((given == contiguous).all()):
            raise LayoutError(
                f"{where} got a contiguous shard (positions {rank * local}..{(rank + 1) * local - 1}) but "
                f"DistributedAttention was built with input_layout='striped'; drop input_layout= (the "
                f"default 'contiguous' re-stripes inside) or stripe token ids and position ids in the data "
                f"loader with ds_mtraining.layout.StripedLayout({world}, {block}).shard(x, rank)")
        raise LayoutError(
            f"{where}: position_ids {given[0, :8].tolist()}... are neither this rank's contiguous "
            f"positions {rank * local}..{(rank + 1) * local - 1} (input_layout='contiguous') nor its "
            f"block-striped positions {striped[:8].tolist()}... (input_layout='striped', block {block}); "
            f"shard the sequence one of these two ways and declare it with input_layout=")

    def _rotary_rows(self, table, local: int, batch_dim_idx: int, positions, name: str) -> torch.Tensor:
        """cos/sin in Ulysses' layout -> [B|1, S/W, 1, D_rot] rows of this rank's input tokens."""
        world = self.settings.world
        expected = "[S, 1, 1, D_rot]" if batch_dim_idx == 0 else "[1, S, 1, D_rot]"
        rows = table.permute(1, 0, 2, 3) if table.dim() == 4 else None
        if rows is not None and batch_dim_idx == 1:
            rows = rows.transpose(0, 1)
        if rows is None or rows.shape[2] != 1 or rows.shape[1] not in (local, local * world):
            raise ValueError(
                f"rotary_pos_emb {name} has shape {tuple(table.shape)}; Ulysses' layout for "
                f"{'batch' if batch_dim_idx == 0 else 'sequence'}-first q is {expected} (after "
                f"permute(1, 0, 2, 3) it broadcasts against q), with S the global length "
                f"{local * world} or this rank's {local}")
        if rows.shape[1] == local * world and world > 1:
            rows = rows.index_select(1, positions.to(rows.device))
        return rows

    def _plan(self, world: int, rank: int, local: int, device) -> RestripePlan:
        key = (world, rank, local, self.settings.sparse.block_size, str(device))
        if key not in self._plans:
            self._plans[key] = RestripePlan(self.spg, world, rank, local, self.settings.sparse.block_size,
                                            device)
        return self._plans[key]

    @staticmethod
    def _qkv_to_striped(plan: RestripePlan, q, k, v):
        """One all-to-all for q, k and v together (one per tensor if their dtypes differ)."""
        rows = [x.transpose(0, 1) for x in (q, k, v)]  # [S/W, B, heads, D]
        if q.dtype == k.dtype == v.dtype:
            flat = torch.cat([r.reshape(r.shape[0], r.shape[1], -1) for r in rows], dim=-1)
            sizes = [r.shape[2] * r.shape[3] for r in rows]
            parts = _Restripe.apply(flat, plan, True).split(sizes, dim=-1)
        else:
            parts = [_Restripe.apply(r.reshape(r.shape[0], r.shape[1], -1), plan, True) for r in rows]
        return [p.reshape(r.shape).transpose(0, 1) for p, r in zip(parts, rows)]


# ----------------------------------------------------------------------------- local attention
def _known_function(local_attention):
    """(the underlying function, partial keywords) if ``local_attention`` is a known attention
    function (optionally in functools.partial), else (None, {})."""
    keywords = {}
    function = local_attention
    while isinstance(function, functools.partial):
        keywords = {**function.keywords, **keywords}
        function = function.func
    if function is torch.nn.functional.scaled_dot_product_attention:
        return "torch.nn.functional.scaled_dot_product_attention", "is_causal", keywords
    module, name = getattr(function, "__module__", "") or "", getattr(function, "__name__", "")
    if module.split(".")[0] == "flash_attn" and name.startswith("flash_attn_"):
        return f"flash_attn.{name}", "causal", keywords
    return None, None, keywords


def _attribute(local_attention, names):
    for name in names:
        if hasattr(local_attention, name) and not callable(getattr(local_attention, name)):
            return name, getattr(local_attention, name)
    return None, None


def _local_attention_scale(local_attention, head_dim: int) -> float:
    """The softmax scale ``local_attention`` applies when the call names none."""
    name, value = _attribute(local_attention, ("softmax_scale", "scale"))
    if name is not None:
        if value is None:
            return resolve_softmax_scale(head_dim)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"local_attention.{name}={value!r} is not a number; pass scale= to the call")
    function, _, keywords = _known_function(local_attention)
    if function is not None:
        scale = keywords.get("scale", keywords.get("softmax_scale"))
        return resolve_softmax_scale(head_dim, None if scale is None else float(scale))
    raise ValueError(
        f"cannot tell the softmax scale of local_attention {getattr(local_attention, '__name__', type(local_attention).__name__)}: "
        f"it has no softmax_scale/scale attribute and is not a known attention function "
        f"(scaled_dot_product_attention, flash_attn_*); pass scale= to the call or set "
        f"local_attention.softmax_scale")


def _check_local_attention(local_attention):
    _, causal_keyword, keywords = _known_function(local_attention)
    for name in ("causal", "is_causal"):
        value = keywords.get(name, getattr(local_attention, name, True))
        if value is False:
            raise ValueError(f"local_attention.{name} is False: MTraining attention is causal only")
    dropout = keywords.get("dropout_p", getattr(local_attention, "dropout_p", 0.0))
    if isinstance(dropout, (int, float)) and dropout > 0:
        raise ValueError(f"local_attention.dropout_p={dropout}: attention dropout is not supported")


def _check_causal_mask(mask: torch.Tensor, positions: torch.Tensor):
    """A Megatron/HF attention mask must be the causal one on this rank's query rows: bool with
    True = masked (Megatron), or additive float with -inf/min = masked."""
    seq_len = mask.shape[-1]
    rows = mask.index_select(-2, positions.to(mask.device)) if mask.shape[-2] == seq_len else mask
    if rows.shape[-2] != positions.numel():
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} matches neither the global "
                         f"sequence ({seq_len}) nor this rank's {positions.numel()} rows")
    masked = rows if rows.dtype == torch.bool else rows < 0
    causal_masked = positions.to(mask.device)[:, None] < torch.arange(seq_len, device=mask.device)[None, :]
    if not bool((masked == causal_masked).all()):
        raise ValueError("the attention mask is not the causal mask; MTraining attention computes causal "
                         "attention only (no padding or document masks: pack sequences instead)")
