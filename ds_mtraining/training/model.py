"""The model a run trains: a transformers causal LM from a preset or a local directory, wrapped
so that its forward returns the sequence-parallel loss."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from . import MTRAINING_KEY, ConfigError

PRESETS = {
    # the Qwen2 shape at toy size: GQA 2:1, RoPE theta 1e6, untied head; byte vocabulary
    "tiny-qwen2": {"model_type": "qwen2", "vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                   "rope_theta": 1e6, "max_position_embeddings": 1 << 20, "tie_word_embeddings": False},
    # the same at head_dim 64, the smallest the CUDA kernels take unpadded: the examples, the GPU demo
    "small-qwen2": {"model_type": "qwen2", "vocab_size": 257, "hidden_size": 256, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
                    "rope_theta": 1e6, "max_position_embeddings": 1 << 20, "tie_word_embeddings": False},
    # real shapes, random init (benchmarks: ds_mtraining.bench.e2e); no weights, nothing downloaded
    "qwen2.5-3b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "intermediate_size": 11008,
                   "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 1 << 20,
                   "tie_word_embeddings": True},
    # Llama-3.1-8B's shape (plain RoPE at its theta; its llama3 frequency scaling costs the same)
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                     "rms_norm_eps": 1e-5, "rope_theta": 5e5, "max_position_embeddings": 1 << 20,
                     "tie_word_embeddings": False},
}


# what continued training may change in a pretrained model's config (the context length and
# RoPE); the weights' shapes stay those of the checkpoint
CONTEXT_OVERRIDES = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")


def has_weights(name_or_path: str) -> bool:
    path = Path(name_or_path)
    return path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")))


def model_config(spec: dict):
    """The transformers config of a model spec (preset or local directory) with its overrides:
    a pretrained directory accepts :data:`CONTEXT_OVERRIDES` only, a preset or config-only
    directory (random init) any field of its config."""
    from transformers import AutoConfig, CONFIG_MAPPING
    name = spec["name_or_path"]
    if name in PRESETS:
        values = dict(PRESETS[name])
        config = CONFIG_MAPPING[values.pop("model_type")](**values)
    else:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    overrides = dict(spec["config_overrides"])
    key = f"{MTRAINING_KEY}.model.config_overrides"
    pretrained = has_weights(name)
    for field in overrides:
        if pretrained and field not in CONTEXT_OVERRIDES:
            raise ConfigError(f"{key}.{field}: a pretrained model ({name}) accepts overrides of "
                              f"{list(CONTEXT_OVERRIDES)} only (its weights fix the rest); remove {field!r}")
        if field not in CONTEXT_OVERRIDES and not hasattr(config, field):
            raise ConfigError(f"{key}.{field}: {type(config).__name__} has no such field; "
                              f"use one of {list(CONTEXT_OVERRIDES)} or a field of the model's config")
    return _with_overrides(config, overrides, key)


def _with_overrides(config, overrides: dict, key: str):
    rope = {name: overrides.pop(name) for name in ("rope_theta", "rope_scaling", "rope_parameters")
            if name in overrides}
    for field, value in overrides.items():
        setattr(config, field, value)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and getattr(config, "layer_types", None):
        # the config derives one entry of layer_types per layer when it is built: derive it again
        values = config.to_dict()
        values.pop("layer_types")
        config = type(config).from_dict(values)
    if not rope:
        return config
    # transformers 5 keeps theta and scaling together in ``rope_parameters``: rebuild the config so
    # that its own standardization and validation run on the new values
    parameters = dict(rope.get("rope_parameters") or config.rope_parameters or {})
    theta = rope.get("rope_theta", parameters.get("rope_theta"))
    if "rope_scaling" in rope:
        scaling = dict(rope["rope_scaling"] or {"rope_type": "default"})
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        parameters = scaling
    if theta is not None:
        parameters["rope_theta"] = theta
    values = config.to_dict()
    values["rope_parameters"] = parameters
    try:
        return type(config).from_dict(values)
    except (ValueError, KeyError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise ConfigError(f"{key}: invalid RoPE settings {parameters}: {first}") from None


class MTrainingCausalLM(torch.nn.Module):
    """A transformers causal LM whose loss is the sequence-parallel cross-entropy:
    ``forward(input_ids, labels, position_ids[, doc_start])`` on this rank's striped shard returns
    the loss; ``doc_start`` (document masking, :mod:`ds_mtraining.documents`) reaches the attention
    function through the model's keyword arguments. ``fused_loss``: liger-kernel's fused linear
    cross-entropy for this rank's sum (CUDA; what :func:`use_fused_kernels` turns on), else the
    chunked torch loss of ``loss_chunk_tokens`` rows at a time."""

    def __init__(self, model, group, loss_chunk_tokens: int, fused_loss: bool = False):
        super().__init__()
        self.model = model
        self.group = group
        self.loss_chunk_tokens = loss_chunk_tokens
        self.fused_loss = fused_loss

    def forward(self, input_ids, labels, position_ids, doc_start=None):
        from ds_mtraining.hf import output_head_inputs
        from ds_mtraining.loss import sequence_parallel_cross_entropy
        documents = {} if doc_start is None else {"doc_start": doc_start}
        # no KV cache: training never reads it, and filling it copies every layer's keys and values
        # (and holds the copies to the end of the forward) unless activation checkpointing is on
        hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                       **documents).last_hidden_state
        hidden, weight, softcap = output_head_inputs(self.model, hidden)
        return sequence_parallel_cross_entropy(hidden, weight, labels, self.group, self.loss_chunk_tokens,
                                               self.fused_loss, softcap)


def build_model(spec: dict, init_device=None):
    """A transformers causal LM: a preset or config-only directory is built from its config
    (random init, seeded by the caller, on ``init_device``: :func:`random_init_device`; default the
    CPU); a directory with weights is loaded (local files only, on the CPU)."""
    from transformers import AutoModelForCausalLM
    config = model_config(spec)
    if has_weights(spec["name_or_path"]):
        return AutoModelForCausalLM.from_pretrained(spec["name_or_path"], config=config, local_files_only=True,
                                                    dtype=torch.float32)
    with torch.device(init_device or "cpu"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def count_parameters(config) -> int:
    """The model's parameter count, from a model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def random_init_device(spec: dict, device) -> torch.device | None:
    """Where :func:`build_model` initialises a model with random weights: ``device`` when it is a
    CUDA device with room for the fp32 weights four times over, else None (the CPU). torch draws
    random numbers on the CPU serially: for the 3B preset that is about a minute of every launch,
    on the GPU milliseconds. (The weights then differ from a CPU build's, as any two devices' draws
    do; the same seed on the same kind of device gives the same model.)"""
    device = torch.device(device)
    if device.type != "cuda" or has_weights(spec["name_or_path"]):
        return None
    weights = 4 * count_parameters(model_config(spec))
    return device if 4 * weights <= torch.cuda.get_device_properties(device).total_memory else None


# ----------------------------------------------------------------------------- fused kernels
_LIGER_PATCHES = {"qwen2": "apply_liger_kernel_to_qwen2", "llama": "apply_liger_kernel_to_llama"}


def check_liger_setting(value) -> None:
    if not (isinstance(value, bool) or value == "auto"):
        raise ConfigError(f"{MTRAINING_KEY}.liger={value!r} must be 'auto' (on GPUs with liger-kernel), "
                          f"true or false")


def use_fused_kernels(model, setting="auto") -> str | None:
    """liger-kernel's fused RMSNorm, RoPE and SwiGLU in place of the HF model's eager ones
    (``mtraining.liger``), applied to this model instance. Where they are applied, training also
    takes liger's fused linear cross-entropy for each rank's loss sum (``MTrainingCausalLM``'s
    ``fused_loss``; the sequence-parallel mean around it stays :mod:`ds_mtraining.loss`'s).
    Liger's RoPE works in the [B, S, H, D] layout the attention takes, so no copy comes between.

    ``setting``: ``"auto"`` (on where CUDA and liger-kernel are available, else off with the
    reason), ``True`` (raises ConfigError where it cannot run) or ``False``. Returns why it is
    off (None: applied)."""
    check_liger_setting(setting)
    if setting is False:
        return "mtraining.liger is false"
    reason = None
    patch = _LIGER_PATCHES.get(model.config.model_type)
    if patch is None:
        reason = f"liger-kernel is applied to {sorted(_LIGER_PATCHES)} models, not {model.config.model_type!r}"
    elif not torch.cuda.is_available():
        reason = "liger-kernel's Triton kernels need a CUDA GPU"
    else:
        try:
            import liger_kernel.transformers as liger
        except ImportError as error:
            reason = f"liger-kernel is not importable ({error}); pip install liger-kernel"
    if reason is not None:
        if setting is True:
            raise ConfigError(f"{MTRAINING_KEY}.liger=true: {reason}; set it to 'auto' or false")
        return reason
    # liger's optional backends (CuTe DSL, Ascend) log a warning per op and rank when they cannot
    # be imported; its Triton kernels, the ones used here, are unaffected
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    getattr(liger, patch)(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                          fused_linear_cross_entropy=False, model=model)
    return None
