"""``--export_hf DIR``: the trained model as a Hugging Face directory (``save_pretrained``) that
``AutoModelForCausalLM.from_pretrained(DIR)`` loads, with the full-precision weights consolidated
from the ZeRO partitions (every rank takes part, rank 0 writes)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist


def consolidated_state_dict(model) -> dict[str, torch.Tensor] | None:
    """The HF model's parameters and buffers at full precision on rank 0 (None elsewhere): ZeRO-1/2
    keep the fp32 master weights partitioned over the data-parallel ranks (gathered here with
    ``deepspeed.utils.safe_get_full_fp32_param``, a collective); without a ZeRO optimizer the
    module's own parameters are the weights."""
    from deepspeed.utils import safe_get_full_fp32_param
    state = {}
    for name, param in model.named_parameters():
        full = safe_get_full_fp32_param(param)
        state[name] = (param.detach() if full is None else full).float().cpu().clone()
    for name, buffer in model.named_buffers():
        if name in model.state_dict():  # persistent buffers only
            state[name] = buffer.detach().cpu().clone()
    return state if dist.get_rank() == 0 else None


def export_hf(model, out_dir: str, tokenizer_dir: str | None = None) -> Path | None:
    """Writes ``model`` (the engine's HF model) to ``out_dir`` with ``save_pretrained`` in fp32,
    its config back on the default attention (MTraining's attention is registered at run time
    only), plus the tokenizer files when the run used a tokenizer directory. Returns the path on
    rank 0."""
    state = consolidated_state_dict(model)
    if dist.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(model.config)
        config._attn_implementation = None  # reload with transformers' default attention
        config.dtype = torch.float32  # the weights written below
        config.save_pretrained(out)
        # save_pretrained through the model (tied weights, safetensors, generation config)
        original = model.config
        try:
            model.config = config
            model.save_pretrained(out, state_dict=state, safe_serialization=True)
        finally:
            model.config = original
        if tokenizer_dir:
            from transformers import AutoTokenizer
            AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(out)
    dist.barrier()
    return Path(out_dir).resolve() if dist.get_rank() == 0 else None
