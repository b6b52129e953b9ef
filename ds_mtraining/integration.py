"""MTraining in your own training code: one call on a Hugging Face model, one data-loader adapter.

    mt = ds_mtraining.integration.enable(model, "ds_config.json")   # before deepspeed.initialize
    engine, *_ = deepspeed.initialize(model=model, config="ds_config.json", ...)   # mpu added
    for batch in mt.loader(loader):                                  # this rank's striped shard
        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        engine.backward(loss)
        engine.step()

:func:`enable` wires what ``ds_mtraining.train`` wires (see ``docs/INTEGRATION.md``):

* the process groups (:func:`ds_mtraining.distributed.initialize_groups`), initialising
  torch.distributed through DeepSpeed first if nobody has; ``deepspeed.initialize`` (also when
  accelerate or the HF ``Trainer`` calls it) gets ``mpu=`` these groups for this model, and a
  ``train_batch_size`` counted over the whole world is recounted over the data-parallel replicas;
* the attention (:func:`ds_mtraining.hf.use_mtraining_attention`) and, with ``liger``,
  liger-kernel's RMSNorm/RoPE/SwiGLU and fused loss (as ``mtraining.liger``);
* the model's forward: each call starts a step for the once-per-step checks
  (:func:`ds_mtraining.step.new_step`); given ``shift_labels`` (what the adapter
  yields) it returns ``CausalLMOutputWithPast(loss=...)``, the sequence-parallel cross-entropy
  (:func:`sequence_parallel_loss`) from the final hidden states, never materialising logits;
* shutdown: ``torch.distributed.destroy_process_group`` releases the estimator's CUDA graphs
  first, and at exit :func:`ds_mtraining.distributed.shutdown` runs if the group still exists.

The adapter (:class:`SequenceParallelLoader`, ``mt.loader``) takes an ordinary loader of whole
sequences: ``input_ids`` [B, S] (or [S]), optional ``labels`` (HF convention: not shifted) or
``shift_labels``, and optional documents packed back to back, as ``position_ids`` restarting at 0
in each (HF's ``DataCollatorWithFlattening``), ``cu_seqlens`` or ``doc_start``. An
``attention_mask`` of ones is dropped; padding is refused. It shifts labels on the global
sequence, then stripes (:func:`ds_mtraining.data.shard_batch`): ``input_ids``, ``shift_labels``,
``position_ids`` (global, or per document), ``doc_start`` when documents are packed and
``num_valid_tokens`` (valid labels of the whole sequences: the loss's denominator).
"""
from __future__ import annotations

import atexit
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .config import SparseConfig
from .data import shard_batch
from .dense_backend import check_dense_backend, resolve_dense_backend
from .distributed import ParallelGroups, RING_KINDS, check_parallel_sizes, initialize_groups, shutdown
from .loss import IGNORE_INDEX, sequence_parallel_cross_entropy, token_cross_entropy_sum
from .layout import StripedLayout, check_divisible
from .training.run_config import SECTION_KEYS

MTRAINING_KEY = "mtraining"  # the DeepSpeed JSON's section (as ds_mtraining.train reads it)
SETTING_KEYS = ("sequence_parallel_size", "ring", "stripe_block", "sparse", "loss_chunk_tokens", "liger",
                "keep_attention_output", "attention", "static", "dense_backend")
# the section's keys that belong to ds_mtraining.train's own loop, not to a model (the data, the
# memory tools' loop): ignored here, so one JSON serves both
TRAIN_ONLY_KEYS = tuple(sorted(SECTION_KEYS - set(SETTING_KEYS)))
SHARDINGS = ("world", "sequence")
DOCUMENT_KEYS = ("cu_seqlens", "cu_seq_lens_q", "doc_start")
DROPPED_KEYS = ("cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")  # flash-attn kwargs of HF collators


# ----------------------------------------------------------------------------- settings
@dataclass
class IntegrationSettings:
    """What :func:`enable` sets up (keyword arguments, or the ``mtraining`` section of a DeepSpeed JSON)."""

    sequence_parallel_size: int
    ring: str = "flat"
    sparse: SparseConfig = None
    loss_chunk_tokens: int = 1024
    liger: str | bool = "auto"
    keep_attention_output: bool = False
    attention: str = "sparse"  # sparse (MTraining) | dense | static: ds_mtraining.static's baselines
    static: dict | None = None
    dense_backend: str = "auto"  # the dense baseline's kernel on one GPU: ds_mtraining.dense_backend


def read_section(config) -> dict:
    """The ``mtraining`` section of a DeepSpeed JSON (a path or a dict; none: {})."""
    if config is None:
        return {}
    values = json.loads(Path(config).read_text()) if isinstance(config, (str, Path)) else dict(config)
    section = values.get(MTRAINING_KEY, values if set(values) <= set(SETTING_KEYS + TRAIN_ONLY_KEYS) else {})
    unknown = sorted(set(section) - set(SETTING_KEYS + TRAIN_ONLY_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in '{MTRAINING_KEY}'; valid keys are "
                         f"{sorted(SETTING_KEYS + TRAIN_ONLY_KEYS)}")
    return {k: v for k, v in section.items() if k in SETTING_KEYS}


def resolve_settings(config=None, world_size: int = 1, **given) -> IntegrationSettings:
    """Keyword arguments over the JSON section over the defaults (sequence-parallel size: the
    world), validated: a bad value is one ValueError naming it and the fix."""
    values = {**read_section(config), **{k: v for k, v in given.items() if v is not None}}
    unknown = sorted(set(values) - set(SETTING_KEYS))
    if unknown:
        raise TypeError(f"enable() got unknown setting(s) {unknown}; use {list(SETTING_KEYS)}")
    sp = values.get("sequence_parallel_size", world_size)
    check_parallel_sizes(world_size, sp, key="sequence_parallel_size")
    ring = values.get("ring", "flat")
    if ring not in RING_KINDS:
        raise ValueError(f"ring={ring!r} is not a ring kind; use one of {list(RING_KINDS)}")
    sparse = values.get("sparse") or {}
    if not isinstance(sparse, SparseConfig):
        sparse = dict(sparse)
        if "stripe_block" in values:
            sparse.setdefault("block_size", values["stripe_block"])
        sparse = SparseConfig.from_dict(sparse, where="sparse")
    elif values.get("stripe_block", sparse.block_size) != sparse.block_size:
        raise ValueError(f"stripe_block={values['stripe_block']} differs from sparse.block_size="
                         f"{sparse.block_size}; the stripe is the kernel block: give one of them")
    chunk = values.get("loss_chunk_tokens", 1024)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"loss_chunk_tokens={chunk!r} must be a positive integer")
    return IntegrationSettings(sp, ring, sparse, chunk, values.get("liger", "auto"),
                               bool(values.get("keep_attention_output", False)), values.get("attention", "sparse"),
                               values.get("static"), check_dense_backend(values.get("dense_backend", "auto")))


# ----------------------------------------------------------------------------- the loss
def sequence_parallel_loss(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, group=None,
                           num_items=None, chunk_tokens: int = 1024, fused: bool = False,
                           softcap: float | None = None) -> torch.Tensor:
    """The causal-LM loss of a striped shard: the group's summed token cross-entropy over
    ``num_items`` (the valid labels of the whole sequences, e.g. the adapter's
    ``num_valid_tokens``; None: counted over the group here). Its value is the same on every rank
    of ``group``; its gradient is this rank's share (DeepSpeed sums a sequence-parallel group's
    gradients), so ranks holding different numbers of valid tokens weigh every token alike. ``softcap``:
    the LM head's logit soft-capping (:func:`ds_mtraining.hf.output_head_inputs`)."""
    if num_items is None:
        return sequence_parallel_cross_entropy(hidden, weight, shift_labels, group, chunk_tokens, fused, softcap)
    local_sum = token_cross_entropy_sum(hidden, weight, shift_labels, chunk_tokens, fused, softcap)
    total = local_sum.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    count = torch.as_tensor(num_items, dtype=torch.float32, device=local_sum.device).clamp(min=1.0)
    share = local_sum / count
    return share + (total / count - share).detach()


# ----------------------------------------------------------------------------- whole sequences
def _tensor(value, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.dtype.is_floating_point or tensor.dim() not in (1, 2):
        raise ValueError(f"batch['{name}'] must be integer [B, S] (or [S]), got {tensor.dtype} "
                         f"{tuple(tensor.shape)}")
    return tensor.long().reshape(-1, tensor.shape[-1])


def shift(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted on the global sequence (the label of token t is labels[t + 1]; the last
    token has none: -100), as HF's causal-LM loss shifts them, before any striping."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def whole_sequences(batch) -> dict:
    """A loader's batch as whole sequences: ``input_ids``, ``shift_labels`` [B, S] and
    ``doc_start`` ([B, S] or None: one document per row). One ValueError line per bad input."""
    from .documents import check_doc_start, doc_start_from_cu_seqlens
    batch = dict(batch)
    if "input_ids" not in batch:
        raise ValueError(f"the batch has no 'input_ids' (keys: {sorted(batch)}); MTraining's adapter takes "
                         f"whole token sequences")
    unknown = sorted(set(batch) - {"input_ids", "labels", "shift_labels", "position_ids", "attention_mask",
                                   *DOCUMENT_KEYS, *DROPPED_KEYS})
    if unknown:
        raise ValueError(f"batch key(s) {unknown} are not handled by MTraining's adapter (it stripes input_ids, "
                         f"labels, position_ids and document boundaries); drop them in the collator")
    input_ids = _tensor(batch["input_ids"], "input_ids")
    batch_size, seq_len = input_ids.shape
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = _tensor(mask, "attention_mask")
        if mask.shape != input_ids.shape or not bool((mask == 1).all()):
            padded = int((mask == 0).sum()) if mask.shape == input_ids.shape else "some"
            raise ValueError(f"attention_mask masks {padded} of the batch's {batch_size} x {seq_len} tokens "
                             f"(padding): MTraining attention takes no mask; pack sequences back to back to a "
                             f"fixed length instead (documents marked by position_ids restarting at 0, or "
                             f"cu_seqlens), or give pad tokens at the end labels -100 and no attention_mask")
    for name in ("shift_labels", "labels", "position_ids", "doc_start"):
        shape = tuple(torch.as_tensor(batch[name]).shape) if name in batch else input_ids.shape
        if shape[-1:] != (seq_len,) or int(torch.Size(shape).numel()) != batch_size * seq_len:
            raise ValueError(f"batch['{name}'] has shape {shape}, input_ids {tuple(input_ids.shape)}; "
                             f"give one entry per token")
    if "shift_labels" in batch:
        labels = _tensor(batch["shift_labels"], "shift_labels")
    else:
        labels = shift(_tensor(batch["labels"], "labels") if "labels" in batch else input_ids)
    doc_start = None
    cu = batch.get("cu_seqlens", batch.get("cu_seq_lens_q"))
    if "doc_start" in batch:
        doc_start = check_doc_start(_tensor(batch["doc_start"], "doc_start"), batch_size, seq_len, "cpu")
    elif cu is not None:
        rows = list(cu) if isinstance(cu, (list, tuple)) or torch.as_tensor(cu).dim() == 2 else [cu] * batch_size
        doc_start = doc_start_from_cu_seqlens([torch.as_tensor(r) for r in rows], seq_len, batch_size)
    elif "position_ids" in batch:  # HF packing: positions restart at 0 in each document
        positions = _tensor(batch["position_ids"], "position_ids")
        try:
            doc_start = check_doc_start(torch.arange(seq_len) - positions, batch_size, seq_len, "cpu")
        except ValueError:
            raise ValueError("batch['position_ids'] are neither 0..S-1 nor restarting at 0 in each packed "
                             "document; give each row's positions as t - (its document's first token)") from None
    if doc_start is not None and not bool(doc_start.any()):
        doc_start = None  # one document per row: nothing to mask (the faster paths run)
    return {"input_ids": input_ids, "shift_labels": labels, "doc_start": doc_start}


def shard_sequences(sequences: dict, layout: StripedLayout, rank: int) -> dict:
    """``rank``'s striped shard of :func:`whole_sequences`' output, with ``num_valid_tokens``."""
    input_ids = sequences["input_ids"]
    try:
        check_divisible(input_ids.shape[1], layout.world, layout.block_size, what="sequence length",
                        factors="sequence-parallel ranks x block")
    except ValueError as error:
        raise ValueError(f"{error}; pad tokens at the end need labels -100 and no attention_mask") from None
    batch = shard_batch(layout, rank, input_ids, sequences["shift_labels"], sequences["doc_start"])
    batch["shift_labels"] = batch.pop("labels")
    batch["num_valid_tokens"] = (sequences["shift_labels"] != IGNORE_INDEX).sum()
    return batch


def _comm_device(group):
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


class SequenceParallelLoader:
    """Wraps a loader of whole sequences; yields this rank's striped shards (module docstring).

    ``sharding``: how the wrapped loader deals batches out.

    * ``"world"`` (default; a ``DistributedSampler`` over every rank, HF Trainer and accelerate):
      each rank reads its own batch. The ranks of a sequence-parallel group exchange them
      (one all-gather) and each batch is then trained on in turn by the whole group, rank 0's
      first: every sample once, as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` does; the loader
      is ``sequence_parallel_size`` times longer.
    * ``"sequence"``: the group's ranks already read the same batch (a sampler over the
      data-parallel replicas: ``mt.data_parallel_size``/``mt.data_parallel_rank``); checked.

    Every rank's batch must have the same shape [B, S] with S a multiple of ranks x block."""

    def __init__(self, loader, groups: ParallelGroups | None, block_size: int, sharding: str = "world"):
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding={sharding!r}; use one of {list(SHARDINGS)}")
        self.loader, self.sharding = loader, sharding
        self.group = None if groups is None else groups.sequence_group
        self.world = 1 if groups is None else dist.get_world_size(self.group)
        self.rank = 0 if groups is None else dist.get_rank(self.group)
        self.layout = StripedLayout(self.world, block_size)

    def __len__(self) -> int:
        return len(self.loader) * (self.world if self.sharding == "world" else 1)

    def __iter__(self):
        for batch in self.loader:
            sequences = whole_sequences(batch)
            for whole in self._exchange(sequences):
                yield shard_sequences(whole, self.layout, self.rank)

    def _exchange(self, sequences: dict) -> list:
        """The group's batches in the order they are trained on (this rank's alone at W = 1)."""
        if self.world == 1:
            return [sequences]
        ids, labels, doc_start = sequences["input_ids"], sequences["shift_labels"], sequences["doc_start"]
        device = _comm_device(self.group)
        weights = torch.arange(1, ids.numel() + 1, dtype=torch.float64).reshape(ids.shape)
        fingerprint = [float((ids * weights).sum()), float((labels * weights).sum()),
                       -1.0 if doc_start is None else float((doc_start * weights).sum())]
        meta = torch.tensor([*ids.shape, *fingerprint], dtype=torch.float64, device=device)
        metas = [torch.empty_like(meta) for _ in range(self.world)]
        dist.all_gather(metas, meta, group=self.group)
        shapes = [tuple(int(x) for x in m[:2].tolist()) for m in metas]
        if len(set(shapes)) > 1:
            raise ValueError(f"the sequence-parallel group's ranks hold batches of different shapes [B, S] "
                             f"{shapes} (rank order); every rank needs the same B and S: collate to one fixed "
                             f"length (pack, or cut)")
        if self.sharding == "sequence":
            if any(not torch.equal(m[2:], metas[0][2:]) for m in metas):
                raise ValueError("sharding='sequence' but the sequence-parallel group's ranks read different batches; "
                                 "give them the same batches (a sampler over mt.data_parallel_size replicas at "
                                 "mt.data_parallel_rank) or use sharding='world'")
            return [sequences]
        documents = any(float(m[4]) >= 0 for m in metas)
        parts = [ids, labels] + ([torch.zeros_like(ids) if doc_start is None else doc_start.long()] if documents else [])
        local = torch.stack(parts).to(device)
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local, group=self.group)
        out = []
        for stacked in gathered:
            stacked = stacked.to(ids.device)
            starts = stacked[2].to(torch.int32) if documents and bool(stacked[2].any()) else None
            out.append({"input_ids": stacked[0], "shift_labels": stacked[1], "doc_start": starts})
        return out


# ----------------------------------------------------------------------------- enable
class MTraining:
    """What :func:`enable` returns: the groups (``mpu``), the attention settings, the adapter and
    the loss of this model."""

    def __init__(self, model, groups: ParallelGroups, settings: IntegrationSettings, attention_settings,
                 fused_loss: bool):
        self.model, self.groups, self.settings = model, groups, settings
        self.attention_settings, self.fused_loss = attention_settings, fused_loss

    @property
    def mpu(self) -> ParallelGroups:
        """``deepspeed.initialize(..., mpu=mt.mpu)`` (added automatically when not given)."""
        return self.groups

    @property
    def data_parallel_size(self) -> int:
        return self.groups.get_data_parallel_world_size()

    @property
    def data_parallel_rank(self) -> int:
        return self.groups.get_data_parallel_rank()

    def loader(self, loader, sharding: str = "world") -> SequenceParallelLoader:
        """This rank's striped shards of ``loader``'s whole sequences (:class:`SequenceParallelLoader`)."""
        return SequenceParallelLoader(loader, self.groups, self.settings.sparse.block_size, sharding)

    def loss(self, hidden: torch.Tensor, shift_labels: torch.Tensor, num_items=None) -> torch.Tensor:
        """:func:`sequence_parallel_loss` of final hidden states [B, S/W, D] against the LM head."""
        from .hf import output_head_inputs
        hidden, weight, softcap = output_head_inputs(self.model, hidden)
        return sequence_parallel_loss(hidden, weight, shift_labels, self.groups.sequence_group, num_items,
                                      self.settings.loss_chunk_tokens, self.fused_loss, softcap)

    def adapt_trainer(self, trainer):
        """Makes a ``transformers.Trainer`` train on striped shards: its train dataloader (sharded
        over every rank by accelerate) goes through :meth:`loader`. Returns the trainer."""
        make = trainer.get_train_dataloader
        trainer.get_train_dataloader = lambda *args, **kwargs: self.loader(make(*args, **kwargs))
        return trainer


def _forward_with_loss(model, mt: MTraining):
    """The model's forward, wrapped (see the module docstring)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from .step import new_step
    original = model.forward

    # its own signature (not the model's): the HF Trainer keeps the dataset columns it names
    def forward(input_ids=None, shift_labels=None, position_ids=None, doc_start=None, num_valid_tokens=None,
                labels=None, attention_mask=None, cu_seqlens=None, cu_seq_lens_q=None, **kwargs):
        new_step()
        if labels is not None or cu_seqlens is not None or cu_seq_lens_q is not None:
            raise ValueError("labels or document boundaries reached the model unstriped; wrap the loader with "
                             "mt.loader(...) (it shifts labels on the whole sequence and yields shift_labels)")
        if attention_mask is not None:
            raise ValueError("MTraining attention takes no attention_mask; wrap the loader with mt.loader(...) "
                             "(it drops a mask of ones and refuses padding)")
        documents = {} if doc_start is None else {"doc_start": doc_start}
        if shift_labels is None:  # no loss wanted: the model's own forward on this shard
            return original(input_ids=input_ids, position_ids=position_ids, **documents, **kwargs)
        kwargs.setdefault("use_cache", False)  # training never reads a KV cache; filling one copies K/V
        hidden = model.base_model(input_ids=input_ids, position_ids=position_ids, **documents,
                                  **kwargs).last_hidden_state
        return CausalLMOutputWithPast(loss=mt.loss(hidden, shift_labels, num_valid_tokens))

    forward.__doc__ = f"MTraining's forward (ds_mtraining.integration) around:\n{original.__doc__ or ''}"
    return forward


_ENABLED_ATTRIBUTE = "_ds_mtraining_integration"
_installed: dict = {}


def enabled(module) -> MTraining | None:
    """The :class:`MTraining` of ``module`` or of a module inside it (None: not enabled)."""
    if module is None or not isinstance(module, torch.nn.Module):
        return None
    for inner in module.modules():
        mt = getattr(inner, _ENABLED_ATTRIBUTE, None)
        if mt is not None:
            return mt
    return None


def _with_mtraining_config(config, mt: MTraining):
    """A DeepSpeed config (path or dict) without the ``mtraining`` section, with a
    ``train_batch_size`` counted over every rank recounted over the data-parallel replicas."""
    if config is None or not isinstance(config, (str, Path, dict)):
        return config
    values = json.loads(Path(config).read_text()) if isinstance(config, (str, Path)) else dict(config)
    values.pop(MTRAINING_KEY, None)
    micro, steps, total = (values.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                   "train_batch_size"))
    if all(isinstance(v, int) for v in (micro, steps, total)) and total == micro * steps * dist.get_world_size():
        values["train_batch_size"] = micro * steps * mt.data_parallel_size
    return values


def _install_hooks():
    """Once per process: ``deepspeed.initialize`` takes the enabled model's groups and config;
    ``destroy_process_group`` releases the estimator's CUDA graphs first; shutdown at exit."""
    if _installed:
        return
    import deepspeed
    from torch.distributed import distributed_c10d
    from .distributed.shm import release_shm_buffer
    from .estimator import graphs as estimator_graphs
    initialize = deepspeed.initialize

    @functools.wraps(initialize)
    def initialize_with_mtraining(*args, **kwargs):
        mt = enabled(kwargs.get("model", args[1] if len(args) > 1 else None))
        if mt is not None:
            if kwargs.get("mpu") is None:
                kwargs["mpu"] = mt.groups
            elif kwargs["mpu"] is not mt.groups:
                raise ValueError("deepspeed.initialize got an mpu other than MTraining's groups; pass mpu=mt.mpu "
                                 "or none (it is added)")
            for key in ("config", "config_params"):
                kwargs[key] = _with_mtraining_config(kwargs.get(key), mt)
        result = initialize(*args, **kwargs)
        if mt is not None:
            release_shm_buffer()  # DeepSpeed's comm may have started only now (accelerate initialised torch's)
        return result

    destroy = distributed_c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(*args, **kwargs):
        estimator_graphs.release()  # a live graph with NCCL collectives makes the destroy hang
        return destroy(*args, **kwargs)

    deepspeed.initialize = initialize_with_mtraining
    dist.destroy_process_group = distributed_c10d.destroy_process_group = destroy_process_group
    atexit.register(shutdown)
    _installed.update(initialize=initialize, destroy=destroy)


def enable(model, config=None, *, sequence_parallel_size: int | None = None, sparse=None, ring: str | None = None,
           loss_chunk_tokens: int | None = None, liger=None, keep_attention_output: bool | None = None,
           attention: str | None = None, dense_backend: str | None = None) -> MTraining:
    """Switches a HF causal LM (docs/MODELS.md) to MTraining for the user's own training loop.

    Settings: keyword arguments, else the ``mtraining`` section of ``config`` (a DeepSpeed JSON
    path or dict, e.g. the one ``ds_mtraining.train`` runs; keys that belong to train's own loop,
    such as ``seq_len`` or ``data``, are ignored), else the defaults (sequence-parallel size: the
    world; ``SparseConfig()``; liger ``"auto"``). Call before ``deepspeed.initialize`` (or before
    ``Trainer.train``), after enabling activation checkpointing if you use it or at any point before
    the first step. See the module docstring for what it wires."""
    import deepspeed
    from .distributed.shm import release_shm_buffer
    from .hf import checked_attention_modules, training_device_type, use_mtraining_attention
    from .layer import MTrainingAttentionSettings
    from .static import attention_pattern
    from .training.model import use_fused_kernels
    if enabled(model) is not None:
        raise ValueError("MTraining is already enabled on this model; call enable() once per model")
    device_type = training_device_type()
    checked_attention_modules(model, device_type)  # a refusal before any process group
    if not dist.is_initialized():
        deepspeed.init_distributed()
    release_shm_buffer()  # on CPU: the name of DeepSpeed's shm buffer (whoever initialised), not the mapping
    settings = resolve_settings(config, dist.get_world_size(), sequence_parallel_size=sequence_parallel_size,
                                sparse=sparse, ring=ring, loss_chunk_tokens=loss_chunk_tokens, liger=liger,
                                keep_attention_output=keep_attention_output, attention=attention,
                                dense_backend=dense_backend)
    dense = "sdpa"
    if settings.attention == "dense":  # resolved once, on this rank's device; printed first, as train does
        resolved = resolve_dense_backend(settings.dense_backend)
        dense = resolved.name
        if dist.get_rank() == 0:
            print(f"ds_mtraining: {resolved.describe()}", flush=True)
    groups = initialize_groups(settings.sequence_parallel_size, settings.ring)
    fused_off = use_fused_kernels(model, settings.liger)
    pattern = attention_pattern(settings.attention, settings.static)
    attention_settings = MTrainingAttentionSettings.from_groups(settings.sparse, groups, None, pattern,
                                                                settings.keep_attention_output, dense)
    use_mtraining_attention(model, attention_settings, device_type)
    mt = MTraining(model, groups, settings, attention_settings, fused_loss=fused_off is None)
    model.forward = _forward_with_loss(model, mt)
    model.accepts_loss_kwargs = False  # HF Trainer: the loss is already the group's mean; no rescaling
    setattr(model, _ENABLED_ATTRIBUTE, mt)
    _install_hooks()
    return mt
