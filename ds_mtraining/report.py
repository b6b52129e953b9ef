"""``ds-mtraining report`` / ``python -m ds_mtraining.report``: like DeepSpeed's ``ds_report``.

Says for each sparse attention op whether it is prebuilt (installed with DS_BUILD_MTRAINING=1),
JIT-compilable here, or incompatible and why, and lists the tools and versions that decide it.
Nothing is compiled.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _version_line(command: list[str], containing: str = "") -> str:
    """The first output line of ``command`` that holds ``containing``."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"not runnable ({err})"
    lines = [line.strip() for line in (result.stdout or result.stderr).splitlines()
             if line.strip() and containing in line]
    return lines[0] if lines else f"exit {result.returncode}"


def _tool(command: str, containing: str = "") -> tuple[str, str]:
    """(status, detail) of a build tool: where it is and its version."""
    path = shutil.which(command)
    if path is None:
        return "[red]missing[/]", f"'{command}' is not on PATH"
    return "[green]found[/]", f"{path}: {_version_line([path, '--version'], containing)}"


def op_status(builder) -> tuple[str, str]:
    """(status, detail) of one op builder: prebuilt, JIT-compilable or incompatible."""
    if builder.prebuilt_available():
        try:
            module = importlib.import_module(builder.absolute_name())
        except ImportError as err:
            return "[red]prebuilt, broken[/]", f"{builder.absolute_name()} does not import: {err}"
        return "[green]prebuilt[/]", module.__file__
    reasons = builder.missing_for_jit()
    if reasons:
        return "[red]incompatible[/]", "; ".join(reasons)
    cached = os.path.exists(builder.jit_library())
    detail = f"cached build in {builder.jit_build_dir()}" if cached else \
        f"compiles on first use into {builder.jit_build_dir()}"
    return "[yellow]JIT-compilable[/]", detail


def environment_rows(named: bool = False) -> list[tuple[str, str, str]]:
    """(item, status, detail) rows of the versions and tools the ops depend on; ``named``: this
    process named DeepSpeed's accelerator (:func:`ds_mtraining.training.placement.name_accelerator`)."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import CUDA_HOME

    from ds_mtraining_op_builder import NO_JIT_VAR, csrc_root, extension_root
    from ds_mtraining_op_builder.cuda import cutlass_include

    cuda = torch.version.cuda or "none (CPU build)"
    devices = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else "no CUDA device visible"
    cutlass = cutlass_include()
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR")
    rows = [
        ("torch", "", f"{torch.__version__} (CUDA {cuda}); {torch.get_num_threads()} CPU threads"),
        ("deepspeed", "", deepspeed.__version__),
        ("DeepSpeed accelerator", "", get_accelerator().device_name() + (
            " (no CUDA device: named DS_ACCELERATOR=cpu here, in place of DeepSpeed's 'Setting accelerator to "
            "CPU' warning)" if named else f" (DS_ACCELERATOR={os.environ['DS_ACCELERATOR']})"
            if "DS_ACCELERATOR" in os.environ else " (detected by DeepSpeed)")),
        ("CUDA devices", "", devices),
        ("ninja", *_tool("ninja")),
        ("C++ compiler", *_tool(os.environ.get("CXX", "c++"))),
        ("nvcc", *_tool(os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else "nvcc", "release")),
        ("CUDA_HOME (torch)", "", CUDA_HOME or "none (torch is a CPU build or no toolkit found)"),
        ("CUTLASS/CuTe headers", "[green]found[/]" if cutlass else "[red]missing[/]",
         cutlass or "pip install nvidia-cutlass --no-deps (needed when CUDA sources include them)"),
        ("C++/CUDA sources", "", str(csrc_root())),
        ("TORCH_EXTENSIONS_DIR", "",
         extensions if extensions else f"unset; JIT builds go to {extension_root()}"),
        (NO_JIT_VAR, "", os.environ.get(NO_JIT_VAR, "unset (JIT allowed)")),
        ("liger-kernel", *_optional_package("liger_kernel", "pip install liger-kernel: its fused RMSNorm, RoPE, "
                                            "SwiGLU and loss on GPUs (mtraining.liger)")),
    ]
    return rows


def _optional_package(name: str, absent: str) -> tuple[str, str]:
    """(status, detail) of an optional package: its version, or what it would bring."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return "[green]found[/]", version(name.replace("_", "-"))
    except PackageNotFoundError:
        return "[yellow]optional[/]", absent


def build_tables(named: bool = False) -> list[Table]:
    from ds_mtraining_op_builder import ALL_BUILDERS

    ops = Table(title="ds-mtraining ops", title_justify="left")
    for column in ("op", "device", "status", "detail"):
        ops.add_column(column, overflow="fold")
    for builder_class in ALL_BUILDERS:
        builder = builder_class()
        status, detail = op_status(builder)
        ops.add_row(builder.NAME, builder.DEVICE_TYPE, status, escape(detail))
    environment = Table(title="environment", title_justify="left")
    for column in ("item", "status", "detail"):
        environment.add_column(column, overflow="fold")
    for item, status, detail in environment_rows(named):
        environment.add_row(item, status, escape(detail))
    return [ops, environment]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ds-mtraining report",
        description="Which sparse attention ops are prebuilt, JIT-compilable or incompatible, and why.")
    parser.parse_args(argv)
    from ds_mtraining.training.placement import name_accelerator
    named = name_accelerator()  # before DeepSpeed loads
    console = Console()
    for table in build_tables(named):
        console.print(table)
    console.print("prebuild: DS_BUILD_MTRAINING=1 pip install --no-build-isolation .   "
                  "(otherwise ops JIT-compile on first use)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
