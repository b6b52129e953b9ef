"""Nodes x GPUs-per-node topology of a sequence-parallel group, and its inner/outer ring groups.

A sequence-parallel (SP) group of W = N x G ranks spans N nodes with G of its ranks on each.
Its ring position ``p = node_index * G + local_index`` is the stripe rank (rank ``p`` holds global
blocks p, p + W, ...). The hierarchical ring (the paper's Algorithm 2) runs

* an **inner** ring over the G ranks of one node (NVLink), one group per node, and
* an **outer** ring over the N ranks with the same local index (InfiniBand), one group per
  local index,

each created once with ``dist.new_group`` by every rank of the world in the same order.
Example, 2 nodes x 2 GPUs, SP group = the world::

    node 0: ranks 0 1   inner groups: [0, 1], [2, 3]
    node 1: ranks 2 3   outer groups: [0, 2], [1, 3]
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist



def local_world_size() -> int | None:
    """Ranks per node as the launcher reported it (DeepSpeed's ``LOCAL_SIZE``, torchrun's
    ``LOCAL_WORLD_SIZE``, Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``), or None if none did."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """(host, slots) per line of a DeepSpeed/OpenMPI hostfile (``host slots=N``; # comments)."""
    hosts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            slots = [p for p in parts[1:] if p.startswith("slots=")]
            if len(slots) != 1 or not slots[0][6:].isdigit() or int(slots[0][6:]) < 1:
                raise ValueError(f"{path}:{number}: expected 'HOST slots=N' with N >= 1, got {line!r}")
            hosts.append((parts[0], int(slots[0][6:])))
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts")
    return hosts


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``per_node`` ranks; global rank ``g`` sits on node ``g // per_node``."""

    nodes: int
    per_node: int

    def __post_init__(self):
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError(f"a topology needs nodes >= 1 and per_node >= 1, got {self.nodes} x {self.per_node}")

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @classmethod
    def from_env(cls, world_size: int | None = None, hostfile: str | None = None) -> "Topology":
        """From the launcher: a hostfile's slots (all nodes must have the same number), else the
        ranks per node that the launcher exported (:func:`local_world_size`),
        checked against WORLD_SIZE."""
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        if hostfile:
            slots = {s for _, s in read_hostfile(hostfile)}
            if len(slots) != 1:
                raise ValueError(f"hostfile {hostfile}: every node needs the same slots, got {sorted(slots)}")
            per_node = slots.pop()
        else:
            per_node = local_world_size() or world
        return cls.of_world(world, per_node)

    @classmethod
    def of_world(cls, world: int, per_node: int) -> "Topology":
        """``world`` ranks as whole nodes of ``per_node`` (ValueError if they are not)."""
        if world % per_node:
            raise ValueError(f"the world of {world} ranks is not whole nodes of {per_node} ranks; "
                             f"check LOCAL_WORLD_SIZE / the hostfile's slots (the same on every node)")
        return cls(world // per_node, per_node)

    def split(self, ranks: list[int]) -> list[list[int]]:
        """The SP group's ranks per node (node order, each ascending), validated: the group must
        lie inside one node or hold the same number of ranks on each node it touches."""
        ranks = sorted(ranks)
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.world or len(set(ranks)) != len(ranks):
            raise ValueError(f"sequence-parallel ranks {ranks} are not distinct ranks of a world of {self.world}")
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(r // self.per_node, []).append(r)
        counts = {len(v) for v in by_node.values()}
        if len(counts) != 1:
            raise ValueError(
                f"sequence-parallel ranks {ranks} straddle nodes unevenly "
                f"({ {n: len(v) for n, v in by_node.items()} } ranks per node with {self.per_node} "
                f"per node); use a group inside one node or the same number of ranks on every node")
        return [by_node[n] for n in sorted(by_node)]


@dataclass
class HierarchicalGroups:
    """This rank's view of the hierarchical ring: its inner and outer groups and ring position."""

    inner: object
    outer: object
    nodes: int
    per_node: int
    node_index: int
    local_index: int

    @property
    def position(self) -> int:
        """Ring position = stripe rank in the SP group."""
        return self.node_index * self.per_node + self.local_index


def create_hierarchical_groups(topology: Topology, sp_groups: list[list[int]], backend=None, timeout=None):
    """Creates, once and in the same order on every rank, the inner and outer groups of every SP
    group (``sp_groups`` partitions the ranks; collectives wait ``timeout``), and returns this
    rank's :class:`HierarchicalGroups` (``None`` if this rank is in none). All validation happens
    before any communication."""
    layouts = [topology.split(group) for group in sp_groups]
    me = dist.get_rank()
    mine = None
    for nodes in layouts:
        for node_index, node_ranks in enumerate(nodes):
            group = dist.new_group(node_ranks, backend=backend, timeout=timeout)
            if me in node_ranks:
                inner, node_of_me, local_of_me = group, node_index, node_ranks.index(me)
        for local_index in range(len(nodes[0])):
            outer_ranks = [node_ranks[local_index] for node_ranks in nodes]
            group = dist.new_group(outer_ranks, backend=backend, timeout=timeout)
            if me in outer_ranks:
                mine = HierarchicalGroups(inner, group, len(nodes), len(nodes[0]), node_of_me, local_of_me)
    return mine
