"""MTraining attention for Hugging Face transformers models (Qwen2/Qwen2.5, Llama, ...).

Registers an attention function named ``"mtraining"`` with transformers' ``AttentionInterface``
(no modeling code is copied): the model computes q/k/v and applies RoPE itself, from the
**global** position ids of its striped tokens, then calls :func:`mtraining_attention_forward`
with q [B, H, S/W, D] and k/v [B, Hkv, S/W, D] (GQA: key/value heads are not repeated).

    model = AutoModelForCausalLM.from_config(config)              # or from a local directory
    use_mtraining_attention(model, MTrainingAttentionSettings(sparse, group))
    out = model.model(input_ids=ids_r, position_ids=positions_r)  # this rank's striped shard

Each attention module keeps an :class:`~ds_mtraining.layer.IndexCache`: under activation
checkpointing (reentrant or not: ``ds_mtraining.training.memory.enable_checkpointing``) the recomputed
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

from .attention import kernel_head_dim, op_softcap, resolve_softmax_scale
from .dense_backend import dense_causal_attention
from .layer import IndexCache, MTrainingAttentionSettings, striped_sparse_attention

ATTENTION_NAME = "mtraining"
SETTINGS_ATTRIBUTE = "mtraining_settings"
INDEX_CACHE_ATTRIBUTE = "mtraining_index_cache"  # the module's IndexCache (one estimation per step)


# Every keyword transformers passes to an attention function, and what MTraining does with it
# (tests/test_hf_keywords.py walks the installed transformers' model sources against these).
# Honoured: applied as the model means it (the function's own parameters).
HONOURED_KEYWORDS = ("scaling", "dropout", "sliding_window", "position_ids", "is_causal", "s_aux", "softcap",
                     "doc_start")
# Carried along by the model's forward with no bearing on attention's result.
INERT_KEYWORDS = ("use_cache", "output_hidden_states", "output_router_logits", "num_items_in_batch",
                  "deterministic", "max_length_q", "max_length_k")
# Refused when set (not None or False): each names the feature and what to do instead.
REFUSED_KEYWORDS = {
    "sinks": "attention sinks passed as sinks= (MTraining takes gpt-oss's s_aux: one logit per query head, "
             "unscaled) are not known to mean the same",
    "position_bias": "an additive position bias (T5-style) is not supported by MTraining's kernels",
    "indices": "a learned sparse-attention index (DeepSeek-style) cannot be combined with MTraining's own",
    "block_indices": "a learned sparse-attention index cannot be combined with MTraining's own",
    "cu_seq_lens_q": "packed documents reached the attention unstriped; wrap the loader with mt.loader(...) "
                     "(it turns them into doc_start)",
    "cu_seq_lens_k": "packed documents reached the attention unstriped; wrap the loader with mt.loader(...)",
    "seq_idx": "packed documents reached the attention unstriped; wrap the loader with mt.loader(...)",
    "output_attentions": "attention weights are never materialised; run without output_attentions",
    "query": "query/key/value passed by name: not a decoder's self-attention",
    "key": "query/key/value passed by name: not a decoder's self-attention",
    "value": "query/key/value passed by name: not a decoder's self-attention",
}


def refuse_keywords(module: torch.nn.Module, keywords: dict) -> None:
    """One ValueError line for the first keyword that is set and neither honoured nor inert."""
    for name, value in keywords.items():
        if name in INERT_KEYWORDS or value is None or value is False:
            continue
        reason = REFUSED_KEYWORDS.get(name, "MTraining attention does not know this keyword, so it cannot "
                                            "apply it; train this model with another attention")
        raise ValueError(f"{type(module).__name__} passes {name}={_shown(value)} to its attention: {reason}")


def _shown(value) -> str:
    return f"<tensor {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)


def mtraining_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask, scaling: float | None = None,
                                dropout: float = 0.0, sliding_window: int | None = None, position_ids=None,
                                is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                                softcap: float | None = None, doc_start=None, **kwargs):
    """transformers attention function: (out [B, S/W, H, D], None). ``doc_start`` (document
    masking, :mod:`ds_mtraining.documents`) arrives as a keyword of the model's forward; a layer's
    ``sliding_window`` runs its band exactly (:mod:`ds_mtraining.window`), ``s_aux`` (gpt-oss's
    attention sinks) joins each row's softmax (:mod:`ds_mtraining.sinks`), ``softcap`` (Gemma-2's
    logit soft-capping) caps the logits in the kernels; any other keyword is
    honoured or refused (:data:`REFUSED_KEYWORDS`), never dropped."""
    settings = getattr(module, SETTINGS_ATTRIBUTE, None)
    if settings is None:
        raise RuntimeError(f"{type(module).__name__} runs attention '{ATTENTION_NAME}' but has no "
                           f"settings; enable it with ds_mtraining.hf.use_mtraining_attention(model, settings)")
    refuse_keywords(module, kwargs)
    if attention_mask is not None:
        raise ValueError("MTraining attention takes no attention mask: pack documents instead of padding "
                         "them, and pass doc_start (ds_mtraining.documents) to mask across documents")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported; set the model config's "
                         f"attention_dropout to 0")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"{type(module).__name__} is not causal; MTraining attention is causal only")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    cache = getattr(module, INDEX_CACHE_ATTRIBUTE, None)
    if cache is None:
        cache = IndexCache()
        setattr(module, INDEX_CACHE_ATTRIBUTE, cache)
    out = striped_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), settings,
                                   softmax_scale=scaling, position_ids=position_ids, cache=cache,
                                   doc_start=doc_start, window=sliding_window, sinks=s_aux, softcap=softcap)
    return out, None


AttentionInterface.register(ATTENTION_NAME, mtraining_attention_forward)


def config_head_dim(config) -> int:
    """The attention head size of a transformers config (its head_dim, or hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_model_config(config, key: str = "mtraining.model", device_type: str | None = None) -> None:
    """Raises ValueError, one line naming the model config field, when MTraining cannot train
    the model ``config`` describes exactly: its attention or its LM head has a feature that
    MTraining's attention or loss would otherwise drop. ``device_type`` ``"cuda"`` also checks
    the head_dim against the CUDA kernels' (:func:`ds_mtraining.attention.kernel_head_dim`)."""
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
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):  # honoured: the kernels and the loss cap
        try:
            op_softcap(getattr(config, field, None))
        except ValueError:
            raise ValueError(f"{key}: {field}={getattr(config, field)!r} must be a positive number (the cap) or "
                             f"null (no soft-capping)") from None
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"{key}: attention_dropout={config.attention_dropout} is not supported; set it to 0")
    if getattr(config, "is_causal", True) is False:
        raise ValueError(f"{key}: is_causal=false; MTraining attention is causal only")
    try:
        kernel_head_dim(config_head_dim(config), device_type or "cpu")
    except ValueError as error:
        raise ValueError(f"{key}: {error}") from None


def training_device_type() -> str:
    """The device type this process trains on: DeepSpeed's accelerator's (``"cuda"``, ``"cpu"``)."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name()


def check_attention_modules(modules: list) -> None:
    """One ValueError line for an attention module with a feature its config does not show."""
    for module in modules:
        if getattr(module, "is_causal", True) is False:
            raise ValueError(f"{type(module).__name__}.is_causal is False; MTraining attention is causal only")


def output_head_inputs(model: PreTrainedModel, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(hidden states, LM head weight, softcap) that give the model's own logits, for the losses
    that compute ``hidden @ weight.T`` chunk by chunk: the hidden states take the factor the
    model puts on its logits (Granite divides them by ``logits_scaling``, Cohere multiplies them
    by ``logit_scale``); ``softcap`` (Gemma-2's ``final_logit_softcapping``, else None) caps them
    at ``softcap * tanh(logits / softcap)``. A head with a bias is refused (the chunked and fused
    losses take none)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s LM head has a bias; MTraining's loss takes an LM head without one")
    factor = getattr(model.config, "logit_scale", 1.0) / getattr(model.config, "logits_scaling", 1.0)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return (hidden if factor == 1.0 else hidden * factor), head.weight, softcap


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of a transformers decoder (those that call the interface)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def checked_attention_modules(model: PreTrainedModel, device_type: str | None = None) -> list[torch.nn.Module]:
    """``model``'s attention modules after :func:`check_model_config` (for ``device_type``) and
    :func:`check_attention_modules`: one ValueError line for what MTraining cannot train."""
    check_model_config(model.config, type(model.config).__name__, device_type)
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no transformers self-attention modules "
                         f"(classes named *Attention with a layer_idx); MTraining cannot hook it")
    check_attention_modules(modules)
    return modules


def use_mtraining_attention(model: PreTrainedModel, settings: MTrainingAttentionSettings,
                            device_type: str | None = None) -> PreTrainedModel:
    """Switches ``model`` to MTraining attention with ``settings`` (in place; returns it), once
    :func:`checked_attention_modules` takes it."""
    for module in checked_attention_modules(model, device_type):
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
