"""Builder of the C++/OpenMP CPU sparse attention kernels (csrc/cpu)."""
from __future__ import annotations

import platform

from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

from .mtraining import MTrainingBuilderMixin, csrc_root


class MTrainingCPUBuilder(MTrainingBuilderMixin, CPUOpBuilder):
    """Compiles ``csrc/cpu/*.cpp`` into ``ds_mtraining.mtraining_cpu_op``.

    Built for the host CPU (``-march=native``, like DeepSpeed's CPU ops): a prebuilt op is for
    the machine, or one of the same instruction set, that built it.
    """

    NAME = "mtraining_cpu"
    DEVICE_TYPE = "cpu"
    SOURCES_HINT = "cpu/*.cpp"
    TYPICAL_BUILD = "about 25 s on 2 CPU cores"

    def sources(self) -> list[str]:
        return self._sorted_glob(str(csrc_root() / "cpu" / "*.cpp"))

    def cxx_args(self) -> list[str]:
        # no -ffast-math: the kernels rely on -inf for rows that see no key
        return ["-O3", self.cpu_arch(), "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]

    def cpu_arch(self) -> str:
        # DeepSpeed's answer, without the py-cpuinfo probe it runs first (~1.5 s of CPU in every
        # process that loads the op, every launched rank among them)
        machine = platform.machine().lower()
        if machine.startswith(("ppc", "powerpc")):
            return "-mcpu=native"  # gcc has no -march on PowerPC
        return "-march=rv64gc" if machine.startswith("riscv64") else "-march=native"

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]

    def builder(self):
        # DeepSpeed's CPUOpBuilder.builder() drops extra_ldflags; OpenMP must be linked
        extension = super().builder()
        extension.extra_link_args = list(extension.extra_link_args) + self.extra_ldflags()
        return extension
