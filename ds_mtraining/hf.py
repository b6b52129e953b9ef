"""MTraining attention for Hugging Face transformers models (Qwen2/Qwen2.5, Llama, ...).

Registers an attention function named ``"mtraining"`` with transformers' ``AttentionInterface``
(no modeling code is copied): the model computes q/k/v and applies RoPE itself, from the
**global** position ids of its striped tokens, then calls :func:`mtraining_attention_forward`
with q [B, H, S/W, D] and k/v [B, Hkv, S/W, D] (GQA: key/value heads are not repeated).

    model = AutoModelForCausalLM.from_config(config)              # or from a local directory
    use_mtraining_attention(model, MTrainingAttentionSettings(sparse, group))
    out = model.model(input_ids=ids_r, position_ids=positions_r)  # this rank's striped shard

Each attention module keeps an :class:`~ds_mtraining.layer.IndexCache`: under activation
checkpointing (``model.gradient_checkpointing_enable()``, reentrant or not) the recomputed
forward reuses the index its forward estimated, so each layer estimates once per step; with the
settings' ``keep_output`` it reuses the forward's output too, so each layer runs attention once.

The baseline, :func:`use_ulysses_attention`, is what users run today: the model's own dense
attention under DeepSpeed-Ulysses (``deepspeed.runtime.sequence_parallel.ulysses_sp``), on
contiguous shards (:class:`ds_mtraining.layout.ContiguousLayout`): transformers' ``"sdpa"``, or with
the dense backend ``"fa4"`` FlashAttention-4, registered here as ``"ds_mtraining_fa4"``
(:func:`fa4_attention_forward`).
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel

from .attention import resolve_softmax_scale
from .dense_backend import dense_causal_attention
from .layer import IndexCache, MTrainingAttentionSettings, striped_sparse_attention

ATTENTION_NAME = "mtraining"
SETTINGS_ATTRIBUTE = "mtraining_settings"
INDEX_CACHE_ATTRIBUTE = "mtraining_index_cache"  # the module's IndexCache (one estimation per step)


def mtraining_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask, scaling: float | None = None,
                                dropout: float = 0.0, sliding_window=None, position_ids=None,
                                doc_start=None, **kwargs):
    """transformers attention function: (out [B, S/W, H, D], None). ``doc_start`` (document
    masking, :mod:`ds_mtraining.documents`) arrives as a keyword of the model's forward."""
    settings = getattr(module, SETTINGS_ATTRIBUTE, None)
    if settings is None:
        raise RuntimeError(f"{type(module).__name__} runs attention '{ATTENTION_NAME}' but has no "
                           f"settings; enable it with ds_mtraining.hf.use_mtraining_attention(model, settings)")
    if attention_mask is not None:
        raise ValueError("MTraining attention takes no attention mask: pack documents instead of padding "
                         "them, and pass doc_start (ds_mtraining.documents) to mask across documents")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported; set the model config's "
                         f"attention_dropout to 0")
    if sliding_window is not None:
        raise ValueError(f"sliding-window attention (window {sliding_window}) is not supported; "
                         f"set the model config's use_sliding_window to false")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    cache = getattr(module, INDEX_CACHE_ATTRIBUTE, None)
    if cache is None:
        cache = IndexCache()
        setattr(module, INDEX_CACHE_ATTRIBUTE, cache)
    out = striped_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), settings,
                                   softmax_scale=scaling, position_ids=position_ids, cache=cache,
                                   doc_start=doc_start)
    return out, None


AttentionInterface.register(ATTENTION_NAME, mtraining_attention_forward)


def check_model_config(config, key: str = "mtraining.model") -> None:
    """Raises ValueError naming the model config field when MTraining attention cannot run it."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads != 0:
        raise ValueError(
            f"{key}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads} "
            f"(GQA needs whole groups of query heads per key/value head); choose num_key_value_heads "
            f"among {[d for d in range(1, heads + 1) if heads % d == 0]}")
    if getattr(config, "head_dim", None) is None and config.hidden_size % heads != 0:
        raise ValueError(f"{key}: hidden_size={config.hidden_size} is not divisible by "
                         f"num_attention_heads={heads}; choose a divisor or set head_dim")
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{key}: use_sliding_window=true is not supported by MTraining attention; "
                         f"set it to false")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"{key}: attention_dropout={config.attention_dropout} is not supported; set it to 0")


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of a transformers decoder (those that call the interface)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def use_mtraining_attention(model: PreTrainedModel, settings: MTrainingAttentionSettings) -> PreTrainedModel:
    """Switches ``model`` to MTraining attention with ``settings`` (in place; returns it)."""
    check_model_config(model.config)
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no transformers self-attention modules "
                         f"(classes named *Attention with a layer_idx); MTraining cannot hook it")
    for module in modules:
        setattr(module, SETTINGS_ATTRIBUTE, settings)
    model.set_attn_implementation(ATTENTION_NAME)
    return model


# ----------------------------------------------------------------------------- the Ulysses baseline
FA4_ATTENTION_NAME = "ds_mtraining_fa4"
# the transformers attention of each dense backend: torch SDPA (its own dispatch: cuDNN's kernel on
# an H200, math/efficient on CPUs), or FlashAttention-4
CORE_ATTENTION = {"sdpa": "sdpa", "fa4": FA4_ATTENTION_NAME}


def fa4_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function: causal FlashAttention-4 of q [B, H, S, D] over k/v
    [B, Hkv, S, D] (what DeepSpeed-Ulysses calls after its all-to-all with the dense backend
    ``"fa4"``); (out [B, S, H, D], None)."""
    if attention_mask is not None:
        raise ValueError("FlashAttention-4 attention here is causal and takes no attention mask: pack documents "
                         "instead of padding them")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported; set the model config's attention_dropout to 0")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"sliding-window attention (window {kwargs['sliding_window']}) is not supported; set the "
                         f"model config's use_sliding_window to false")
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"{type(module).__name__} is not causal; FlashAttention-4 attention here is causal only")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return dense_causal_attention(q, k, v, resolve_softmax_scale(q.shape[-1], scaling), "fa4"), None


AttentionInterface.register(FA4_ATTENTION_NAME, fa4_attention_forward)


def remove_ulysses_attention():
    """Undoes :func:`use_ulysses_attention` in this process: DeepSpeed's wrapper leaves
    transformers' core attentions and DeepSpeed's sequence-parallel groups are released, so
    that it may be called again (a second call would otherwise wrap the wrapper)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as ulysses_groups
    for core in CORE_ATTENTION.values():
        try:
            del ALL_ATTENTION_FUNCTIONS[core]  # the local override only; the library's own stays
        except KeyError:
            pass
    release = getattr(ulysses_groups, "_release_sequence_parallel_groups", None)
    if release is not None:
        release()


def use_ulysses_attention(model: PreTrainedModel, sequence_ranks: list, micro_batch_size: int,
                          seq_len: int, dense_backend: str = "sdpa") -> PreTrainedModel:
    """Switches ``model`` to dense attention under DeepSpeed-Ulysses over the sequence-parallel
    group of ``sequence_ranks`` (W = its size; W = 1: plain dense attention), for micro-batches of
    ``micro_batch_size`` sequences of ``seq_len`` tokens cut into contiguous shards with global
    position ids; the kernel is the resolved ``dense_backend`` (``"sdpa"``: transformers' SDPA
    attention; ``"fa4"``: :func:`fa4_attention_forward`). DeepSpeed's
    ``UlyssesSPAttentionHF.register_with_transformers`` does the work (an all-to-all from sequence
    to head shards before the attention and one back after); its groups are checked to be
    ``sequence_ranks`` (the ranks that sum each other's gradients and losses in this project's
    ``mpu``). In place; returns the model."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    world = len(sequence_ranks)
    core = CORE_ATTENTION[dense_backend]
    remove_ulysses_attention()
    model.set_attn_implementation(core)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation=core, sequence_parallel_size=world,
        micro_batch_size=micro_batch_size, seq_length=seq_len, seq_length_is_variable=False)
    if mpu is not None:
        ranks = dist.get_process_group_ranks(mpu.get_sequence_parallel_group())
        if ranks != list(sequence_ranks):
            raise RuntimeError(f"DeepSpeed-Ulysses grouped ranks {ranks}, but this run's sequence-parallel "
                               f"group is {list(sequence_ranks)}; both must be the same consecutive ranks")
    return model
