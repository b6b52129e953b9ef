"""Run a function on ``world_size`` local ranks (gloo on CPU, or NCCL with one GPU each), with a
deadline: tests and small demos.

A rank that hangs (a deadlocked collective) or dies makes :func:`run_on_ranks` raise instead of
waiting forever; the others are killed.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# How ranks start: "spawn" (a fresh interpreter each) or "forkserver" (forked from one server
# process that imported torch once: much cheaper when one parent starts many groups, as the tests do).
START_METHOD = "spawn"


_shutdown_hooks: list = []


def on_shutdown(hook) -> None:
    """Registers ``hook()`` to run in :func:`shutdown` before the process group is destroyed
    (once per hook; in registration order): how a module above this one, such as the estimator's
    CUDA graphs (:mod:`ds_mtraining.estimator.graphs`), releases what holds the group, without
    this module importing it."""
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)


def shutdown() -> None:
    """Runs the :func:`on_shutdown` hooks (the estimator's CUDA graphs are reset there: a live
    graph with NCCL collectives makes ``destroy_process_group`` hang), then destroys the default
    process group. No-op for the group when none exists."""
    for hook in _shutdown_hooks:
        hook()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """An unused TCP port on localhost (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_taken(output: str) -> bool:
    """Whether a launch's output says its rendezvous port was taken (another process bound it
    between :func:`free_port` and the launch): the one failure worth a retry on a new port."""
    return "EADDRINUSE" in output or "Address already in use" in output


def _rank_main(rank, world_size, port, fn, args, result_dir, timeout, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # ranks usually outnumber this machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # collectives time out too, so a rank stuck in a mismatched collective errors instead of hanging
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        shutdown()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo") -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (``backend`` gloo,
    or nccl with GPU ``rank`` each) and returns their results (picklable, saved with
    ``torch.save``) in rank order.

    ``fn`` must be importable (a module-level function). Raises ``TimeoutError`` if the ranks do
    not finish within ``timeout`` seconds and re-raises the first rank failure; ranks whose
    rendezvous port was taken meanwhile (EADDRINUSE) run once more on a fresh port."""
    try:
        return _run_on_ranks_once(fn, world_size, args, timeout, backend)
    except mp.ProcessRaisedException as error:
        if not port_taken(str(error)):
            raise
        return _run_on_ranks_once(fn, world_size, args, timeout, backend)


def _run_on_ranks_once(fn, world_size: int, args: tuple, timeout: float, backend: str) -> list:
    with tempfile.TemporaryDirectory() as result_dir:
        # CUDA ranks start from a fresh interpreter: a forked one cannot initialise CUDA
        method = "spawn" if backend == "nccl" else START_METHOD
        context = mp.start_processes(_rank_main,
                                     args=(world_size, free_port(), fn, args, result_dir, timeout, backend),
                                     nprocs=world_size, join=False, start_method=method)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish "
                                       f"within {timeout:.0f} s (a hang?)")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(os.path.join(result_dir, f"rank{rank}.pt"), weights_only=False)
                for rank in range(world_size)]
