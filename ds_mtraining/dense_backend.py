"""The kernel of the dense-attention baselines (``mtraining.dense_backend``): torch's SDPA or
FlashAttention-4, chosen once per run.

It runs where a baseline computes whole causal attention: ``attention: "dense"`` on one GPU
without documents (:func:`ds_mtraining.layer.striped_sparse_attention`; elsewhere the dense mode
runs the full index through the sparse kernels), ``attention: "ulysses"`` (the model's attention
under DeepSpeed-Ulysses: :func:`ds_mtraining.hf.use_ulysses_attention`) and ``bench.kernel``'s
dense rows. Settings:

* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` (its own dispatch: on an H200 in bf16, cuDNN's attention kernel);
* ``"fa4"``: FlashAttention-4 (``flash_attn.cute`` of the ``flash-attn-4`` package, CuTe DSL;
  forward and backward on Hopper and Blackwell). Where it cannot run (no CUDA device, another
  architecture, the package missing or not importable), :func:`resolve_dense_backend` raises one
  :class:`DenseBackendError` line naming why (and the pip command);
* ``"auto"``: a fixed rule by GPU architecture and availability (``AUTO_FA4_MAJORS``), never a
  run-time autotune; where FA4 cannot run, SDPA. The resolved :class:`DenseBackend` says which
  kernel runs and why (``describe()``, the line a run prints first).

FA4 takes FlashAttention's layout, the one used here: q [B, S, H, D], k/v [B, S, Hkv, D] (GQA
without repeating K/V), bf16 or fp16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DENSE_BACKENDS = ("auto", "sdpa", "fa4")
FA4_PACKAGE = "flash-attn-4==4.0.0b36"
FA4_INSTALL = f"pip install {FA4_PACKAGE} (with a CUDA 13 torch: pip install 'flash-attn-4[cu13]==4.0.0b36')"
FA4_ARCHITECTURES = {9: "Hopper", 10: "Blackwell", 11: "Blackwell", 12: "Blackwell"}  # compute capability major
# Compute capability majors where "auto" picks FA4 when it can run: Hopper, where FA4's causal
# fwd+bwd ran 1.9x SDPA's flash backend at 32K-512K, and a training step's attention 1.2x the
# cuDNN kernel that SDPA dispatches to (H200; docs/RESULTS.md#fa4, #one-gpu-fa4). Blackwell is
# not measured here, so auto stays SDPA there.
AUTO_FA4_MAJORS: frozenset = frozenset({9})


class DenseBackendError(ValueError):
    """A dense backend setting that is not one, or ``"fa4"`` where FA4 cannot run (one line)."""


@dataclass(frozen=True)
class DenseBackend:
    """A resolved setting: ``name`` is the kernel that runs (``"sdpa"`` or ``"fa4"``), ``why`` one
    line on the choice."""

    name: str
    why: str

    def describe(self) -> str:
        return f"dense attention kernel: {self.name} ({self.why})"


def check_dense_backend(value, key: str = "dense_backend") -> str:
    """``value`` if it is a setting, else :class:`DenseBackendError` naming the valid ones."""
    if value not in DENSE_BACKENDS:
        raise DenseBackendError(f"{key}={value!r} is not a dense backend; use one of {list(DENSE_BACKENDS)} "
                                f"(sdpa: torch SDPA; fa4: FlashAttention-4 on Hopper/Blackwell; auto: by GPU)")
    return value


def _import_fa4():
    """FA4's module (imported on first use: it loads the CuTe DSL's compiler libraries)."""
    import flash_attn.cute
    return flash_attn.cute


def fa4_unavailable(device=None) -> str | None:
    """Why FA4 cannot run on ``device`` (default: the current CUDA device), or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_ARCHITECTURES:
        return (f"compute capability {major}.{minor} is neither Hopper (9.x) nor Blackwell (10.x-12.x), "
                f"where FA4 trains")
    try:
        _import_fa4()
    except ModuleNotFoundError as error:
        return f"flash_attn.cute is not installed ({error}); {FA4_INSTALL}"
    except (ImportError, RuntimeError, OSError) as error:  # installed but broken (e.g. the DSL's CUDA libraries)
        return f"flash_attn.cute does not import ({str(error).splitlines()[0]}); reinstall: {FA4_INSTALL}"
    return None


def resolve_dense_backend(setting: str, device=None, key: str = "dense_backend") -> DenseBackend:
    """The kernel ``setting`` runs on ``device`` (default: the current CUDA device):
    :class:`DenseBackendError` for a bad setting or for ``"fa4"`` where FA4 cannot run; ``"auto"``
    takes FA4 where the rule picks it and it can run, else SDPA, saying why. FA4 is imported only
    where it would run (its import loads the CuTe DSL's libraries, seconds)."""
    check_dense_backend(setting, key)
    given = f"{key}={setting!r}"
    if setting == "sdpa":
        return DenseBackend("sdpa", given)
    if setting == "auto" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if major not in AUTO_FA4_MAJORS:
            return DenseBackend("sdpa", f"{given}: SDPA on compute capability {major}.{minor}")
    reason = fa4_unavailable(device)
    if reason is None:
        return DenseBackend("fa4", given)
    if setting == "fa4":
        raise DenseBackendError(f"{given} cannot run here: {reason}; set it to 'sdpa' or 'auto'")
    return DenseBackend("sdpa", f"{given}: SDPA, FA4 cannot run here ({reason})")


def dense_causal_attention(q, k, v, scale: float, backend: str) -> torch.Tensor:
    """Causal attention of q [B, S, H, D] over k/v [B, S, Hkv, D] (GQA: H a multiple of Hkv) with
    the resolved ``backend`` (``DenseBackend.name``); [B, S, H, D] in q's dtype, differentiable."""
    if backend == "fa4":
        return _import_fa4().flash_attn_func(q, k, v, softmax_scale=scale, causal=True)[0]
    if backend != "sdpa":
        raise DenseBackendError(f"dense attention kernel {backend!r} is not 'sdpa' or 'fa4' (resolve the "
                                f"setting with resolve_dense_backend)")
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def fa4_document_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """FA4's varlen path: causal attention inside each document of packed tokens, q [T, H, D] and
    k/v [T, Hkv, D], document ``i`` holding tokens ``cu_seqlens[i] .. cu_seqlens[i+1] - 1``
    (int32 on q's device; ``max_seqlen`` the longest document, a host int); [T, H, D]."""
    return _import_fa4().flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                                softmax_scale=scale, causal=True)[0]
