"""The ring loop: forward and backward over :meth:`RingSchedule.kv_steps`, and their autograd
Function.

Every step calls the sparse kernel with the *global* compact index and the step's
:class:`~ds_mtraining.index.Stripe` (query rank, key rank); the kernel derives that pair's blocks
and columns in O(selected). Forward partial outputs merge exactly in fp32 through their LSEs.

Backward: dQ stays home; dK/dV accumulators (fp32) travel with K/V, each rank adding its share
for the keys it holds this step, and one more hop brings them home.
"""
from __future__ import annotations

import torch

from .. import ops
from ..index import SparseIndex
from .comm import GRAD_TAG, PendingRotation, RingComm
from .merge import merge_partial
from .schedule import RingSchedule


def ring_forward(schedule: RingSchedule, q, k, v, index: SparseIndex, scale: float):
    """(out float32 [B, S/W, H, D], lse float32 [B, H, S/W]) of this rank's queries over all keys."""
    out = lse = None
    for _, stripe, step_k, step_v in schedule.kv_steps(k, v):
        step_out, step_lse = ops.attention_forward(q, step_k, step_v, index, scale, stripe)
        if out is None:
            out, lse = step_out, step_lse
        else:
            out, lse = merge_partial(out, lse, step_out, step_lse)
    return out, lse


def _accumulate_and_pass(comm: RingComm | None, in_flight, dk, dv) -> PendingRotation:
    """Adds this rank's (dk, dv) share to the travelling accumulators (this rank starts them when
    none are in flight) and sends them on; on a one-rank ring (``comm`` None) they stay here."""
    if in_flight is None:
        dk_sum, dv_sum = dk.float(), dv.float()
    else:
        dk_sum, dv_sum = in_flight.wait()
        dk_sum += dk
        dv_sum += dv
    if comm is None:
        return PendingRotation([], [], [dk_sum, dv_sum])
    return comm.rotate([dk_sum, dv_sum], GRAD_TAG)


def ring_backward(schedule: RingSchedule, dout, q, k, v, out, lse, index: SparseIndex, scale: float):
    """(dq, dk, dv) float32 for this rank's shards; ``out``/``lse`` are the merged forward ones.

    Inside a node, dK/dV accumulators travel with the K/V of the inner ring, and after its last
    step one more hop brings them back to the rank that held those K/V at the outer step's start;
    that node share then joins the accumulator arriving over the outer ring (sent while the
    previous inner ring ran) and travels on, and a last outer hop brings it home."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    inner_comm = schedule.inner if schedule.per_node > 1 else None
    outer_comm = schedule.outer if schedule.nodes > 1 else None
    inner_grads = outer_grads = None
    for inner_step, stripe, step_k, step_v in schedule.kv_steps(k, v):
        dq_step, dk_step, dv_step = ops.attention_backward(dout, q, step_k, step_v, out, lse, index,
                                                           scale, stripe)
        dq += dq_step
        inner_grads = _accumulate_and_pass(inner_comm, inner_grads, dk_step, dv_step)
        if inner_step == schedule.per_node - 1:  # the node's inner ring is done
            node_dk, node_dv = inner_grads.wait()
            outer_grads = _accumulate_and_pass(outer_comm, outer_grads, node_dk, node_dv)
            inner_grads = None
    dk, dv = outer_grads.wait()
    return dq, dk, dv


class RingSparseAttentionFunction(torch.autograd.Function):
    """Ring sparse attention on striped shards; returns (out in q's dtype, lse fp32 [B, H, S/W])."""

    @staticmethod
    def forward(ctx, q, k, v, index: SparseIndex, scale: float, schedule: RingSchedule):
        out, lse = ring_forward(schedule, q, k, v, index, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.index, ctx.scale, ctx.schedule = index, scale, schedule
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.schedule, dout.contiguous(), q, k, v, out, lse, ctx.index,
                                   ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
