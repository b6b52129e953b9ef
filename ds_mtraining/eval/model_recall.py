"""Recall of the model's own attention, per layer and head.

One dense forward over a held-out sequence; a capturing attention function (registered with
transformers' ``AttentionInterface``, so it sees exactly the post-RoPE q/k the model attends
with, and the layer's softmax scale) hands each layer's q/k to :mod:`ds_mtraining.recall` and
then runs SDPA. Per layer and head it reports, over ALL rows of the sequence:

* ``recall`` / ``density``: of MTraining's estimated index (:func:`estimate_vertical_slash` with
  the given :class:`SparseConfig`), the share of the exact causal softmax mass it keeps and its
  share of the causal entries;
* ``static_recall`` / ``static_density``: of the sinks + local window baseline
  (:class:`ds_mtraining.static.StaticPattern`) at the estimator's mean density over the layer;
* ``oracle_recall``: of the best block pattern at the estimator's density per head (an upper
  reference, :func:`ds_mtraining.recall.oracle_recall`).

Layers are processed as the forward reaches them, so q/k of only one layer are alive at a time.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..config import SparseConfig
from ..estimator.rule import estimate_vertical_slash
from ..recall import attention_recall, oracle_recall
from ..static import StaticPattern

CAPTURE = "mtraining_capture"
HOOK_ATTRIBUTE = "mtraining_capture_hook"


def capture_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA, after handing [B, S, H, D] q / [B, S, Hkv, D] k and the scale to the module's hook."""
    hook = getattr(module, HOOK_ATTRIBUTE, None)
    if hook is not None:
        hook(module, query.transpose(1, 2), key.transpose(1, 2), scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(CAPTURE, capture_forward)


@torch.no_grad()
def layer_recall(q, k, sparse: SparseConfig, scale: float | None, dtype=torch.float32):
    """Recall/density of the estimated index, the static baseline and the oracle for one layer's
    q [1, S, H, D], k [1, S, Hkv, D]. Returns (dict of per-head lists, the estimated index)."""
    q, k = q.to(dtype), k.to(dtype)
    seq_len, heads, block = q.shape[1], q.shape[2], sparse.block_size
    index = estimate_vertical_slash(q, k, sparse, scale)
    static = StaticPattern(density=index.density(), sink_tokens=sparse.sink_tokens)
    static_index = static.index(q.shape[0], heads, seq_len, block, q.device)
    result = attention_recall(q, k, [index, static_index], block, scale)
    oracle, _ = oracle_recall(result.block_mass, seq_len, block, result.density[0])
    values = {"recall": result.recall[0], "density": result.density[0],
              "static_recall": result.recall[1], "static_density": result.density[1],
              "oracle_recall": oracle}
    return {name: v[0].tolist() for name, v in values.items()}, index


@contextlib.contextmanager
def capturing(model, hook):
    """Within the block, every attention layer of ``model`` hands ``hook(module, q, k, scale)``
    its q [B, S, H, D], k [B, S, Hkv, D] and softmax scale before attending (SDPA)."""
    from ..hf import attention_modules
    modules = attention_modules(model)
    previous = model.config._attn_implementation
    for module in modules:
        setattr(module, HOOK_ATTRIBUTE, hook)
    try:
        model.set_attn_implementation(CAPTURE)
        yield
    finally:
        for module in modules:
            delattr(module, HOOK_ATTRIBUTE)
        model.set_attn_implementation(previous)


@torch.no_grad()
def index_densities(model, input_ids, configs) -> list[float]:
    """The mean density (computed / causal entries, over layers and heads) of the index that each
    :class:`SparseConfig` of ``configs`` estimates on ``model``'s own q/k for ``input_ids``: one
    forward, no recall arithmetic (to choose budgets for a density)."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long, device=device).reshape(1, -1)
    causal = ids.shape[1] * (ids.shape[1] + 1) / 2
    per_layer = []

    def hook(module, q, k, scale):
        per_layer.append([float(estimate_vertical_slash(q, k, config, scale).num_entries().double().mean() / causal)
                          for config in configs])

    with capturing(model, hook):
        model.base_model(input_ids=ids)
    return np.mean(per_layer, axis=0).tolist()


@torch.no_grad()
def model_recall(model, input_ids, sparse: SparseConfig | None = None, dtype=torch.float32,
                 advance=None, keep_indices: bool = False) -> dict:
    """Per layer and head recall (see the module docstring) of ``model`` on ``input_ids``
    ([S] or [1, S] ids). ``dtype``: of the recall arithmetic (float64 for exact checks).
    Returns ``{"seq_len", "sparse", "layers": [{"layer", "recall": [H], ...}], "mean": {...}}``
    (and ``"indices"``, the estimated index per layer, with ``keep_indices``)."""
    sparse = sparse or SparseConfig()
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long, device=device).reshape(1, -1)
    layers, indices = {}, {}

    def hook(module, q, k, scale):
        layers[module.layer_idx], index = layer_recall(q, k, sparse, scale, dtype)
        if keep_indices:
            indices[module.layer_idx] = index
        if advance is not None:
            advance()

    with capturing(model, hook):
        model.base_model(input_ids=ids)
    rows = [{"layer": i, **layers[i]} for i in sorted(layers)]
    names = ("recall", "density", "static_recall", "static_density", "oracle_recall")
    result = {"seq_len": ids.shape[1], "sparse": sparse.to_dict(), "layers": rows,
              "mean": {n: float(np.mean([r[n] for r in rows])) for n in names}}
    if keep_indices:
        result["indices"] = [indices[i] for i in sorted(indices)]
    return result
