"""The fused distributed estimator replayed from a CUDA graph.

Why: :func:`~ds_mtraining.estimator.distributed.estimate_vertical_slash_cuda_distributed` is host-bound.
At 128K on two H200s its GPU work is ~0.25 ms, but the host issues ~100 launches and four
collectives per call, and each rank's collectives wait for the slower host. A graph per input
shape records all of them once; each later call copies its inputs into the graph's static
buffers (the keys and the last queries this rank holds), replays with one launch and clones the
index out (the next replay overwrites the graph's outputs).

Per shape (and config, group, scale): the first call runs eagerly (it also sets up the NCCL
communicators, which a capture cannot), the second captures and replays, later calls replay.
Every rank of the group makes the same calls in the same order (the estimator is collective), so
the ranks capture and replay in step. Capture and replay never synchronise with the host.
``DS_MTRAINING_ESTIMATOR_GRAPHS=0`` turns the graphs off (every call eager).

A captured NCCL collective keeps its communicator busy: ``destroy_process_group`` hangs while
such a graph lives (pytorch/pytorch#115388). :func:`release` resets the graphs first;
:func:`ds_mtraining.distributed.shutdown` runs it (registered below with
:func:`~ds_mtraining.distributed.on_shutdown`) before it destroys the group.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

from ..config import SparseConfig
from ..distributed import on_shutdown
from ..distributed.comm import RingComm
from ..index import SparseIndex
from .distributed import estimate_from_held_queries, held_estimator_queries
from .fused import trusted_index

MAX_GRAPHS = 8  # shapes kept (training uses one per sequence length; each holds its buffers)
ENV = "DS_MTRAINING_ESTIMATOR_GRAPHS"


def graphs_enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class EstimatorGraph:
    """One captured estimation: static inputs ``held`` and ``k``, outputs in the graph's pool."""

    def __init__(self, held: torch.Tensor, k: torch.Tensor, config: SparseConfig, comm: RingComm,
                 scale: float):
        self.held, self.k = held.clone(), k.clone()
        self.seq_len, self.block_size = k.shape[1] * comm.world, config.block_size
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device=k.device)
        stream.wait_stream(torch.cuda.current_stream(k.device))
        with torch.cuda.stream(stream):
            # thread_local: the NCCL watchdog thread may touch CUDA during the capture
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                index = estimate_from_held_queries(self.held, self.k, config, comm, scale)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(k.device).wait_stream(stream)
        self.outputs = (index.slash, index.slash_count, index.vertical, index.vertical_count)

    def __call__(self, held: torch.Tensor, k: torch.Tensor) -> SparseIndex:
        self.held.copy_(held)
        self.k.copy_(k)
        self.graph.replay()
        return trusted_index(*(t.clone() for t in self.outputs), self.seq_len, self.block_size)


_seen: set = set()
_graphs: OrderedDict = OrderedDict()


@torch.no_grad()  # q, k require grad in training: the static buffers and the graph must not
def captured_estimate(q: torch.Tensor, k: torch.Tensor, config: SparseConfig, comm: RingComm,
                      scale: float) -> SparseIndex:
    """The fused distributed estimation of the shards ``q``/``k``, from this shape's graph
    (eager on a shape's first call). Collective, like the eager path."""
    held = held_estimator_queries(q, k, config, comm)
    key = (tuple(held.shape), tuple(k.shape), k.dtype, k.device, config, id(comm.group), comm.rank, scale)
    graph = _graphs.get(key)
    if graph is None:
        if key not in _seen:
            _seen.add(key)
            return estimate_from_held_queries(held, k, config, comm, scale)
        graph = _graphs[key] = EstimatorGraph(held, k, config, comm, scale)
        while len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
    _graphs.move_to_end(key)
    return graph(held, k)


def captures() -> int:
    """Graphs held now (tests)."""
    return len(_graphs)


def release() -> None:
    """Reset and drop every graph and its buffers: before the process group is destroyed, or when
    a process changes shapes for good."""
    for graph in _graphs.values():
        graph.graph.reset()
    _graphs.clear()
    _seen.clear()


on_shutdown(release)  # before the process group is destroyed
