"""One training step under torch.profiler (``train.py --profile_step N``): where its time goes.

Every rank writes ``<save_dir>/profile_step<N>_rank<r>.json``: the step's wall time, the time of
each kind of work and the 20 most expensive kernels. On GPUs the kinds sum the CUDA kernels'
time (what the device ran, in the step); on CPU the CPU operators' self time. Kinds, by name:

* ``attention``: the sparse kernels (forward, dQ, dK/dV, delta, the per-call index) and, on CPU,
  the op's calls (``mtraining::*`` ranges);
* ``estimator``: the fused estimator's kernels (on CPU the torch rule's operators count under
  their own kinds);
* ``dense attention``: torch SDPA's attention (its flash, memory-efficient and cuDNN kernels, on
  CPU the SDPA operators) and FlashAttention-4's (by the same name fragments; tests/test_cuda_fa4.py
  checks on the GPU), what the dense and Ulysses baselines run;
* ``gemm``: matrix products (cuBLAS/CUTLASS kernels, ``aten::mm``...), the layers' projections
  and the LM head;
* ``communication``: NCCL kernels / gloo collectives;
* ``liger``: liger-kernel's Triton kernels (RMSNorm, RoPE, SwiGLU, the fused loss);
* ``copies and fills``; ``elementwise and other``: the rest.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..record import write_json

KINDS = (  # (kind, name fragments, lower case), first match wins
    ("estimator", ("mtr::est::",)),
    ("attention", ("mtr::", "mtraining::")),  # every other kernel of csrc/cuda (forward, dQ, dK/dV, delta, index)
    ("dense attention", ("flash_fwd", "flash_bwd", "fmha", "sdpa", "scaled_dot_product", "efficient_attention")),
    ("communication", ("nccl", "gloo", "c10d::")),
    ("liger", ("liger", "_rms_norm", "_swiglu", "_triton_rope", "element_mul_kernel", "cross_entropy_kernel")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::baddbmm", "aten::linear")),
    ("copies and fills", ("memcpy", "memset", "aten::copy_", "aten::fill_", "aten::zero_", "aten::clone",
                          "aten::contiguous")),
)
OTHER = "elementwise and other"
# What a step would not spend with attention that cost nothing (bench.e2e's attention-free step).
ATTENTION_KINDS = ("attention", "estimator", "dense attention")
TOP = 20


def kind_of(name: str) -> str:
    """The kind of work a kernel or operator named ``name`` does (see the module docstring)."""
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return OTHER


@contextlib.contextmanager
def profiled(enabled: bool):
    """torch.profiler over the block when ``enabled`` (CPU, and CUDA where available); yields the
    profiler or None."""
    if not enabled:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        yield profiler
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # every kernel of the step ends inside the profile


def summarise(profiler, step: int, rank: int, step_s: float) -> dict:
    """The step's time by kind of work and its most expensive kernels (or CPU operators)."""
    on_gpu = torch.cuda.is_available()
    rows = []
    for event in profiler.key_averages():
        if on_gpu:
            # a record_function range (ops.py's mtraining::*) also shows on the GPU as an annotation
            # spanning its kernels: counting it would count those kernels twice
            if event.device_type != torch.autograd.DeviceType.CUDA or event.is_user_annotation:
                continue
            microseconds = event.self_device_time_total
        else:
            microseconds = event.self_cpu_time_total
        if microseconds > 0:
            rows.append({"name": event.key, "ms": microseconds / 1e3, "count": event.count, "kind": kind_of(event.key)})
    rows.sort(key=lambda row: -row["ms"])
    by_kind: dict = {}
    for row in rows:
        by_kind[row["kind"]] = by_kind.get(row["kind"], 0.0) + row["ms"]
    total = sum(by_kind.values())
    return {"step": step, "rank": rank, "device": "cuda" if on_gpu else "cpu", "step_s": step_s,
            "measured": "CUDA kernel time" if on_gpu else "CPU operator self time",
            "total_ms": total, "ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "share_by_kind": {kind: ms / total for kind, ms in by_kind.items()} if total else {},
            "top": rows[:TOP]}


def profile_path(save_dir: str, step: int, rank: int) -> Path:
    return Path(save_dir) / f"profile_step{step}_rank{rank}.json"


def write_summary(summary: dict, save_dir: str) -> Path:
    path = profile_path(save_dir, summary["step"], summary["rank"])
    return write_json(path, summary)


def describe(summary: dict) -> str:
    """One line: the step's time by kind."""
    parts = ", ".join(f"{kind} {ms:.0f} ms ({summary['share_by_kind'][kind]:.0%})"
                      for kind, ms in summary["ms_by_kind"].items())
    return f"profile of step {summary['step']} ({summary['measured']}, rank {summary['rank']}): {parts}"
