"""Who holds which keys at each ring step, and the K/V rotation that gets them there."""
from __future__ import annotations

from ..index import Stripe
from ..distributed.comm import KV_TAG, RingComm
from ..distributed.topology import HierarchicalGroups


class RingSchedule:
    """An inner ring over the ranks of one node nested in an outer ring over the nodes (the
    paper's Algorithm 2). The flat ring is one node (no outer ring).

    Ring position ``p = node * G + local`` is the stripe rank. At outer step ``o`` and inner step
    ``i`` position (n, l) holds the K/V of position ((n - o) mod N, (l - i) mod G), so over the
    N x G steps every (query rank, key rank) pair meets exactly once::

        2 nodes x 2, position 0:  o=0: keys of 0, 1 (inner ring)   o=1: keys of 2, 3
    """

    def __init__(self, inner: RingComm, outer: RingComm | None = None):
        self.inner, self.outer = inner, outer
        self.per_node = inner.world
        self.nodes = outer.world if outer is not None else 1
        self.node = outer.rank if outer is not None else 0
        self.world = self.nodes * self.per_node
        self.position = self.node * self.per_node + inner.rank

    def stripe(self, outer_step: int, inner_step: int) -> Stripe:
        key_node = (self.node - outer_step) % self.nodes
        key_local = (self.inner.rank - inner_step) % self.per_node
        return Stripe(self.world, self.position, key_node * self.per_node + key_local)

    def kv_steps(self, k, v, reverse: bool = False):
        """Yields ``(outer_step, inner_step, stripe, k, v)`` for every ring step: the K/V this rank
        holds then. The next inner step's K/V travel during each step, and the next node's K/V
        (outer ring) during the whole inner ring; a consumer's work between two yields overlaps
        them.

        ``reverse`` (the backward ring): the same steps in reverse order, starting from the K/V
        this rank held at the forward's last step (outer ``N - 1``, inner ``G - 1``: those of
        position ``(node + 1, local + 1)``), so the first step needs no transfer and the last one
        is the local pair; K/V then travel the other way round both rings."""
        outer_steps = reversed(range(self.nodes)) if reverse else range(self.nodes)
        inner_steps = list(reversed(range(self.per_node)) if reverse else range(self.per_node))
        for n, outer_step in enumerate(outer_steps):
            next_node_kv = (self.outer.rotate([k, v], KV_TAG, reverse=reverse)
                            if n + 1 < self.nodes else None)
            inner_k, inner_v = k, v
            for i, inner_step in enumerate(inner_steps):
                pending = (self.inner.rotate([inner_k, inner_v], KV_TAG, reverse=reverse)
                           if i + 1 < self.per_node else None)
                yield outer_step, inner_step, self.stripe(outer_step, inner_step), inner_k, inner_v
                if pending is not None:
                    inner_k, inner_v = pending.wait()
            if next_node_kv is not None:
                k, v = next_node_kv.wait()


def ring_schedule(comm: RingComm, hierarchy: HierarchicalGroups | None) -> RingSchedule:
    """The flat ring of ``comm``, or the hierarchical one over ``hierarchy``'s inner and outer
    groups, checked to tile ``comm``'s group with ring positions equal to the group ranks (the
    stripe)."""
    if hierarchy is None:
        return RingSchedule(comm)
    if (hierarchy.nodes * hierarchy.per_node, hierarchy.position) != (comm.world, comm.rank):
        raise ValueError(
            f"the hierarchical groups ({hierarchy.nodes} nodes x {hierarchy.per_node}, position "
            f"{hierarchy.position}) do not tile the sequence-parallel group (size {comm.world}, "
            f"this rank {comm.rank}); create them with create_hierarchical_groups from that group")
    return RingSchedule(RingComm(hierarchy.inner),
                        RingComm(hierarchy.outer) if hierarchy.nodes > 1 else None)
