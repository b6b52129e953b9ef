"""Where the demo's ranks run (``scripts/train_demo.sh``): the two ranks of its striped ring go on
two GPUs where at least two are usable, else on the CPU (gloo and the C++ op), so the main command
works on a laptop, a one-GPU box and a GPU server alike.

    settings="$(python -m ds_mtraining.training.placement SAVE_DIR [the demo's extra options])"

prints shell assignments: ``DEMO_ACCELERATOR`` (``cuda`` | ``cpu``), ``DEMO_CONFIG`` (the DeepSpeed
JSON for that device), ``DEMO_LINE`` (the first line the demo prints, naming the choice and why)
and ``DEMO_PORT`` (a free port for the launcher's rendezvous).
CPU ranks also get ``DS_ACCELERATOR=cpu``: DeepSpeed would otherwise pick CUDA on a one-GPU machine
and the second rank would find no GPU of its own.

Where SAVE_DIR holds an earlier run and the options have neither ``--resume`` nor ``--overwrite``,
it prints instead the demo's one line saying so, in the demo's terms (``SAVE_DIR``), and exits 2:
before any launch, so neither the launcher's lines nor a second copy of the ranks' refusal follow.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

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


def name_accelerator() -> bool:
    """DeepSpeed picks CUDA where torch sees a GPU, else the CPU, with a warning from every process
    that imports it ("Setting accelerator to CPU. If you have GPU or other accelerator, we were
    unable to detect it."): named before DeepSpeed loads, the warning goes. The ops are CPU and
    CUDA only, so no other accelerator is passed over. A ``DS_ACCELERATOR`` already set stays.
    Returns whether it named it."""
    if "DS_ACCELERATOR" in os.environ or usable_gpus() > 0:
        return False
    os.environ["DS_ACCELERATOR"] = "cpu"
    return True


def demo_placement(gpus: int) -> Placement:
    """GPU ranks when ``gpus`` >= the demo's ranks, CPU ranks otherwise; the line says which and why."""
    if gpus >= DEMO_RANKS:
        return Placement("cuda", GPU_CONFIG, f"demo: {DEMO_RANKS} GPU ranks (NCCL, CUDA kernels, bf16) on GPUs "
                                             f"0-{DEMO_RANKS - 1} of {gpus}")
    found = "no GPU" if gpus == 0 else f"{gpus} GPU, the ring needs {DEMO_RANKS}"
    return Placement("cpu", CPU_CONFIG, f"demo: {DEMO_RANKS} CPU ranks (gloo, C++ kernels, fp32); {found}")


def earlier_run_line(save_dir: str, config: str, options: list[str]) -> str | None:
    """The demo's refusal of an earlier run in ``save_dir`` (see the module docstring), or None."""
    from .checkpoint import TAG, earlier_run, refusal
    from .progress import monitor_dir, with_default_monitor
    parser = argparse.ArgumentParser(allow_abbrev=False)  # the options ds_mtraining.train reads the same way
    parser.add_argument("--save_dir", default=save_dir)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    args, _ = parser.parse_known_args(options)
    if args.resume or args.overwrite:
        return None
    metrics = monitor_dir(with_default_monitor(json.loads(Path(config).read_text()), args.save_dir))
    found = earlier_run(args.save_dir, metrics)
    if found is None:
        return None
    latest = Path(args.save_dir) / "latest"
    tag = latest.read_text().strip() if latest.is_file() else ""
    resume = "--resume" + (f" (e.g. --resume --steps {2 * int(tag[4:])})" if TAG.fullmatch(tag) else "")
    return "demo: " + refusal(args.save_dir, found, resume, "set SAVE_DIR=runs/other")


def main(argv: list[str] | None = None):
    from ds_mtraining.distributed.spawn import free_port
    save_dir, *options = sys.argv[1:] if argv is None else argv
    name_accelerator()  # its stdout is the shell's to read: no DeepSpeed warning in it
    placement = demo_placement(usable_gpus())
    refused = earlier_run_line(save_dir, placement.config, options)
    if refused is not None:
        print(refused, file=sys.stderr)
        sys.exit(2)
    print(placement.shell(free_port()))


if __name__ == "__main__":
    main()
