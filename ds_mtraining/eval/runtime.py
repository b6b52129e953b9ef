"""What every evaluation needs: the model (a local HF directory), its tokenizer, held-out text,
the attention it runs (dense SDPA or FlashAttention-4's causal kernel, or MTraining's sparse
prefill) and greedy decoding."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..config import SparseConfig
from ..dense_backend import resolve_dense_backend
from ..data import ByteTokenizer, HFTokenizer, datasets_offline, folder_spec, load_documents, stdlib_documents
from ..hf import attention_modules, fa4_attention_forward, mtraining_attention_forward, use_mtraining_attention
from ..layer import AttentionStats, MTrainingAttentionSettings
from ..static import StaticPattern

SPARSE_PREFILL = "mtraining_prefill"
DENSE_PREFILL = "mtraining_dense_prefill"
DENSE_KERNEL_ATTRIBUTE = "mtraining_dense_kernel"
EVAL_ATTENTION = ("dense", "sparse", "static")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def sparse_prefill_forward(module, query, key, value, attention_mask, **kwargs):
    """MTraining attention for a prefill (as many queries as keys: the whole prompt), dense SDPA
    for the decoding steps that follow (one query against the cache)."""
    if query.shape[2] == key.shape[2]:
        return mtraining_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(SPARSE_PREFILL, sparse_prefill_forward)


def dense_prefill_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """A prefill's causal attention with the module's dense kernel (FA4 where set: the fastest
    dense kernel on Hopper), SDPA for the decoding steps (one query against the cache)."""
    if query.shape[2] == key.shape[2] and getattr(module, DENSE_KERNEL_ATTRIBUTE, "sdpa") == "fa4":
        return fa4_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)  # a whole prompt: causal
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(DENSE_PREFILL, dense_prefill_forward)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_model(path: str, device: torch.device, dtype: torch.dtype):
    """``AutoModelForCausalLM.from_pretrained`` of a local directory (never downloaded), in
    eval mode, dense SDPA attention."""
    from transformers import AutoModelForCausalLM
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"{path!r} is not a model directory (no config.json); give the directory "
                                f"of an exported HF causal LM (save_pretrained)")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                 attn_implementation="sdpa")
    return model.to(device).eval()


def model_fingerprint(path: str) -> str:
    """The first 16 hex digits of the SHA-256 of a model directory's weight files (sorted by name):
    which trained model an evaluation's rows came from."""
    import hashlib
    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*")):
        if file.suffix in (".safetensors", ".bin", ".pt"):
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def load_eval_tokenizer(spec: str, model_dir: str):
    """``"auto"``: the model directory's tokenizer if it has one, else the byte tokenizer;
    ``"bytes"``; or a tokenizer directory."""
    if spec == "auto":
        spec = model_dir if any(Path(model_dir, f).is_file() for f in TOKENIZER_FILES) else "bytes"
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec, key="--tokenizer")


def sparse_config(spec: str | None) -> SparseConfig:
    """``None``: defaults; a DeepSpeed JSON path: its ``mtraining.sparse`` section (with
    ``stripe_block``); else an inline JSON object of SparseConfig fields."""
    if spec is None:
        return SparseConfig()
    if Path(spec).is_file():
        section = json.loads(Path(spec).read_text()).get("mtraining", {})
        values = dict(section.get("sparse", {}))
        if "stripe_block" in section:
            values["block_size"] = section["stripe_block"]
    else:
        values = json.loads(spec)
    return SparseConfig.from_dict(values, where="--sparse_config")


def set_attention(model, mode: str, sparse: SparseConfig | None = None, dense_kernel: str = "sdpa",
                  static_density: float | None = None) -> AttentionStats | None:
    """``"dense"``: exact causal attention (as the paper evaluates): transformers' SDPA, or with
    ``dense_kernel`` "fa4" / "auto" (:func:`~ds_mtraining.dense_backend.resolve_dense_backend`'s
    rule) FlashAttention-4 for each prefill. ``"sparse"``: MTraining's estimated sparse attention
    for every prefill (single process, :func:`use_mtraining_attention`), dense SDPA while
    decoding; returns the statistics the sparse calls record. ``"static"``: sinks + a local window
    at ``static_density`` (:class:`~ds_mtraining.static.StaticPattern`, the sparse path's kernels)
    for every prefill, as a model trained with it is served."""
    if mode not in EVAL_ATTENTION:
        raise ValueError(f"attention {mode!r} is unknown; use one of {list(EVAL_ATTENTION)}")
    if mode == "dense":
        device = next(model.parameters()).device
        kernel = "sdpa" if dense_kernel == "sdpa" or device.type != "cuda" and dense_kernel == "auto" else \
            resolve_dense_backend(dense_kernel, device, key="--dense_kernel").name
        for module in attention_modules(model):
            setattr(module, DENSE_KERNEL_ATTRIBUTE, kernel)
        model.set_attn_implementation("sdpa" if kernel == "sdpa" else DENSE_PREFILL)
        return None
    sparse, pattern = sparse or SparseConfig(), None
    if mode == "static":
        if static_density is None:
            raise ValueError("static attention needs the density the model trained at (static_density)")
        pattern = StaticPattern(density=static_density, sink_tokens=sparse.sink_tokens)
    stats = AttentionStats()
    use_mtraining_attention(model, MTrainingAttentionSettings(sparse, stats=stats, pattern=pattern))
    model.set_attn_implementation(SPARSE_PREFILL)
    return stats


def layer_densities(densities: list, layers: int) -> list[float]:
    """Each layer's mean index density from :class:`AttentionStats`' ``densities`` of whole
    forwards (every forward records one call per layer, in layer order): [layers] floats."""
    if not densities or len(densities) % layers:
        raise ValueError(f"{len(densities)} recorded attention calls are not whole forwards of {layers} layers")
    return np.asarray(densities, dtype=np.float64).reshape(-1, layers).mean(0).tolist()


def _cache_keyword(model) -> str:
    names = inspect.signature(model.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


@torch.no_grad()
def greedy_generate(model, input_ids, max_new_tokens: int) -> list[int]:
    """Greedy decoding after one prefill of ``input_ids`` ([n] ids), with the KV cache."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long, device=device)[None]
    keyword = _cache_keyword(model)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    generated = []
    for step in range(max_new_tokens):
        token = out.logits[:, -1].argmax(-1)
        generated.append(int(token))
        if step + 1 == max_new_tokens:
            break
        cache = out.get("cache", None) or out.get("past_key_values", None)
        out = model(input_ids=token[:, None], use_cache=True, **{keyword: cache})
    return generated


def data_spec(value: str) -> dict:
    """``--data``: "stdlib", a folder (read as training's ``--data DIR`` reads it: a saved dataset
    or its jsonl/parquet/arrow/csv files), or comma-separated local files."""
    if value == "stdlib":
        return {"source": "stdlib"}
    if Path(value).is_dir():
        return folder_spec(value)
    return {"files": value.split(",")}


def heldout_stream(spec: dict, tokenizer, min_tokens: int, prefer_tokens: int | None = None) -> np.ndarray:
    """Token ids of the LAST documents of a data source (each followed by the end-of-document
    token), as few as hold ``prefer_tokens`` (default ``min_tokens``; all of them where fewer,
    ValueError below ``min_tokens``), in document order. The training loader reads a source from
    its start; point ``spec`` at text the model never saw for a strict held-out set."""
    if spec.get("source") == "stdlib":  # read directly: needs no `datasets`
        documents = stdlib_documents()
    else:
        datasets_offline()
        documents = load_documents(spec, key="--data")
    pieces, total = [], 0
    for i in range(len(documents) - 1, -1, -1):
        ids = np.append(tokenizer.encode(documents[i]["text"]), tokenizer.eos_token_id).astype(np.int64)
        pieces.append(ids)
        total += len(ids)
        if total >= max(min_tokens, prefer_tokens or 0):
            break
    if total < min_tokens:
        raise ValueError(f"the data holds {total} tokens, {min_tokens} are needed; give more text (--data)")
    return np.concatenate(pieces[::-1])
