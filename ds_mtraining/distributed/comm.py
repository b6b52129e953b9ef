"""Asynchronous ring rotation over any process group (gloo on CPU, NCCL on GPU).

Peers are addressed by their *global* ranks (``dist.get_global_rank``), so a sequence-parallel
group that does not start at rank 0 (e.g. ranks [2, 3] of a 4-rank world) works.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Tags of the two rotations that can be in flight at once (gloo matches messages by tag).
KV_TAG, GRAD_TAG = 1, 2


def ring_comm(group=None) -> "RingComm | None":
    """The ring over ``group`` (None: the default group), or None where there is no ring:
    torch.distributed is not initialised, or the group has one rank."""
    if group is None and not dist.is_initialized():
        return None
    comm = RingComm(group)
    return comm if comm.world > 1 else None


class RingComm:
    """Sends tensors to the next rank of ``group`` while receiving the same shapes from the
    previous one; every rank posts its sends and receives together (``batch_isend_irecv``), so
    neither gloo nor NCCL can deadlock on the order.

    Args:
        group: the process group of the ring (``None``: the default group).
    """

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the ring's process group")
        self.next_global = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev_global = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def rotate(self, tensors: list[torch.Tensor], tag: int = 0, reverse: bool = False) -> "PendingRotation":
        """Posts the transfer of ``tensors`` to the next rank and of the previous rank's tensors of
        the same shapes into fresh buffers; returns at once (on NCCL nothing waits on the host:
        :meth:`PendingRotation.wait` makes the current stream wait). ``reverse`` turns the ring
        round: send to the previous rank, receive from the next. ``tag`` tells concurrent
        rotations apart on backends that match messages by tag (gloo)."""
        sent = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        to, source = (self.prev_global, self.next_global) if reverse else (self.next_global, self.prev_global)
        ops = []
        for i, (outgoing, incoming) in enumerate(zip(sent, received)):
            ops.append(dist.P2POp(dist.isend, outgoing, to, self.group, tag * 64 + i))
            ops.append(dist.P2POp(dist.irecv, incoming, source, self.group, tag * 64 + i))
        return PendingRotation(dist.batch_isend_irecv(ops), sent, received)


class PendingRotation:
    """An in-flight :meth:`RingComm.rotate`; :meth:`wait` returns the received tensors."""

    def __init__(self, requests, sent: list[torch.Tensor], received: list[torch.Tensor]):
        self._requests = requests
        self._sent = sent  # kept alive until the sends complete
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for request in self._requests:
            request.wait()
        return self._received
