"""Process groups of an MTraining run, and the ``mpu`` object that ``deepspeed.initialize`` takes.

The world of ``W`` ranks is a grid of ``W / sp`` data-parallel replicas by ``sp`` sequence-parallel
ranks. A sequence-parallel group is ``sp`` consecutive global ranks (so with ``sp`` no larger than
a node it stays inside the node, where the ring's point-to-point traffic is fastest); a
data-parallel group is the ranks with the same position in every sequence-parallel group; the
sequence-data-parallel group (every rank that holds a full copy of the model) is the whole world.

DeepSpeed's engine reduces gradients over the sequence-data-parallel group and divides by the
data-parallel size only, i.e. it *sums* over the ranks of a sequence-parallel group: each rank's
loss must therefore be its share of the sequence's mean (see :mod:`ds_mtraining.loss`).

For the hierarchical ring, the inner (per node) and outer (across nodes) groups of every
sequence-parallel group are created by :func:`.topology.create_hierarchical_groups`
from the launcher's nodes x ranks-per-node topology.

Every rank creates every group, in the same order (``torch.distributed.new_group`` is collective),
with the ``timeout`` given (``new_group`` does not take the default group's: left out, each group
gets torch's default).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .topology import Topology, create_hierarchical_groups, local_world_size

RING_KINDS = ("flat", "hierarchical", "auto")


class ParallelConfigError(ValueError):
    """A sequence-parallel setting that cannot work with this world (raised before any group)."""


def check_parallel_sizes(world_size: int, sequence_parallel_size: int,
                         key: str = "mtraining.sequence_parallel_size"):
    """Raises :class:`ParallelConfigError` naming ``key`` unless ``sp`` is a positive divisor of
    the world size."""
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size < 1:
        raise ParallelConfigError(
            f"{key}={sequence_parallel_size!r} must be a positive integer (the number of ranks "
            f"that share one sequence); set it to a divisor of the world size {world_size}")
    if world_size % sequence_parallel_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ParallelConfigError(
            f"{key}={sequence_parallel_size} does not divide the world size {world_size} "
            f"(ranks started by the launcher); use one of {divisors} or launch a multiple of "
            f"{sequence_parallel_size} ranks")


def resolve_ring_kind(ring: str, sequence_parallel_size: int, ranks_per_node: int | None,
                      key: str = "mtraining.ring") -> str:
    """``auto`` becomes ``hierarchical`` when a sequence-parallel group spans more than one node,
    otherwise ``flat``; unknown names are an error naming ``key``."""
    if ring not in RING_KINDS:
        raise ParallelConfigError(f"{key}={ring!r} is not a ring kind; use one of {list(RING_KINDS)}")
    if ring != "auto":
        return ring
    spans_nodes = ranks_per_node is not None and sequence_parallel_size > ranks_per_node
    return "hierarchical" if spans_nodes else "flat"


@dataclass
class ParallelGroups:
    """The run's process groups; pass it as ``deepspeed.initialize(..., mpu=groups)``.

    Attributes:
        sequence_group: this rank's sequence-parallel group (the ring).
        data_group: this rank's data-parallel group.
        sequence_data_group: every rank holding a model replica (ZeRO partitions and reduces here).
        model_group: this rank alone (no tensor/pipeline model parallelism).
        ring: "flat" or "hierarchical".
        hierarchy: this rank's :class:`~ds_mtraining.distributed.topology.HierarchicalGroups` (inner and
            outer ring groups) for the hierarchical ring, or None for the flat ring.
    """

    sequence_parallel_size: int
    sequence_group: object
    data_group: object
    sequence_data_group: object
    model_group: object
    ring: str = "flat"
    hierarchy: object = None
    sequence_ranks: list = field(default_factory=list)
    data_ranks: list = field(default_factory=list)

    # ---- sequence parallel (DeepSpeed reads these to size its reductions)
    def get_sequence_parallel_group(self):
        return self.sequence_group

    def get_sequence_parallel_world_size(self) -> int:
        return dist.get_world_size(self.sequence_group)

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self.sequence_group)

    def get_sequence_data_parallel_group(self):
        return self.sequence_data_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.sequence_data_group)

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.sequence_data_group)

    # ---- data parallel
    def get_data_parallel_group(self):
        return self.data_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.data_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.data_group)

    def get_data_parallel_group_ranks(self) -> list:
        return list(self.data_ranks)

    # ---- model parallel: none, every rank is its own group of one
    def get_model_parallel_group(self):
        return self.model_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()


def initialize_groups(sequence_parallel_size: int, ring: str = "flat", ranks_per_node: int | None = None,
                      timeout=None) -> ParallelGroups:
    """Creates the groups for ``sequence_parallel_size`` (a divisor of the world size).

    ``ring`` is "flat", "hierarchical" or "auto" (hierarchical when a sequence-parallel group
    spans nodes of ``ranks_per_node`` ranks, default from the launcher's environment). A bad
    topology raises :class:`ParallelConfigError` before any group is created. ``timeout``
    (a ``timedelta``): how long a collective on any of the groups waits.
    Call after ``deepspeed.init_distributed()``; every rank must call it with the same arguments.
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_groups needs torch.distributed; call deepspeed.init_distributed() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    check_parallel_sizes(world, sequence_parallel_size)
    ranks_per_node = ranks_per_node if ranks_per_node is not None else local_world_size()
    ring = resolve_ring_kind(ring, sequence_parallel_size, ranks_per_node)
    sp = sequence_parallel_size
    sequence_rank_lists = [list(range(first, first + sp)) for first in range(0, world, sp)]
    topology = hierarchical_topology(world, ranks_per_node, sequence_rank_lists) if ring == "hierarchical" else None

    sequence_group = sequence_ranks = None
    for ranks in sequence_rank_lists:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            sequence_group, sequence_ranks = group, ranks
    data_group = data_ranks = None
    for offset in range(sp):
        ranks = list(range(offset, world, sp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            data_group, data_ranks = group, ranks
    model_group = None
    for single in range(world):
        group = dist.new_group([single], timeout=timeout)
        if single == rank:
            model_group = group
    sequence_data_group = dist.new_group(list(range(world)), timeout=timeout)

    hierarchy = None
    if topology is not None:
        hierarchy = create_hierarchical_groups(topology, sequence_rank_lists, timeout=timeout)
    return ParallelGroups(sp, sequence_group, data_group, sequence_data_group, model_group, ring,
                          hierarchy, sequence_ranks, data_ranks)


def hierarchical_topology(world: int, ranks_per_node: int | None, sequence_rank_lists: list[list[int]]):
    """The nodes x ranks-per-node topology for the hierarchical ring, validated against the
    sequence-parallel groups before any group is created."""
    try:
        topology = Topology.of_world(world, ranks_per_node or world)
        for ranks in sequence_rank_lists:
            topology.split(ranks)
    except ValueError as error:
        raise ParallelConfigError(f"mtraining.ring='hierarchical': {error}; or use mtraining.ring='flat'") from None
    return topology
