"""Every CUDA kernel source compiles with ``nvcc -c`` for sm_80 and sm_90a (no GPU needed).

The .cu files include only CUDA headers (never ATen), so this runs on CPU machines and in CI
wherever nvcc exists; skipped otherwise. The Hopper path includes CuTe's wgmma atoms from the
``nvidia-cutlass`` headers (``pip install --no-deps nvidia-cutlass==4.2.0.0``, as CI does). To
keep the suite fast, device code is compiled without optimisation, every file for both
architectures in parallel (about a minute on 2 cores).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ds_mtraining_op_builder.cuda import cutlass_include

CUDA_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
INCLUDE_DIR = CUDA_DIR.parent / "include"  # mtraining/pattern.h, shared with the CPU kernel
NVCC = shutil.which("nvcc")
CUTLASS = cutlass_include()
# The macros torch's extension build defines: the kernels must not rely on implicit conversions.
TORCH_LIKE_FLAGS = ["-std=c++20", "--use_fast_math", "-D__CUDA_NO_HALF_OPERATORS__",
                    "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
                    "-D__CUDA_NO_HALF2_OPERATORS__"]
FAST_FLAGS = ["-O0", "-Xcicc", "-O0", "-Xptxas", "-O0"]
ARCH_FLAGS = {"sm_80": "-gencode=arch=compute_80,code=sm_80",
              "sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}


def compile_jobs() -> list[tuple[Path, str]]:
    sources = sorted(CUDA_DIR.glob("*.cu"))
    return [(source, arch) for arch in ARCH_FLAGS for source in sources]


def compile_one(job, out_dir: Path):
    source, arch = job
    command = [NVCC, "-c", *TORCH_LIKE_FLAGS, *FAST_FLAGS, "--expt-relaxed-constexpr", f"-I{CUTLASS}", f"-I{INCLUDE_DIR}",
               ARCH_FLAGS[arch], str(source),
               "-o", str(out_dir / f"{source.stem}_{arch}.o")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return source.name, arch, result.returncode, result.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.skipif(CUTLASS is None, reason="CuTe headers missing: pip install --no-deps nvidia-cutlass==4.2.0.0")
def test_every_kernel_source_compiles(tmp_path):
    jobs = compile_jobs()
    assert any(source.name.startswith("fwd_") for source, _ in jobs), f"no kernel sources in {CUDA_DIR}"
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(lambda job: compile_one(job, tmp_path), jobs))
    failures = [f"{name} ({arch}):\n{stderr}" for name, arch, code, stderr in results if code != 0]
    assert not failures, "nvcc failed:\n" + "\n".join(failures)


def test_kernel_sources_include_no_aten():
    """The kernels take raw pointers: only the bindings may include torch/ATen headers."""
    for path in (sorted(CUDA_DIR.glob("*.cu")) + sorted(CUDA_DIR.glob("*.cuh")) + [CUDA_DIR / "params.h"]
                 + [INCLUDE_DIR / "mtraining" / "pattern.h"]):
        text = path.read_text()
        for banned in ("#include <ATen", "#include <torch", "#include <c10"):
            assert banned not in text, f"{path.name} includes {banned[10:]} headers"
