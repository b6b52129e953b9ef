"""Installs ds-mtraining (the package, its DeepSpeed op builders and the C++/CUDA sources).

    pip install -e .                # the ops JIT-compile on first use (cached in TORCH_EXTENSIONS_DIR)
    DS_BUILD_MTRAINING=1 pip install --no-build-isolation .
                                    # prebuilds the CPU op (and the CUDA op where CUDA is usable)
                                    # into the package, DeepSpeed style: no compilation at import
                                    # (DS_BUILD_MTRAINING_CUDA=0 skips the CUDA op)

Prebuilding imports torch and deepspeed, so they must already be installed and pip must not
isolate the build. The sources ship inside the package as ``op_builder/csrc`` (package data), so
an install without prebuilt ops can still JIT-compile them.
"""
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_VAR = "DS_BUILD_MTRAINING"
CSRC_PATTERNS = ["**/*.h", "**/*.hpp", "**/*.cpp", "**/*.cu", "**/*.cuh"]


def op_extensions():
    """The prebuilt op extensions and build command when DS_BUILD_MTRAINING=1, else none."""
    if os.environ.get(BUILD_VAR, "0") != "1":
        return [], {}
    try:
        import deepspeed  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension
    except ImportError as err:
        raise SystemExit(f"{BUILD_VAR}=1 needs torch and deepspeed installed first and "
                         f"'pip install --no-build-isolation': {err}") from err
    sys.path.insert(0, HERE)
    from op_builder import MTrainingCPUBuilder, MTrainingCUDABuilder

    cpu = MTrainingCPUBuilder()
    if not cpu.is_compatible(verbose=True):
        raise SystemExit(f"{BUILD_VAR}=1: cannot build {cpu.NAME}: " + "; ".join(cpu.missing()))
    extensions = [cpu.builder()]
    cuda = MTrainingCUDABuilder()
    if os.environ.get(f"{BUILD_VAR}_CUDA", "1") == "0":
        print(f"{BUILD_VAR}_CUDA=0: not prebuilding {cuda.NAME}")
    elif cuda.is_compatible():
        extensions.append(cuda.builder())
    else:
        print(f"{BUILD_VAR}=1: not prebuilding {cuda.NAME}: " + "; ".join(cuda.missing()))
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = op_extensions()

setup(
    name="ds-mtraining",
    version="0.1.0",
    description=("DeepSpeed extension for ultra-long-context training with distributed dynamic "
                 "sparse attention (MTraining)"),
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_mtraining", "ds_mtraining.*", "op_builder"]) + ["op_builder.csrc"],
    package_dir={"op_builder.csrc": "csrc"},
    package_data={"op_builder.csrc": CSRC_PATTERNS},
    install_requires=[
        # On CPU-only machines install the CPU build first (pip install torch==2.13.0, the build
        # these machines carry); this requirement is then already met and pip never pulls a
        # CUDA torch. On GPU machines install the CUDA torch of your choice first.
        "torch>=2.4",
        "deepspeed>=0.19",  # developed and tested with 0.19.8
        "pybind11",
        "ninja",
        "rich",
        "transformers",
        "datasets",
        "numpy",
        "matplotlib",  # the heatmap of `ds-mtraining balance`
    ],
    extras_require={
        # CUTLASS/CuTe headers for the CUDA kernels (`pip install nvidia-cutlass --no-deps` is
        # enough: only its headers are used)
        "cuda": ["nvidia-cutlass==4.2.0.0"],  # the CuTe wgmma atom names the kernels use
        "mpi": ["mpi4py"],
        "dev": ["pytest"],
    },
    entry_points={"console_scripts": ["ds-mtraining=ds_mtraining.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
