"""The model a run trains: a transformers causal LM from a preset or a local directory, wrapped
so that its forward returns the sequence-parallel loss."""
from __future__ import annotations

from pathlib import Path

import torch

from . import MTRAINING_KEY, ConfigError

PRESETS = {
    # the Qwen2 shape at toy size: GQA 2:1, RoPE theta 1e6, untied head; byte vocabulary
    "tiny-qwen2": {"model_type": "qwen2", "vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                   "rope_theta": 1e6, "max_position_embeddings": 1 << 20, "tie_word_embeddings": False},
}


def model_config(spec: dict):
    """The transformers config of a model spec (preset or local directory) with its overrides."""
    from transformers import AutoConfig, CONFIG_MAPPING
    name = spec["name_or_path"]
    if name in PRESETS:
        values = dict(PRESETS[name])
        config = CONFIG_MAPPING[values.pop("model_type")](**values)
    else:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    for key, value in spec["config_overrides"].items():
        if not hasattr(config, key):
            raise ConfigError(f"{MTRAINING_KEY}.model.config_overrides.{key}: {type(config).__name__} "
                              f"has no such field")
        setattr(config, key, value)
    return config


class MTrainingCausalLM(torch.nn.Module):
    """A transformers causal LM whose loss is the chunked sequence-parallel cross-entropy:
    ``forward(input_ids, labels, position_ids)`` on this rank's striped shard returns the loss."""

    def __init__(self, model, group, loss_chunk_tokens: int):
        super().__init__()
        self.model = model
        self.group = group
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(self, input_ids, labels, position_ids):
        from ds_mtraining.loss import sequence_parallel_cross_entropy
        hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        weight = self.model.get_output_embeddings().weight
        return sequence_parallel_cross_entropy(hidden, weight, labels, self.group, self.loss_chunk_tokens)


def build_model(spec: dict):
    """A transformers causal LM: a preset or config-only directory is built from its config
    (random init, seeded by the caller); a directory with weights is loaded (local files only)."""
    from transformers import AutoModelForCausalLM
    config = model_config(spec)
    path = Path(spec["name_or_path"])
    has_weights = path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")))
    if has_weights:
        return AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True,
                                                    dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
