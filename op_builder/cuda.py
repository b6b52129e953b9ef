"""Builder of the CUDA ops (csrc/cuda: the attention kernels' *.cu plus binding.cpp, and the fused
estimator's csrc/cuda/estimator: *.cu plus its binding, estimate_binding.cpp).

JIT builds compile only for the visible devices' architectures: sm_90a for compute capability
9.0 (so Hopper-only instructions such as wgmma/TMA are allowed), sm_80 for 8.x. A prebuild
(``DS_BUILD_MTRAINING=1 pip install``) compiles for TORCH_CUDA_ARCH_LIST, else the visible
devices, else both. CUTLASS/CuTe headers come from the ``nvidia-cutlass`` pip package
(``pip install .[cuda]``); they are required only when a CUDA source includes them.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, assert_no_cuda_mismatch

from .mtraining import MTrainingBuilderMixin, csrc_root

# compute capability major -> the architecture the kernels are compiled for
_ARCH_OF_MAJOR = {9: "90a", 8: "80"}
_DEFAULT_PREBUILD_MAJORS = (8, 9)


def cutlass_include() -> str | None:
    """CUTLASS/CuTe include directory of the nvidia-cutlass package, or None if absent."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "source", "include")
    return path if os.path.isdir(os.path.join(path, "cute")) else None


def _arch_list_majors(arch_list: str) -> list[tuple[int, int]]:
    """Parses TORCH_CUDA_ARCH_LIST ("8.0;9.0", "8.6 9.0a+PTX") into (major, minor) pairs."""
    return [(int(m.group(1)), int(m.group(2)))
            for m in re.finditer(r"(\d+)\.(\d+)", arch_list)]


class MTrainingCUDABuilder(MTrainingBuilderMixin, CUDAOpBuilder):
    """Compiles ``csrc/cuda`` into ``ds_mtraining.mtraining_cuda_op``."""

    NAME = "mtraining_cuda"
    DEVICE_TYPE = "cuda"
    SOURCES_HINT = "cuda/binding.cpp, cuda/instantiations/*.cu and cuda/estimator/*"
    # under csrc/cuda: the binding, the attention kernels' instantiations (generate_kernels.py), the fused estimator
    SOURCE_DIRS = ("", "instantiations", "estimator")
    TYPICAL_BUILD = "about 45 s on a 16-core H200 machine"
    # CuTe needs relaxed constexpr; line info keeps profiles readable
    EXTRA_NVCC_FLAGS = ["--expt-relaxed-constexpr", "--expt-extended-lambda", "-lineinfo",
                        "-DNDEBUG"]

    def _files(self, *extensions: str) -> list[str]:
        """Files of SOURCE_DIRS with these extensions, sorted per directory."""
        cuda = csrc_root() / "cuda"
        return [path for folder in self.SOURCE_DIRS
                for path in self._sorted_glob(*(str(cuda / folder / f"*.{ext}") for ext in extensions))]

    def sources(self) -> list[str]:
        """Every .cu and .cpp of SOURCE_DIRS (the bindings are the .cpp files)."""
        kernels, bindings = self._files("cu"), self._files("cpp")
        has_binding = (csrc_root() / "cuda" / "binding.cpp").is_file()
        return kernels + bindings if kernels and has_binding else []

    def sources_use_cutlass(self) -> bool:
        """Whether any CUDA source or header includes CUTLASS or CuTe headers."""
        include = re.compile(r'#\s*include\s*[<"](cutlass|cute)/')
        files = self._files("cu", "cuh", "h", "cpp")
        return any(include.search(Path(path).read_text(errors="replace")) for path in files)

    def include_paths(self) -> list[str]:
        cutlass = cutlass_include()
        return super().include_paths() + [str(csrc_root() / "cuda")] + ([cutlass] if cutlass else [])

    # ------------------------------------------------------------------ architectures
    def _device_capabilities(self) -> list[tuple[int, int]]:
        import torch
        if not torch.cuda.is_available():
            return []
        return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})

    def target_capabilities(self) -> list[tuple[int, int]]:
        """Capabilities to compile for: the devices when JIT; else TORCH_CUDA_ARCH_LIST, the
        devices, or 8.0 and 9.0."""
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
        if not self.jit_mode and arch_list:
            return _arch_list_majors(arch_list)
        devices = self._device_capabilities()
        if self.jit_mode or devices:
            return devices
        return [(major, 0) for major in _DEFAULT_PREBUILD_MAJORS]

    def compute_capability_args(self, cross_compile_archs=None) -> list[str]:
        archs = sorted({_ARCH_OF_MAJOR[major] for major, _ in self.target_capabilities()
                        if major in _ARCH_OF_MAJOR})
        if not archs:
            raise RuntimeError(f"{self.NAME}: no supported CUDA architecture to compile for "
                               f"(the kernels support compute capability 8.x and 9.0)")
        self.enable_bf16 = True
        return [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]

    def nvcc_args(self) -> list[str]:
        return super().nvcc_args() + self.EXTRA_NVCC_FLAGS

    # ------------------------------------------------------------------ compatibility
    def missing(self) -> list[str]:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
        reasons = super().missing()
        if torch.version.cuda is None:
            reasons.append("torch is a CPU-only build (torch.version.cuda is None)")
        elif CUDA_HOME is None:
            reasons.append("no CUDA toolkit found (nvcc; set CUDA_HOME)")
        else:
            try:
                assert_no_cuda_mismatch(self.NAME)
            except Exception as err:  # noqa: BLE001 - DeepSpeed raises several kinds
                reasons.append(f"{err} (DS_SKIP_CUDA_CHECK=1 overrides)")
        if cutlass_include() is None and self.sources_use_cutlass():
            reasons.append("CUTLASS/CuTe headers missing: pip install nvidia-cutlass --no-deps "
                           "(or pip install .[cuda])")
        capabilities = self.target_capabilities() if torch.version.cuda is not None else []
        unsupported = [f"{a}.{b}" for a, b in capabilities if a not in _ARCH_OF_MAJOR]
        if unsupported:
            reasons.append(f"compute capability {', '.join(unsupported)} unsupported "
                           f"(the kernels need 8.x or 9.0)")
        return reasons

    def missing_for_jit(self) -> list[str]:
        import torch
        reasons = super().missing_for_jit()
        if torch.version.cuda is not None and not torch.cuda.is_available():
            reasons.append("no CUDA device is visible (torch.cuda.is_available() is False)")
        return reasons
