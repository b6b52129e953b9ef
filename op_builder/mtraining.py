"""What the CPU and CUDA builders of the sparse attention op share.

Sources are resolved to absolute paths from this file (DeepSpeed resolves relative ones against its
own package). The C++/CUDA sources live in ``csrc/`` at the repository root; an installed
package ships the same tree as package data at ``ds_mtraining_op_builder/csrc`` (see setup.py),
so the op can be JIT-compiled both from a checkout and from a plain ``pip install .``.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

BUILD_VAR = "DS_BUILD_MTRAINING"
NO_JIT_VAR = "DS_MTRAINING_NO_JIT"
_HERE = Path(__file__).resolve().parent
_loaded_modules: dict[str, object] = {}  # op name -> its module, loaded once per process


def csrc_root() -> Path:
    """The shipped ``csrc`` (installed package) or the checkout's ``csrc`` (repository)."""
    for candidate in (_HERE / "csrc", _HERE.parent / "csrc"):
        if (candidate / "include" / "mtraining" / "pattern.h").is_file():
            return candidate
    raise FileNotFoundError(
        f"the ds-mtraining C++ sources (csrc/) are neither in {_HERE / 'csrc'} nor in "
        f"{_HERE.parent / 'csrc'}; reinstall the package")


def extension_root() -> str:
    """Where JIT builds are cached: TORCH_EXTENSIONS_DIR, else torch's per-user default."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return os.path.join(get_default_build_root(),
                        f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}")


class MTrainingBuilderMixin:
    """Naming, paths and prebuilt-first loading; mixed in before a DeepSpeed builder class.

    ``load()`` imports the module that ``DS_BUILD_MTRAINING=1 pip install`` placed in the
    package and otherwise JIT-compiles it (cached in TORCH_EXTENSIONS_DIR). With
    ``DS_MTRAINING_NO_JIT=1`` a missing prebuilt op is an error instead of a compilation.
    """

    BUILD_VAR = BUILD_VAR
    NAME = ""
    TYPICAL_BUILD = ""  # how long a JIT build took where it was measured (said before one starts)
    DEVICE_TYPE = ""
    SOURCES_HINT = ""  # the source files, relative to csrc/, for error messages

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        return f"ds_mtraining.{self.NAME}_op"

    def include_paths(self) -> list[str]:
        return [str(csrc_root() / "include")]

    def missing(self) -> list[str]:
        """Why this op cannot be built here (empty when it can)."""
        reasons = []
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            reasons.append(f"no C++ compiler: '{os.environ.get('CXX', 'c++')}' is not on PATH "
                           f"(install g++)")
        if not self.sources():
            reasons.append(f"no sources: {self.SOURCES_HINT} not found in {csrc_root()}")
        return reasons

    def missing_for_jit(self) -> list[str]:
        """Why this op cannot be JIT-compiled in this process (empty when it can)."""
        reasons = self.missing()
        try:
            from torch.utils.cpp_extension import verify_ninja_availability
            verify_ninja_availability()
        except RuntimeError:
            reasons.append("ninja is not installed (pip install ninja)")
        return reasons

    def is_compatible(self, verbose=False) -> bool:
        reasons = self.missing()
        if reasons and verbose:
            self.warning(f"{self.NAME} cannot be built: " + "; ".join(reasons))
        return not reasons

    def prebuilt_available(self) -> bool:
        """Whether a prebuilt module of this op is installed (it is not imported here)."""
        try:
            return importlib.util.find_spec(self.absolute_name()) is not None
        except ImportError:
            return False

    def jit_build_dir(self) -> str:
        return os.path.join(extension_root(), self.NAME)

    def jit_library(self) -> str:
        """The shared library a JIT build leaves in its cache directory."""
        return os.path.join(self.jit_build_dir(), f"{self.NAME}.so")

    def load(self, verbose=False):
        """The compiled module: already loaded, else prebuilt, else JIT-compiled."""
        if self.NAME not in _loaded_modules:
            module = self._prebuilt_module()
            if module is None:
                return self.jit_load(verbose)
            _loaded_modules[self.NAME] = module
        return _loaded_modules[self.NAME]

    def _prebuilt_module(self):
        """The prebuilt module, or None when there is none or it does not import."""
        if not self.prebuilt_available():
            return None
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError as err:  # e.g. built against another torch
            if os.environ.get(NO_JIT_VAR) == "1":
                raise RuntimeError(f"the prebuilt {self.NAME} op does not import ({err}) and "
                                   f"{NO_JIT_VAR}=1 forbids compiling it") from err
            self.warning(f"prebuilt {self.absolute_name()} does not import ({err}); "
                         f"JIT-compiling it instead")
            return None

    def jit_load(self, verbose=True):
        """DeepSpeed's JIT build (cached in TORCH_EXTENSIONS_DIR), unless ``DS_MTRAINING_NO_JIT=1``
        forbids it; :meth:`load` then reuses the module."""
        if os.environ.get(NO_JIT_VAR) == "1":
            raise RuntimeError(
                f"the {self.NAME} op is not prebuilt and {NO_JIT_VAR}=1 forbids compiling it; "
                f"install with {BUILD_VAR}=1 pip install --no-build-isolation . or unset "
                f"{NO_JIT_VAR}")
        reasons = self.missing_for_jit()
        if reasons:
            raise RuntimeError(f"cannot JIT-compile the {self.NAME} op: " + "; ".join(reasons))
        announce = not verbose and not os.path.exists(self.jit_library())
        if announce:
            print(f"ds_mtraining: compiling the {self.NAME} op once ({self.TYPICAL_BUILD}; cached in "
                  f"{self.jit_build_dir()}) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        with self._build_lock():
            _loaded_modules[self.NAME] = super().jit_load(verbose)
        if announce:
            print(f"ds_mtraining: compiled the {self.NAME} op in {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
        return _loaded_modules[self.NAME]

    @contextlib.contextmanager
    def _build_lock(self):
        """Holds ``<cache>/<op>.flock`` (an flock: the kernel releases it when its holder dies)
        around torch's JIT load. torch's own lock is a plain file (``<op>/lock``) that a process
        killed while building or checking the op leaves behind, and every later load then waits
        for it forever; whoever holds the flock knows no live process of ours is building, so
        that file is stale and goes."""
        os.makedirs(extension_root(), exist_ok=True)
        with open(os.path.join(extension_root(), f"{self.NAME}.flock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                stale = os.path.join(self.jit_build_dir(), "lock")
                if os.path.exists(stale):
                    self.warning(f"removing {stale}, left by a process killed while loading the op")
                    os.remove(stale)
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    @staticmethod
    def _sorted_glob(*patterns: str) -> list[str]:
        return sorted(path for pattern in patterns for path in glob.glob(pattern))
