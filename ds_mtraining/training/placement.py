"""Where the demo's ranks run (``scripts/train_demo.sh``): the two ranks of its striped ring go on
two GPUs where at least two are usable, else on the CPU (gloo and the C++ op), so the main command
works on a laptop, a one-GPU box and a GPU server alike.

    eval "$(python -m ds_mtraining.training.placement)"

prints shell assignments: ``DEMO_ACCELERATOR`` (``cuda`` | ``cpu``), ``DEMO_CONFIG`` (the DeepSpeed
JSON for that device), ``DEMO_LINE`` (the first line the demo prints, naming the choice and why)
and ``DEMO_PORT`` (a free port for the launcher's rendezvous).
CPU ranks also get ``DS_ACCELERATOR=cpu``: DeepSpeed would otherwise pick CUDA on a one-GPU machine
and the second rank would find no GPU of its own.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

DEMO_RANKS = 2  # the demo's sequence-parallel ring: two ranks share each sequence
CPU_CONFIG = "ds_configs/cpu_demo.json"
GPU_CONFIG = "ds_configs/gpu_demo_bf16.json"  # the same run in bf16 (the CUDA op takes bf16/fp16)


@dataclass(frozen=True)
class Placement:
    accelerator: str  # "cuda" or "cpu"
    config: str
    line: str

    def shell(self, port: int) -> str:
        values = {"DEMO_ACCELERATOR": self.accelerator, "DEMO_CONFIG": self.config, "DEMO_LINE": self.line,
                  "DEMO_PORT": str(port)}
        return "\n".join(f"{name}={shlex.quote(value)}" for name, value in values.items())


def usable_gpus() -> int:
    """GPUs this process may use (``CUDA_VISIBLE_DEVICES`` respected); 0 without CUDA."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def demo_placement(gpus: int) -> Placement:
    """GPU ranks when ``gpus`` >= the demo's ranks, CPU ranks otherwise; the line says which and why."""
    if gpus >= DEMO_RANKS:
        return Placement("cuda", GPU_CONFIG, f"demo: {DEMO_RANKS} GPU ranks (NCCL, CUDA kernels, bf16) on GPUs "
                                             f"0-{DEMO_RANKS - 1} of {gpus}")
    found = "no GPU" if gpus == 0 else f"{gpus} GPU, the ring needs {DEMO_RANKS}"
    return Placement("cpu", CPU_CONFIG, f"demo: {DEMO_RANKS} CPU ranks (gloo, C++ kernels, fp32); {found}")


def main():
    from ds_mtraining.distributed.spawn import free_port
    print(demo_placement(usable_gpus()).shell(free_port()))


if __name__ == "__main__":
    main()
