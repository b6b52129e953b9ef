"""DeepSpeed's CPU shared-memory allreduce leaves one buffer per rank in /dev/shm.

On a CPU accelerator with every rank on one host, ``deepspeed.init_distributed`` creates
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (its allreduce
workspace) in each rank, maps every other rank's, and never unlinks them: each launch
leaves its buffers behind, and on a small machine they pile up until memory runs short. Once
every rank has mapped every buffer the names are no longer needed (the mappings stay valid), so
each rank unlinks its own after a barrier."""
from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def shm_buffer_path(rank: int) -> Path:
    """This launch's buffer of ``rank`` (the name DeepSpeed's shm op gives it)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffer():
    """After ``deepspeed.init_distributed()`` on every rank of a CPU run: a barrier (every rank has
    mapped every buffer), then this rank's buffer name goes. Other accelerators make none."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":  # the same answer on every rank: no lone barrier
        return
    dist.barrier()
    shm_buffer_path(dist.get_rank()).unlink(missing_ok=True)
