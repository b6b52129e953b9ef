"""Installs ds-mtraining (the package, its DeepSpeed op builders and the C++/CUDA sources).

    pip install -e .                # the ops JIT-compile on first use (cached in TORCH_EXTENSIONS_DIR)
    DS_BUILD_MTRAINING=1 pip install --no-build-isolation .
                                    # prebuilds the CPU op (and the CUDA op where CUDA is usable)
                                    # into the package, DeepSpeed style: no compilation at import
                                    # (DS_BUILD_MTRAINING_CUDA=0 skips the CUDA op)

Prebuilding imports torch and deepspeed, so they must already be installed and pip must not
isolate the build. The ``op_builder/`` folder installs as the package ``ds_mtraining_op_builder``
(not ``op_builder``, DeepSpeed's own name); the sources ship inside it as
``ds_mtraining_op_builder/csrc`` (package data), so an install without prebuilt ops can still
JIT-compile them.
"""
import importlib.util
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
OP_BUILDER = "ds_mtraining_op_builder"
CSRC_PATTERNS = ["**/*.h", "**/*.hpp", "**/*.cpp", "**/*.cu", "**/*.cuh"]


def op_builder_shared():
    """``op_builder/mtraining.py`` alone (standard library imports only, so no torch or deepspeed
    is needed to read it): where the prebuild variable's name is defined."""
    path = os.path.join(HERE, "op_builder", "mtraining.py")
    spec = importlib.util.spec_from_file_location(f"{OP_BUILDER}_shared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD_VAR = op_builder_shared().BUILD_VAR  # DS_BUILD_MTRAINING


def import_op_builder():
    """``op_builder/`` imported under its installed name (it is not installed yet while building)."""
    spec = importlib.util.spec_from_file_location(OP_BUILDER, os.path.join(HERE, "op_builder", "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[OP_BUILDER] = module
    spec.loader.exec_module(module)
    return module


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
    op_builder = import_op_builder()

    cpu = op_builder.MTrainingCPUBuilder()
    if not cpu.is_compatible(verbose=True):
        raise SystemExit(f"{BUILD_VAR}=1: cannot build {cpu.NAME}: " + "; ".join(cpu.missing()))
    extensions = [cpu.builder()]
    cuda = op_builder.MTrainingCUDABuilder()
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
    packages=find_packages(include=["ds_mtraining", "ds_mtraining.*"]) + [OP_BUILDER, f"{OP_BUILDER}.csrc"],
    package_dir={OP_BUILDER: "op_builder", f"{OP_BUILDER}.csrc": "csrc"},
    package_data={f"{OP_BUILDER}.csrc": CSRC_PATTERNS},
    install_requires=[
        # Tested ranges: the GPU machine (torch 2.11, transformers 5.17) and CI (torch 2.13,
        # deepspeed 0.19.8, transformers 5.24, datasets 5.2).
        # On CPU-only machines install the CPU build first (pip install torch==2.13.0, the build
        # these machines carry); this requirement is then already met and pip never pulls a
        # CUDA torch. On GPU machines install the CUDA torch of your choice first.
        "torch>=2.11,<2.14",
        "deepspeed>=0.19.8,<0.20",
        "pybind11",
        "ninja",
        "rich",
        "transformers>=5.17,<5.25",
        "datasets>=5.2,<5.3",
        "numpy",
        "matplotlib",  # the heatmap of `ds-mtraining balance`
    ],
    extras_require={
        # CUTLASS/CuTe headers for the CUDA kernels (`pip install nvidia-cutlass --no-deps` is
        # enough: only its headers are used)
        "cuda": ["nvidia-cutlass==4.2.0.0"],  # the CuTe wgmma atom names the kernels use
        "mpi": ["mpi4py"],
        "dev": ["pytest", "accelerate>=1.10"],  # accelerate: the HF Trainer example and its test
    },
    entry_points={"console_scripts": ["ds-mtraining=ds_mtraining.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
