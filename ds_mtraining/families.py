"""The model-family matrix: which transformers decoders MTraining trains, and the one line that
refuses the others.

Each family is built from transformers' own config class: at toy size for the CPU tests
(``tests/test_families.py``: the loss and gradients of MTraining with a full index against the
model's own eager attention), at its public models' head_dim for the GPU
(``ds_mtraining.bench.families``), and printed as the table of ``docs/MODELS.md``::

    python -m ds_mtraining.families            # the table, as docs/MODELS.md holds it

A family is supported when :func:`ds_mtraining.hf.use_mtraining_attention` takes its model;
its sliding-window layers then run their window exactly (:mod:`ds_mtraining.window`) and its
global layers MTraining's estimated index. A refusal is the ValueError line that call raises.
"""
from __future__ import annotations

from dataclasses import dataclass, field

TOY_WINDOW = 100  # tokens: shorter than the tests' sequences, not a multiple of a block
TOY = dict(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=128, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Family:
    """One row of the matrix: transformers' config class, the fields that give it its features at
    any size, and the head_dim of its public models."""

    name: str
    config_class: str
    features: str
    public_head_dim: int
    fields: dict = field(default_factory=dict)


FAMILIES = (
    Family("Llama", "LlamaConfig", "GQA", 128),
    Family("Qwen2", "Qwen2Config", "GQA, q/k/v bias", 128),
    Family("Qwen2 (sliding window)", "Qwen2Config", "use_sliding_window: layers from max_window_layers on",
           128, dict(use_sliding_window=True, sliding_window=TOY_WINDOW, max_window_layers=1)),
    Family("Qwen3", "Qwen3Config", "q/k RMSNorm", 128),
    Family("Mistral", "MistralConfig", "sliding window on every layer", 128, dict(sliding_window=TOY_WINDOW)),
    Family("Phi-3", "Phi3Config", "fused qkv projection", 96),
    Family("Gemma", "GemmaConfig", "scaled embeddings, GeGLU", 256),
    Family("Gemma-2", "Gemma2Config", "local/global layers, attention and final logit soft-capping", 256,
           dict(sliding_window=TOY_WINDOW)),
    Family("Gemma-2 (soft-capping off)", "Gemma2Config", "local/global layers", 256,
           dict(sliding_window=TOY_WINDOW, attn_logit_softcapping=None, final_logit_softcapping=None)),
    Family("Gemma-3 (text)", "Gemma3TextConfig", "local/global layers, q/k RMSNorm, query_pre_attn_scalar", 256,
           dict(sliding_window=TOY_WINDOW, layer_types=["sliding_attention", "full_attention"])),
    Family("OLMo-2", "Olmo2Config", "q/k RMSNorm over all heads", 128),
    Family("Granite", "GraniteConfig", "attention, embedding, residual and logit multipliers", 128,
           dict(attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0)),
    Family("gpt-oss", "GptOssConfig", "attention sinks, local/global layers, MoE", 64,
           dict(sliding_window=TOY_WINDOW, num_local_experts=4, num_experts_per_tok=2)),
)


def family(name: str) -> Family:
    for candidate in FAMILIES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no family {name!r}; the matrix has {[f.name for f in FAMILIES]}")


def family_config(fam: Family, **size):
    """``fam``'s transformers config at the toy size (:data:`TOY`), with ``size`` over it (e.g.
    ``hidden_size``, ``head_dim``) and the family's own fields over both."""
    import transformers
    values = {**TOY, **size, **fam.fields}
    # explicit: Gemma's, Qwen3's and gpt-oss's configs default it to 256, 128 and 64 at any size
    values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
    return getattr(transformers, fam.config_class)(**values)


def public_shape_config(fam: Family, layers: int = 2, heads: int = 8, kv_heads: int = 2, vocab_size: int = 32000,
                        head_dim: int | None = None, window: int = 4096):
    """``fam``'s config at its public models' head_dim (or ``head_dim``), small otherwise, its
    windowed layers at ``window`` tokens: what the GPU matrix runs."""
    head_dim = head_dim or fam.public_head_dim
    config = family_config(fam, hidden_size=heads * head_dim, head_dim=head_dim, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, num_hidden_layers=layers,
                           intermediate_size=2 * heads * head_dim, vocab_size=vocab_size)
    if "sliding_window" in fam.fields:
        config.sliding_window = window
    return config


def refusal(config, device_type: str) -> str | None:
    """The line :func:`ds_mtraining.hf.use_mtraining_attention` refuses ``config``'s model with on
    ``device_type`` (None: supported). Builds the model (keep ``config`` small)."""
    import torch
    from transformers import AutoModelForCausalLM
    from .hf import use_mtraining_attention
    from .layer import MTrainingAttentionSettings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        use_mtraining_attention(model, MTrainingAttentionSettings(), device_type)
    except ValueError as error:
        return str(error)
    return None


def matrix_rows() -> list[dict]:
    """The matrix: per family its features, public head_dim and the CPU and GPU verdicts."""
    rows = []
    for fam in FAMILIES:
        cpu = refusal(family_config(fam), "cpu")
        gpu = refusal(public_shape_config(fam), "cuda")
        rows.append({"family": fam.name, "config": fam.config_class, "features": fam.features,
                     "head_dim": fam.public_head_dim, "cpu": cpu, "gpu": gpu})
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| family | transformers config | attention features | head_dim | CPU | GPU (CUDA kernels) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        verdicts = ["trains" if row[side] is None else f"refused: `{row[side]}`" for side in ("cpu", "gpu")]
        lines.append(f"| {row['family']} | `{row['config']}` | {row['features']} | {row['head_dim']} | "
                     f"{verdicts[0]} | {verdicts[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table(matrix_rows()))
