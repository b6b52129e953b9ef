"""The memory a long sequence needs, and the tools that bound it (``mtraining.memory``):

* **tiled MLP** (:func:`tile_mlps`): each decoder layer's MLP over chunks of ``mlp_chunk_tokens``
  tokens in the forward and the backward, so no [S, intermediate] tensor exists whole. The
  backward is DeepSpeed's ``TiledMLP.backward`` (it recomputes each chunk with grad and holds back
  ZeRO's gradient hooks, ``ds_grad_is_ready``, until the last chunk). The forward is our own: it
  saves the input *before* computing the chunks, so that under activation checkpointing the
  recomputed forward stops there (``torch.utils.checkpoint``'s early stop) and the MLP runs twice
  per step, as untiled; DeepSpeed's ``TiledMLP.forward`` saves its input after the chunks, and its
  MLP runs three times (:class:`TiledMLPFunction`). It wraps whatever forward the MLP module has,
  HF's or liger-kernel's SwiGLU.
* **activation checkpointing** (:func:`enable_checkpointing`): HF's, of each decoder layer.
* **checkpoint offload** (:class:`CheckpointOffload`): the inputs that activation checkpointing saves
  per decoder layer (the hidden states, [B, S/W, hidden]) of the first N layers go to pinned host
  memory on a side stream during the forward and come back, one layer ahead, during the
  backward. Built on DeepSpeed's ``CheckpointHiddenStatesOffload`` (its marker on transformers'
  ``GradientCheckpointingLayer``, pack hook, side stream and pinned buffer pool), with three
  changes: a restored tensor is not cached until the step ends (DeepSpeed's cache keeps every
  restored layer on the GPU to the end of the backward, so the backward's last layers peak as
  without offload), the next layer's tensor is prefetched while the current one's backward
  runs, and on CPU the copy still happens (into a separate CPU tensor) so that CPU runs exercise
  it.
* **the plan** (:func:`plan_memory`): before any process group exists, the GPU memory the run
  needs (:func:`gpu_breakdown`, an estimate within 5% of the peaks measured on one H200 at
  256K-768K) and the host memory the CPU optimizer (ZeRO offload) and the offloaded checkpoints
  need against what the host has. ``"auto"`` offloads the fewest layers that let the GPU's
  estimate fit (none where everything fits: offloading costs copies and pinned host memory for
  nothing); where the GPU needs more than the host holds, or more than every layer, the run stops
  there with one line naming the numbers and what to change (a run that would be killed minutes
  later by the host's OOM killer or the allocator). A given N beyond the host is one line naming
  the numbers and the setting to change.
* ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before CUDA starts, unless the user set
  the variable (fragmentation at 512K: 11.7 GiB reserved but unallocated at the OOM).
* pinned blocks at their size (:func:`exact_pinning`): the CUDA host allocator rounds a pinned
  block up to a power of two, and DeepSpeed pins the CPU optimizer's fp32 master weights, its fp32
  gradients and a training-dtype copy (the 3B shape: 11.5 + 11.5 + 5.7 GiB pinned as 16 + 16 + 8,
  11.3 GiB of host memory for nothing) and the offloaded checkpoints (3 GiB as 4 at 768K). Where
  torch has ``pinned_max_round_threshold_mb`` it goes into the allocator setting; else, where the
  process may lock that much memory, DeepSpeed's own pinning (``DS_PIN_MEMORY_BACKEND=native``:
  page-aligned, mlock'ed and registered with CUDA at the size asked) takes every pin DeepSpeed
  makes; else the plan counts the rounding.
* a CUDA out-of-memory error during training becomes one line (:func:`out_of_memory_line`).

The loss never holds [S, vocab]: :mod:`ds_mtraining.loss` chunks it (or liger's fused linear
cross-entropy does).
"""
from __future__ import annotations

import math
import os
import re
import resource
from dataclasses import asdict, dataclass, field

import torch

from . import MTRAINING_KEY, ConfigError

GIB = 2 ** 30
SECTION = f"{MTRAINING_KEY}.memory"
OFFLOAD_WORDS = ("auto", "all", "none")
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"
PINNED_ROUND_KEY = "pinned_max_round_threshold_mb"
PINNED_EXACT = f"{PINNED_ROUND_KEY}:64"  # pinned blocks above 64 MiB at their size, not the next power of two
PIN_BACKEND = "DS_PIN_MEMORY_BACKEND"  # DeepSpeed's accelerator.pin_memory: "torch" (the default) or "native"
# what a rank's process holds on the host beyond the CPU optimizer and the offloaded checkpoints
# (Python, torch, CUDA's host side, DeepSpeed's staging buffers, the data), GiB: on one H200, 3B
# shape, 256K-768K, the peak resident set less those (at their pinned, rounded sizes) was 3.2-3.3;
# a CPU rank of scripts/train_demo.sh (2 ranks, the tiny model) peaked at 1.05
HOST_PROCESS_GIB = {"cuda": 3.5, "cpu": 1.25}
# a test hook: the host's available memory in GiB instead of /proc/meminfo's MemAvailable
HOST_MEMORY_ENV = "DS_MTRAINING_HOST_MEMORY_GIB"
CPU_ONLY = "no CUDA allocator (CPU)"
CHECKPOINTING_OFF = "checkpointing off"  # the offload choice without activation checkpointing
# the allocator settings a plan in this process put in the environment: a later plan replaces them
# (they are not the user's choice)
SET_BY_PLAN: dict[str, str] = {}


class MemoryPlanError(ConfigError):
    """The plan does not fit: the GPU's estimate exceeds its memory whatever is offloaded."""


class HostMemoryError(MemoryPlanError):
    """The CPU optimizer and the offloaded checkpoints (those given, or those the GPU needs) do not
    fit the host's memory."""


class OutOfMemory(RuntimeError):
    """A CUDA out-of-memory error during training, as one line (:func:`out_of_memory_line`)."""


# ----------------------------------------------------------------------------- settings
@dataclass
class MemorySettings:
    """``mtraining.memory``; each default aims at the longest sequence that fits."""

    tiled_mlp: str | bool = "auto"  # auto: on where a rank holds >= 2 chunks of tokens
    mlp_chunk_tokens: int = 16384  # tokens per chunk of the tiled MLP
    offload_checkpoints: str | int = "auto"  # auto (the fewest layers the GPU estimate needs) | all | none | N
    host_reserve_gib: str | float = "auto"  # host memory the plan leaves free: auto = min(6, MemTotal / 20)
    expandable_segments: bool = True  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless set

    def to_dict(self) -> dict:
        return asdict(self)


def parse_memory(section: dict, checkpointing: bool) -> MemorySettings:
    """Validates ``mtraining.memory`` (a bad value: one ConfigError naming the key and the fix)."""
    values = section.get("memory", {})
    if not isinstance(values, dict):
        raise ConfigError(f"{SECTION} must be an object, e.g. {{\"offload_checkpoints\": \"auto\"}}; got {values!r}")
    known = set(MemorySettings.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in '{SECTION}'; valid keys are {sorted(known)}")
    settings = MemorySettings(**values)
    if not (isinstance(settings.tiled_mlp, bool) or settings.tiled_mlp == "auto"):
        raise ConfigError(f"{SECTION}.tiled_mlp={settings.tiled_mlp!r} must be 'auto' (on where a rank holds at "
                          f"least two chunks of tokens), true or false")
    chunk = settings.mlp_chunk_tokens
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"{SECTION}.mlp_chunk_tokens={chunk!r} must be a positive integer (tokens per MLP "
                          f"chunk; 16384 keeps a 3B model's chunk intermediates near 1 GiB)")
    offload = settings.offload_checkpoints
    if not (offload in OFFLOAD_WORDS or (isinstance(offload, int) and not isinstance(offload, bool) and offload >= 0)):
        raise ConfigError(f"{SECTION}.offload_checkpoints={offload!r} must be 'auto' (as many layers as the host's "
                          f"memory holds), 'all', 'none' or a number of layers (the first N)")
    if offload not in ("auto", "none", 0) and not checkpointing:
        raise ConfigError(f"{SECTION}.offload_checkpoints={offload!r} offloads the inputs that activation "
                          f"checkpointing saves, and checkpointing is off: set {MTRAINING_KEY}."
                          f"gradient_checkpointing to true, or this to 'none'")
    reserve = settings.host_reserve_gib
    if reserve != "auto" and (isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or reserve < 0):
        raise ConfigError(f"{SECTION}.host_reserve_gib={reserve!r} must be 'auto' (6 GiB, at most a twentieth of "
                          f"the host's memory) or a number of GiB >= 0")
    if not isinstance(settings.expandable_segments, bool):
        raise ConfigError(f"{SECTION}.expandable_segments={settings.expandable_segments!r} must be true or false")
    return settings


# ----------------------------------------------------------------------------- the tiled MLP
class TiledMLPFunction(torch.autograd.Function):
    """``fn(module, x)`` (an MLP: hidden -> hidden per token) over ``shards`` chunks of the
    flattened tokens. ``forward`` saves ``x`` and returns an uninitialised output; the caller
    fills it chunk by chunk without grad (:func:`tiled_mlp`). Saving first matters under
    non-reentrant activation checkpointing: the recomputed forward stops at the layer's last
    saved tensor, this one, before the chunks run again. ``backward`` is DeepSpeed's
    ``TiledMLP.backward`` (the same argument order): each chunk recomputed with grad, its input
    gradient written in place, ZeRO's gradient hooks held until the last chunk."""

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params):
        ctx.fn, ctx.self, ctx.shards = fn, module, shards
        ctx.compute_params = [p for p in compute_params if p.requires_grad]
        ctx.save_for_backward(x)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, *grads):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
        return TiledMLP.backward(ctx, *grads)


def tiled_mlp(fn, module, x: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """``fn(module, x)`` computed ``chunk_tokens`` tokens at a time, forward and backward."""
    tokens = x.numel() // x.shape[-1]
    shards = max(1, math.ceil(tokens / chunk_tokens))
    if not torch.is_grad_enabled():
        out = torch.empty_like(x)
    else:
        out = TiledMLPFunction.apply(fn, module, x, shards, list(module.parameters()))
    flat_in, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    with torch.no_grad():  # the chunks' intermediates are freed chunk by chunk
        for piece, target in zip(flat_in.chunk(shards), flat_out.chunk(shards)):
            target.copy_(fn(module, piece))
    return out


def tile_mlps(model, chunk_tokens: int) -> int:
    """Replaces the forward of every decoder layer's ``mlp`` by its tiled form, wrapping the
    forward the module has now (HF's, or liger-kernel's SwiGLU where applied: tile after liger).
    Returns the number of MLPs tiled."""
    count = 0
    for layer in model.base_model.layers:
        mlp = layer.mlp
        current = mlp.forward  # a bound method: the class's, or one set on the instance (liger)

        def forward(x, _current=current, _mlp=mlp):
            return tiled_mlp(lambda module, piece: _current(piece), _mlp, x, chunk_tokens)
        mlp.forward = forward
        count += 1
    return count


# ----------------------------------------------------------------------------- checkpointing and its offload
def enable_checkpointing(model, reentrant: bool = False):
    """Recomputes each decoder layer of the HF ``model`` in the backward (torch's checkpoint,
    ``use_reentrant=reentrant``): ``activation_checkpointing_enable`` where transformers has it
    (5.24 deprecates the older ``gradient_checkpointing_enable`` with a FutureWarning in every
    call), else the older name (5.17 knows no other)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _offload_base():
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
    return CheckpointHiddenStatesOffload


class CheckpointOffload(_offload_base()):
    """The checkpointed inputs of the first ``layers`` of ``num_layers`` decoder layers to host
    memory (see the module docstring). Enter it around each micro-step's forward *and* backward;
    on CUDA the copies run on a side stream into pinned buffers reused across steps, on CPU they
    are plain copies into separate CPU tensors (no pinning, no streams: what a CPU run cannot
    exercise). ``stats`` (DeepSpeed's) counts tensors and bytes of the last micro-step."""

    def __init__(self, layers: int, num_layers: int, cuda: bool):
        if not 0 < layers < num_layers:
            raise ValueError(f"offload {layers} of {num_layers} layers: give 1 .. {num_layers - 1}")
        # keep_last: the newest num_layers - layers inputs stay (the last layers', which the backward
        # needs first); no forward stash: every offloaded input leaves the GPU (the prefetch brings
        # it back ahead of its backward)
        super().__init__(use_pin_memory=cuda, use_streams=cuda, min_offload_bytes=0, max_fwd_stash_count=0,
                         max_cpu_buffer_pool_count=layers, keep_last_count=num_layers - layers)
        self.layers, self.cuda = layers, cuda
        self._prefetched: dict = {}

    def _should_skip(self, tensor: torch.Tensor) -> bool:
        if self.cuda:
            return super()._should_skip(tensor)
        return isinstance(tensor, torch.nn.Parameter) or (tensor.numel() > 1 and 0 in tensor.stride())

    def _unpack_tensor(self, maybe_ref):
        # consumed once (no cache): a restored layer's input is freed after its backward
        if hasattr(maybe_ref, "tensor_id"):
            return self._restore_tensor(maybe_ref.tensor_id, cache=False)
        return maybe_ref

    def _restore_tensor(self, tensor_id: int, cache: bool = False) -> torch.Tensor:
        ready = self._prefetched.pop(tensor_id, None)
        if ready is None:
            restored = super()._restore_tensor(tensor_id, cache=False)
        else:
            restored, host, key, event = ready
            if event is not None:
                self.compute_stream.wait_event(event)
                restored.record_stream(self.compute_stream)
                self._pending_cpu_buffers.append((key, host, event))
            else:
                self._pool_cpu_buffer(key, host)
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += self._num_bytes(restored)
        self._prefetch_before(tensor_id)
        return restored

    def _prefetch_before(self, tensor_id: int):
        """Starts bringing back the offloaded input the backward needs next: the newest one
        older than ``tensor_id`` (the backward walks the layers in reverse)."""
        older = [i for i in self._tracker if i < tensor_id and i not in self._prefetched]
        if not older:
            return
        newest = max(older)
        host, device, shape, stride, key = self._tracker.pop(newest)
        with self._stream_context(self.s1 if self.use_streams else None):
            restored = torch.empty_strided(shape, stride, dtype=host.dtype, device=device)
            restored.copy_(host, non_blocking=self.use_streams)
        event = self.s1.record_event() if self.use_streams else None
        self._prefetched[newest] = (restored, host, key, event)

    def reset(self):
        super().reset()
        self._prefetched.clear()

    def _sync_and_clear(self):
        super()._sync_and_clear()
        self._prefetched.clear()


# ----------------------------------------------------------------------------- the plan
@dataclass
class MemoryPlan:
    """What a run will hold where, decided before the engine starts (:func:`plan_memory`)."""

    settings: dict
    num_layers: int
    parameters: int
    tokens_per_rank: int
    tiled_mlp: bool
    mlp_chunk_tokens: int
    offload_layers: int
    offload_choice: str  # how offload_layers was chosen
    alloc_conf: str  # what PYTORCH_CUDA_ALLOC_CONF is, and who set it
    pinning: str  # how pinned blocks are sized (exact_pinning; "" on CPU)
    cuda: bool  # the ranks run on GPUs (else on the CPU: no GPU memory to speak of)
    host: dict = field(default_factory=dict)  # GiB: available, optimizer, checkpoints, process, reserve
    gpu: dict = field(default_factory=dict)  # GiB: analytic resident memory per rank
    gpu_total_gib: float | None = None  # the GPU's memory (None on CPU)
    transients: dict = field(default_factory=dict)  # GiB: analytic transients per rank
    # GiB: the peaks a run should measure, the GPU's per rank (resident + transients, no margin;
    # None on CPU) and the host's per node (optimizer + checkpoints + processes, no reserve)
    predicted: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """The run's first line: each memory setting and why."""
        mlp = (f"tiled MLP ({self.mlp_chunk_tokens}-token chunks)" if self.tiled_mlp else "MLP untiled")
        if self.offload_choice == CHECKPOINTING_OFF:
            offload = f"no activation checkpoints ({MTRAINING_KEY}.gradient_checkpointing false)"
        elif self.offload_layers:
            where = "pinned host memory" if self.cuda else "host memory (CPU: plain copies)"
            offload = (f"checkpoints of the first {self.offload_layers} of {self.num_layers} layers to {where} "
                       f"({self.offload_choice})")
        else:
            offload = f"checkpoints {'on the GPU' if self.cuda else 'in memory'} ({self.offload_choice})"
        host = self.host
        need = (f"host: optimizer {host['optimizer_gib']:.1f} + checkpoints {host['checkpoints_gib']:.1f} + processes "
                f"{host['process_gib']:.1f} + reserve {host['reserve_gib']:.1f} of {host['available_gib']:.1f} GiB "
                f"available ({host['source']})")
        pinning = f"; {self.pinning}" if self.pinning else ""
        return f"ds_mtraining: memory: {mlp}; {offload}; {need}; {self.alloc_conf}{pinning}"


def host_available_gib() -> tuple[float, str]:
    """(GiB, source): the env hook :data:`HOST_MEMORY_ENV` if set, else MemAvailable."""
    given = os.environ.get(HOST_MEMORY_ENV)
    if given:
        return float(given), f"{HOST_MEMORY_ENV}"
    import psutil
    return psutil.virtual_memory().available / GIB, "MemAvailable"


def host_reserve_gib(setting) -> float:
    """``host_reserve_gib``: as given, or for "auto" 6 GiB, at most a twentieth of the host's memory:
    what the plan leaves free beyond its prediction (the processes' own memory, HOST_PROCESS_GIB,
    is counted apart)."""
    if setting != "auto":
        return float(setting)
    import psutil
    return min(6.0, psutil.virtual_memory().total / GIB / 20)


def training_dtype_bytes(ds_config: dict) -> int:
    return 2 if any(ds_config.get(k, {}).get("enabled") for k in ("bf16", "fp16")) else 4


def optimizer_host_bytes_per_parameter(ds_config: dict) -> int:
    """Host bytes per parameter of DeepSpeed's ZeRO-1/2 CPU optimizer offload (0 without it):
    fp32 master weights (4), the optimizer's states (Adam: 8; SGD: 0, 4 with momentum), the fp32
    gradient partition (4), a pinned copy in the training dtype (2 or 4), and with gradient
    accumulation the accumulated fp32 gradients (4)."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("offload_optimizer", {}).get("device") != "cpu":
        return 0
    optimizer = ds_config.get("optimizer", {})
    kind = str(optimizer.get("type", "adamw")).lower()
    states = 8
    if kind == "sgd":
        states = 4 if optimizer.get("params", {}).get("momentum") else 0
    accumulation = 4 if ds_config.get("gradient_accumulation_steps", 1) > 1 else 0
    return 4 + states + 4 + training_dtype_bytes(ds_config) + accumulation


def pinned_bytes(size: int, exact: bool) -> int:
    """Bytes the CUDA caching host allocator takes for a pinned block of ``size``: the size with
    ``pinned_max_round_threshold_mb`` (``exact``), else the next power of two."""
    return size if exact or size <= 0 else 1 << (size - 1).bit_length()


def optimizer_host_bytes(ds_config: dict, parameters: int, world_size: int, exact: bool) -> int:
    """One rank's host bytes for DeepSpeed's ZeRO-1/2 CPU optimizer: its partition of
    :func:`optimizer_host_bytes_per_parameter`, with the three blocks DeepSpeed pins where
    ``offload_optimizer.pin_memory`` is on (fp32 master weights, fp32 gradients, the training-dtype
    copy) at their pinned sizes."""
    per_parameter = optimizer_host_bytes_per_parameter(ds_config)
    partition = -(-parameters // world_size)
    if not ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("pin_memory"):
        return per_parameter * partition
    pinned = (4, 4, training_dtype_bytes(ds_config))
    return (per_parameter - sum(pinned)) * partition + sum(pinned_bytes(b * partition, exact) for b in pinned)


# the estimate's margin: measured peaks were up to 4% above it (512K untiled: 135.6 against 130.2
# GiB), and the CUDA context, NCCL and the allocator's rounding take a little more
GPU_ESTIMATE_FACTOR, GPU_FIXED_GIB = 1.05, 4.0


def gpu_memory_gib() -> float:
    """The GPU's memory (device 0 of those visible; the nodes' GPUs are alike). Called after the
    allocator setting is in the environment: this starts CUDA in the process."""
    return torch.cuda.get_device_properties(0).total_memory / GIB


def gpu_peak_gib(gpu: dict, transients: dict) -> float:
    """The predicted GPU peak per rank: what stays resident plus every transient (at 768K, 1.4% above
    the peak measured)."""
    resident = sum(gpu[k] for k in ("weights_gib", "gradients_gib", "optimizer_gib", "checkpoints_gib"))
    return resident + sum(transients.values())


def gpu_need_gib(gpu: dict, transients: dict) -> float:
    """What the plan requires of the GPU: the predicted peak with its margin."""
    return gpu_peak_gib(gpu, transients) * GPU_ESTIMATE_FACTOR + GPU_FIXED_GIB


def plan_memory(run, ds_config: dict, world_size: int, cuda: bool | None = None,
                gpu_gib: float | None = None) -> MemoryPlan:
    """The memory settings of this run, before any process group: tiled MLP on or off, how many
    layers' checkpoints go to the host (``"auto"``: the fewest the GPU needs, ``gpu_gib`` or the
    device's memory), and the host check (HostMemoryError: one line with the numbers and the
    setting to change)."""
    from .model import count_parameters, model_config
    cuda = torch.cuda.is_available() if cuda is None else cuda
    settings: MemorySettings = run.memory
    config = model_config(run.model)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    parameters = count_parameters(config)
    micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
    tokens = micro * run.seq_len // run.sequence_parallel_size
    dtype_bytes = training_dtype_bytes(ds_config)
    layer_bytes = tokens * hidden * dtype_bytes  # one layer's checkpointed input per rank

    from ds_mtraining.distributed import local_world_size
    local = min(local_world_size() or world_size, world_size)
    pinning, exact, allocator_key = exact_pinning(cuda)
    alloc = alloc_conf_setting(settings.expandable_segments, cuda, allocator_key)
    # ZeRO partitions the optimizer over every rank holding a replica (data x sequence parallel)
    optimizer_gib = local * optimizer_host_bytes(ds_config, parameters, world_size, exact) / GIB
    process_gib = local * HOST_PROCESS_GIB["cuda" if cuda else "cpu"]
    reserve = host_reserve_gib(settings.host_reserve_gib)
    available, source = host_available_gib()
    per_layer_host_gib = local * pinned_bytes(layer_bytes, exact) / GIB
    room = available - optimizer_gib - process_gib - reserve
    fits = max(0, min(layers - 1, int(room // per_layer_host_gib) if per_layer_host_gib else layers - 1))

    def host_peak(offloaded: int) -> float:  # what the node's processes hold at most, the reserve aside
        return optimizer_gib + offloaded * per_layer_host_gib + process_gib

    def numbers(offloaded: int) -> str:
        rounded = "" if exact else ", pinned blocks at the next power of two"
        return (f"the CPU optimizer needs {optimizer_gib:.1f} GiB ({parameters / 1e9:.2f}B parameters x "
                f"{optimizer_host_bytes_per_parameter(ds_config)} bytes x {local}/{world_size} ranks on this node"
                f"{rounded}), {offloaded} offloaded layer checkpoints {offloaded * per_layer_host_gib:.1f} GiB, the "
                f"processes {process_gib:.1f} GiB, reserve {reserve:.1f} GiB ({SECTION}.host_reserve_gib): "
                f"{host_peak(offloaded) + reserve:.1f} GiB > {available:.1f} GiB available ({source})")

    if room < 0:
        raise HostMemoryError(
            f"host memory: {numbers(0)}; use a host with more memory or more nodes (ZeRO partitions the "
            f"optimizer over all ranks), fewer parameters, or lower {SECTION}.host_reserve_gib")
    offload = settings.offload_checkpoints
    if not run.gradient_checkpointing or offload in ("none", 0):
        count, choice = 0, "none" if run.gradient_checkpointing else CHECKPOINTING_OFF
    elif offload == "auto":
        count, choice = 0, "auto: off without CUDA"
    else:
        count = layers - 1 if offload == "all" else min(offload, layers - 1)
        choice = f"offload_checkpoints={offload!r}" + (" (the last layer's stays: the backward needs it first)"
                                   if offload == "all" or offload >= layers else "")
        if count > fits:
            raise HostMemoryError(
                f"host memory: {numbers(count)}; set {SECTION}.offload_checkpoints to at most {fits} (or 'auto'), "
                f"or free host memory")

    tiled = settings.tiled_mlp if isinstance(settings.tiled_mlp, bool) else tokens >= 2 * settings.mlp_chunk_tokens
    plan = MemoryPlan(settings=settings.to_dict(), num_layers=layers, parameters=parameters, tokens_per_rank=tokens,
                      tiled_mlp=tiled, mlp_chunk_tokens=settings.mlp_chunk_tokens, offload_layers=count,
                      offload_choice=choice, alloc_conf=alloc, pinning=pinning, cuda=cuda)

    def estimate(offloaded: int) -> tuple[dict, dict]:
        plan.offload_layers = offloaded
        return gpu_breakdown(config, ds_config, plan, dtype_bytes, run, world_size)

    if cuda and gpu_gib is None and torch.cuda.is_available():
        gpu_gib = gpu_memory_gib()
    plan.gpu_total_gib = gpu_gib if cuda else None
    if offload == "auto" and cuda and run.gradient_checkpointing:
        gpu_gib = gpu_memory_gib() if gpu_gib is None else gpu_gib
        needed = next((n for n in range(layers) if gpu_need_gib(*estimate(n)) <= gpu_gib), None)
        if needed is None:
            raise MemoryPlanError(
                f"GPU memory: at {tokens} tokens per rank the GPU estimate is {gpu_need_gib(*estimate(layers - 1)):.1f} "
                f"> {gpu_gib:.1f} GiB even with the checkpoints of {layers - 1} of {layers} layers offloaded; use a "
                f"shorter seq_len or more ranks (sequence parallel)")
        if needed > fits:  # predicted here, not found by the OOM killer or the allocator minutes later
            raise HostMemoryError(
                f"host memory: at {tokens} tokens per rank the GPU needs the checkpoints of {needed} layers "
                f"offloaded (with {fits}, the host's most, its estimate is {gpu_need_gib(*estimate(fits)):.1f} > "
                f"{gpu_gib:.1f} GiB), and {numbers(needed)}; use a shorter seq_len, more ranks, a host with more "
                f"memory or a lower {SECTION}.host_reserve_gib, or set {SECTION}.offload_checkpoints to {fits} to "
                f"try anyway")
        count = needed
        choice = (f"auto: the GPU estimate {gpu_need_gib(*estimate(needed)):.1f} of {gpu_gib:.1f} GiB"
                  + (f"; the host holds {fits}" if needed else ""))
    plan.offload_choice = choice
    plan.gpu, plan.transients = estimate(count)
    plan.host = {"available_gib": available, "source": source, "optimizer_gib": optimizer_gib,
                 "checkpoints_gib": count * per_layer_host_gib, "process_gib": process_gib, "reserve_gib": reserve,
                 "ranks_on_node": local, "pinned_exact": exact}
    plan.predicted = {"gpu_peak_gib": gpu_peak_gib(plan.gpu, plan.transients) if cuda else None,
                      "host_peak_gib": host_peak(count)}
    return plan


def gpu_breakdown(config, ds_config: dict, plan: MemoryPlan, dtype_bytes: int, run,
                  world_size: int) -> tuple[dict, dict]:
    """Analytic GiB per rank: what stays resident (weights, gradient buckets, optimizer, the
    checkpoints on the GPU) and the transients of one layer and of the loss; the measured peak
    less the resident part is the transient a run actually saw."""
    zero = ds_config.get("zero_optimization", {})
    p = plan.parameters
    weights = p * dtype_bytes
    if zero.get("stage", 0) >= 1 and zero.get("offload_optimizer", {}).get("device") == "cpu":
        bucket = int(float(zero.get("reduce_bucket_size", 5e8)))
        gradients = bucket * dtype_bytes * (2 if zero.get("overlap_comm") else 1)
        optimizer = 0
    else:  # fp32 master weights and Adam's states partitioned over the ranks (ZeRO-1/2)
        gradients = p * dtype_bytes
        optimizer = p * 12 // (world_size if zero.get("stage", 0) >= 1 else 1)
    from ..hf import config_head_dim
    s, hidden = plan.tokens_per_rank, config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config_head_dim(config)
    layer = s * hidden * dtype_bytes
    on_gpu = plan.num_layers - plan.offload_layers if run.gradient_checkpointing else plan.num_layers
    mlp_tokens = min(s, plan.mlp_chunk_tokens) if plan.tiled_mlp else s
    transients = {
        "mlp_intermediates": 3 * mlp_tokens * config.intermediate_size * dtype_bytes,
        "attention_qkvo": s * (2 * heads + 2 * kv) * head_dim * dtype_bytes,
        "attention_fp32_out_lse": s * heads * (head_dim + 1) * 4,
        "norm_fp32_upcast": s * hidden * 4,
        "loss_chunk_logits_fp32": 3 * run.loss_chunk_tokens * config.vocab_size * 4,
    }
    gpu = {"weights_gib": weights / GIB, "gradients_gib": gradients / GIB, "optimizer_gib": optimizer / GIB,
           "checkpoints_gib": (on_gpu + (1 if plan.offload_layers else 0)) * layer / GIB,
           "checkpoint_layer_gib": layer / GIB, "checkpoint_layers_on_gpu": on_gpu}
    return gpu, {name: value / GIB for name, value in transients.items()}


def alloc_conf_setting(expandable: bool, cuda: bool, exact_pinned: bool) -> str:
    """Sets ``PYTORCH_CUDA_ALLOC_CONF`` (before CUDA starts) unless the user has: expandable
    segments where asked, ``pinned_max_round_threshold_mb`` where :func:`exact_pinning` chose it;
    says what it is."""
    given = users_setting(ALLOC_CONF)
    if given is not None:
        return f"{ALLOC_CONF}={given} (yours)"
    if not cuda:
        return CPU_ONLY
    entries = ([EXPANDABLE] if expandable else []) + ([PINNED_EXACT] if exact_pinned else [])
    if not entries:
        set_by_plan(ALLOC_CONF, None)
        return f"{ALLOC_CONF} unset ({SECTION}.expandable_segments false)"
    set_by_plan(ALLOC_CONF, ",".join(entries))
    return f"{ALLOC_CONF}={os.environ[ALLOC_CONF]} (set by ds_mtraining; set the variable to choose another)"


def users_setting(name: str) -> str | None:
    """The environment's ``name``, unless unset or a plan in this process set it (:func:`set_by_plan`)."""
    value = os.environ.get(name)
    return None if value is None or SET_BY_PLAN.get(name) == value else value


def set_by_plan(name: str, value: str | None):
    """Sets (None: unsets) an allocator setting of the user's process, remembered as the plan's."""
    if value is None:
        os.environ.pop(name, None)
        SET_BY_PLAN.pop(name, None)
    else:
        os.environ[name] = SET_BY_PLAN[name] = value


def exact_pinning(cuda: bool) -> tuple[str, bool, bool]:
    """How pinned blocks get their size (before CUDA starts): the user's choice where made
    (``pinned_max_round_threshold_mb`` in ``PYTORCH_CUDA_ALLOC_CONF``, or ``DS_PIN_MEMORY_BACKEND``);
    else torch's allocator setting where torch has it; else DeepSpeed's native pinning (set here)
    where the process may lock the memory. Returns (what was chosen, whether pinned blocks are at
    their size, whether the allocator setting is to carry ``pinned_max_round_threshold_mb``)."""
    if not cuda:
        return "", True, False
    given, backend = users_setting(ALLOC_CONF), users_setting(PIN_BACKEND)
    given_key = given is not None and PINNED_ROUND_KEY in given
    if backend is not None or given_key:
        exact = backend == "native" or given_key
        return f"pinned blocks {'at their size' if exact else 'at powers of two'} (yours)", exact, False
    set_by_plan(PIN_BACKEND, None)  # an earlier plan's choice in this process: chosen again below
    if exact_pinned_supported():
        if given is not None:  # the user's allocator setting, without the key
            return f"pinned blocks at powers of two (add {PINNED_EXACT} to your {ALLOC_CONF})", False, False
        return f"pinned blocks at their size ({PINNED_EXACT})", True, True
    if can_lock_memory() and native_pinning_builds():
        set_by_plan(PIN_BACKEND, "native")
        return f"pinned blocks at their size ({PIN_BACKEND}=native, DeepSpeed's, set by ds_mtraining)", True, False
    return "pinned blocks at powers of two (this torch rounds them, and no memory can be locked)", False, False


def exact_pinned_supported() -> bool:
    """Whether this torch's CUDA host allocator takes ``pinned_max_round_threshold_mb`` (2.13
    does; 2.11 refuses the key at CUDA's start). On an H100 machine with torch 2.11, 5 GiB + 1 MiB
    pinned took 8.00 GiB of resident memory through torch's allocator and 5.00 GiB through
    DeepSpeed's native pinning (copies to the GPU at 51 GiB/s)."""
    version = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return bool(version) and (int(version.group(1)), int(version.group(2))) >= (2, 13)


def native_pinning_builds() -> bool:
    """Whether DeepSpeed's pin_memory op (the native pinning's) can be built here."""
    try:
        from deepspeed.ops.op_builder import PinMemoryBuilder
    except ImportError:
        return False
    return PinMemoryBuilder().is_compatible(verbose=False)


def can_lock_memory() -> bool:
    """Whether this process may mlock any amount: RLIMIT_MEMLOCK unlimited, or CAP_IPC_LOCK."""
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY:
        return True
    try:
        with open("/proc/self/status") as status:
            effective = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(effective >> 14 & 1)  # CAP_IPC_LOCK


# ----------------------------------------------------------------------------- measured, and the OOM line
def host_memory_now() -> dict:
    """This process's resident and peak resident host memory (GiB)."""
    import psutil
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"host_rss_gib": psutil.Process().memory_info().rss / GIB, "host_peak_rss_gib": peak_kib * 1024 / GIB}


def out_of_memory_line(error: BaseException, run, plan: MemoryPlan | None, step: int) -> str:
    """One line for a CUDA out-of-memory error: the length, the peak, and the setting to try."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    tried = re.search(r"Tried to allocate [0-9.]+ [KMGT]?i?B", first)
    tried = tried.group(0) if tried else first[:120]
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / GIB
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
        where = f"peak {peak:.1f} GiB allocated of {total:.1f} GiB"
    else:
        where = "no CUDA peak to report"
    tokens = run.seq_len // run.sequence_parallel_size
    if plan is not None and run.gradient_checkpointing and plan.offload_layers < plan.num_layers - 1:
        fix = (f"set {SECTION}.offload_checkpoints above {plan.offload_layers} (of {plan.num_layers}; 'all' if the "
               f"host holds them)")
    elif plan is not None and not plan.tiled_mlp:
        fix = f"set {SECTION}.tiled_mlp to true"
    elif not run.gradient_checkpointing:
        fix = f"set {MTRAINING_KEY}.gradient_checkpointing to true"
    else:
        fix = (f"lower {MTRAINING_KEY}.seq_len or raise {MTRAINING_KEY}.sequence_parallel_size (more GPUs); "
               f"{SECTION}.mlp_chunk_tokens lower than {run.memory.mlp_chunk_tokens} trims the MLP's part")
    return (f"CUDA out of memory at step {step} with seq_len {run.seq_len} ({tokens} tokens per GPU): {where} "
            f"({tried}); {fix}")
