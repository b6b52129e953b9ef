"""Every CUDA kernel source compiles with ``nvcc -c`` for sm_80 and sm_90a (no GPU needed).

The .cu files include only CUDA headers (never ATen), so this runs on CPU machines and in CI
wherever nvcc exists; skipped otherwise. The Hopper path includes CuTe's wgmma atoms from the
``nvidia-cutlass`` headers (``pip install --no-deps nvidia-cutlass==4.2.0.0``, as CI does). To
keep the suite fast (~55 s on 2 cores, was ~80 s with one nvcc per file and arch): one nvcc per
file builds both architectures (-gencode twice: the host pass, ~40% of a compile, runs once), the
files compile concurrently (one nvcc per core, longest first), and everything is built at -O0:
template instantiation and type checking happen in the front ends at any level, and -O0 was the
fastest of the levels measured (per file and arch: 8.4 s vs 9.2-10.2 s at nvcc's defaults). The
compile is a background build (conftest): it runs niced beside the rest of the suite, and the
test, run last, reads its results.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import finish

from ds_mtraining_op_builder.cuda import MTrainingCUDABuilder, cutlass_include

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


CUOBJDUMP = shutil.which("cuobjdump")


def kernel_sources() -> list[Path]:
    """Every .cu file the op builder compiles, the slow ones (the attention instantiations) first,
    so that the small ones fill the cores at the end."""
    sources = [Path(s) for s in MTrainingCUDABuilder().sources() if s.endswith(".cu")]
    return sorted(sources, key=lambda source: (not source.name.startswith(("fwd_", "bwd_")), source.name))


def compile_one(source: Path, out_dir: Path):
    """``nvcc -c`` of one source for every architecture in ARCH_FLAGS: (name, returncode, stderr,
    the architectures of the cubins in the object, or None without cuobjdump)."""
    output = out_dir / f"{source.stem}.o"
    command = [NVCC, "-c", *TORCH_LIKE_FLAGS, *FAST_FLAGS, "--expt-relaxed-constexpr", f"-I{CUTLASS}",
               f"-I{INCLUDE_DIR}", f"-I{CUDA_DIR}", *ARCH_FLAGS.values(), str(source), "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    cubins = None
    if result.returncode == 0 and CUOBJDUMP is not None:
        listing = subprocess.run([CUOBJDUMP, "--list-elf", str(output)], capture_output=True, text=True, timeout=60)
        cubins = sorted(set(re.findall(r"\.(sm_\w+)\.cubin", listing.stdout)))
    return source.name, result.returncode, result.stderr, cubins


def compile_all(out_dir: Path):
    """Every kernel source through :func:`compile_one`, one nvcc per core; writes
    ``out_dir/results.json``: [name, returncode, stderr, cubins] per source."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda source: compile_one(source, out_dir), kernel_sources()))
    (out_dir / "results.json").write_text(json.dumps(results))


def background_compile(directory: Path):
    """The test's background build (conftest): this file run as a script into ``directory``."""
    if NVCC is None or CUTLASS is None:
        return None  # the test skips
    return [sys.executable, __file__, str(directory)], dict(os.environ)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.skipif(CUTLASS is None, reason="CuTe headers missing: pip install --no-deps nvidia-cutlass==4.2.0.0")
@pytest.mark.background_build(command=background_compile)
def test_every_kernel_source_compiles(background_build):
    process, log, directory = background_build
    finish(process, log, 1200)
    results = json.loads((directory / "results.json").read_text())
    assert any(name.startswith("fwd_") for name, *_ in results), f"no kernel sources in {CUDA_DIR}"
    failures = [f"{name} ({', '.join(ARCH_FLAGS)}):\n{stderr}" for name, code, stderr, _ in results if code != 0]
    assert not failures, "nvcc failed:\n" + "\n".join(failures)
    for name, _, _, cubins in results:  # both architectures really built
        assert cubins is None or cubins == sorted(ARCH_FLAGS), (name, cubins)


def test_op_builder_compiles_every_source():
    """The op builder's source list is in step with the tree: every .cu and .cpp under csrc/cuda
    (the estimator's in csrc/cuda/estimator too), each once."""
    tree = sorted(str(p) for ext in ("cu", "cpp") for p in CUDA_DIR.rglob(f"*.{ext}"))
    listed = [str(Path(s).resolve()) for s in MTrainingCUDABuilder().sources()]
    assert sorted(listed) == sorted(str(Path(p).resolve()) for p in tree)
    assert any(p.endswith("estimator/estimate.cu") for p in listed)


def test_kernel_sources_include_no_aten():
    """The kernels take raw pointers: only the bindings may include torch/ATen headers."""
    for path in (sorted(CUDA_DIR.rglob("*.cu")) + sorted(CUDA_DIR.rglob("*.cuh")) + [CUDA_DIR / "params.h"]
                 + [INCLUDE_DIR / "mtraining" / "pattern.h"]):
        text = path.read_text()
        for banned in ("#include <ATen", "#include <torch", "#include <c10"):
            assert banned not in text, f"{path.name} includes {banned[10:]} headers"


if __name__ == "__main__":  # the background build: python test_cuda_compile.py OUT_DIR
    compile_all(Path(sys.argv[1]))
