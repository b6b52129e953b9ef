"""The ring loop: forward and backward over a :class:`RingSchedule`, and their autograd Function.

Every step calls the sparse kernel with the *global* compact index and the step's
:class:`~ds_mtraining.index.Stripe` (query rank, key rank); the kernel derives that pair's blocks
and columns in O(selected). Each step after the first merges its partial output exactly in fp32
through the LSEs into the running (out, lse) the first step made, in the kernel's epilogue (the
op's running ``out``/``lse`` arguments): no merge pass of its own. The last step writes the merged
out in q's dtype (the op's ``input_dtype``), reading the fp32 running one: no cast pass.

Backward runs the forward's steps in reverse order (:meth:`RingSchedule.kv_steps`, ``reverse``),
starting from the K/V this rank held at the forward's last step (saved, so no transfer precedes
the first kernel) and ending on the local pair. dQ stays home (the first step's dQ, into which
each later step's kernel adds its own: the op's running ``dq``; the last step writes the sum in
q's dtype); delta = rowsum(dout * out) is computed once for all steps. The dK/dV accumulators
(fp32) travel with the K/V, the other way round the ring, each rank adding its share for the
keys it holds; since the last step is the local pair, every accumulator is home after the last
step: no dK/dV hop follows the last kernel. In the hierarchical ring the same holds per level: a
node's share for the keys of its outer step is complete at the local step of its inner ring and
joins the outer accumulator, which ends at the keys' node at outer step 0.

On CUDA the additions into arriving accumulators and their sends run on a side stream
(``DS_MTRAINING_RING_GRAD_STREAM=0`` puts them back on the current stream): the next step's
kernel never waits for incoming dK/dV, only the addition does, and the sends leave as soon as
each share is added. Nothing in the loop reads a device value on the host.
"""
from __future__ import annotations

import os

import torch

from .. import ops
from ..index import SparseIndex
from ..sinks import sink_gradient, with_sinks
from ..distributed.comm import GRAD_TAG, PendingRotation, RingComm
from .schedule import RingSchedule

GRAD_STREAM_ENV = "DS_MTRAINING_RING_GRAD_STREAM"
_grad_streams: dict = {}


def ring_forward(schedule: RingSchedule, q, k, v, index: SparseIndex, scale: float, doc_start=None,
                 softcap: float = 0.0):
    """(out in q's dtype [B, S/W, H, D], lse float32 [B, H, S/W], (k, v) held at the last step)
    of this rank's queries over all keys (within their documents when ``doc_start`` [B, S] is
    given; logits soft-capped at ``softcap`` > 0: each step's lse is over the capped logits, so the
    merge is unchanged)."""
    out = lse = None
    held = (k, v)
    for step, (_, _, stripe, step_k, step_v) in enumerate(schedule.kv_steps(k, v)):
        out, lse = ops.attention_forward(q, step_k, step_v, index, scale, stripe, doc_start=doc_start,
                                         out=out, lse=lse, input_dtype=step == schedule.world - 1,
                                         softcap=softcap)
        held = (step_k, step_v)
    return out, lse, held


def _float(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _grad_stream(device: torch.device):
    """The side stream of the dK/dV accumulation on ``device`` (None on CPU or when disabled)."""
    if device.type != "cuda" or os.environ.get(GRAD_STREAM_ENV, "1") == "0":
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _grad_streams:
        _grad_streams[key] = torch.cuda.Stream(device=device)
    return _grad_streams[key]


def _add_and_send(comm: RingComm | None, in_flight: PendingRotation | None, dk, dv) -> PendingRotation:
    if in_flight is None:
        dk_sum, dv_sum = _float(dk), _float(dv)  # the kernel's fresh output when fp32: no copy
    else:
        dk_sum, dv_sum = in_flight.wait()
        dk_sum += dk
        dv_sum += dv
    if comm is None:
        return PendingRotation([], [], [dk_sum, dv_sum])
    return comm.rotate([dk_sum, dv_sum], GRAD_TAG, reverse=True)


def _accumulate_and_pass(comm: RingComm | None, in_flight, dk, dv, stream) -> PendingRotation:
    """Adds this rank's (dk, dv) share to the accumulators arriving in ``in_flight`` (starts them
    when None) and sends them on the backward direction of the ring; with ``comm`` None they
    stay here (the share completed them). With a side ``stream``, the wait for the arrival, the
    addition and the send are ordered on it after the kernel that made (dk, dv)."""
    if stream is None:
        return _add_and_send(comm, in_flight, dk, dv)
    stream.wait_stream(torch.cuda.current_stream(dk.device))
    with torch.cuda.stream(stream):
        dk.record_stream(stream)
        dv.record_stream(stream)
        return _add_and_send(comm, in_flight, dk, dv)


def ring_backward(schedule: RingSchedule, dout, q, k, v, out, lse, index: SparseIndex, scale: float,
                  held_k=None, held_v=None, doc_start=None, delta=None, softcap: float = 0.0):
    """(dq in q's dtype, dk and dv float32) for this rank's shards; ``out``/``lse`` are the merged
    forward ones (``out`` in q's dtype or float32), ``held_k``/``held_v`` the K/V this rank held
    at the forward's last step (:func:`ring_forward`; None: fetched here, one exposed transfer),
    ``delta`` rowsum(dout * out) if already computed."""
    if held_k is None:
        held_k, held_v = _fetch_last_step_kv(schedule, k, v)
    stream = _grad_stream(q.device)
    inner_comm = schedule.inner if schedule.per_node > 1 else None
    outer_comm = schedule.outer if schedule.nodes > 1 else None
    dq = inner_grads = outer_grads = None
    if delta is None:
        delta = ops.attention_delta(dout, out)  # the same for every step: computed once
    steps = schedule.kv_steps(held_k, held_v, reverse=True)
    for step, (outer_step, inner_step, stripe, step_k, step_v) in enumerate(steps):
        dq, dk_step, dv_step = ops.attention_backward(dout, q, step_k, step_v, out, lse, index, scale, stripe,
                                                      doc_start=doc_start, dq=dq, delta=delta,
                                                      input_dtype=step == schedule.world - 1,
                                                      softcap=softcap)
        node_done = inner_step == 0  # the inner ring's local step: the node's share is complete
        inner_grads = _accumulate_and_pass(None if node_done else inner_comm, inner_grads,
                                           dk_step, dv_step, stream)
        if node_done:
            node_dk, node_dv = inner_grads.wait()
            outer_grads = _accumulate_and_pass(None if outer_step == 0 else outer_comm, outer_grads,
                                               node_dk, node_dv, stream)
            inner_grads = None
    dk, dv = outer_grads.wait()
    if stream is not None:
        current = torch.cuda.current_stream(q.device)
        current.wait_stream(stream)
        dk.record_stream(current)
        dv.record_stream(current)
    return dq, dk, dv


def _fetch_last_step_kv(schedule: RingSchedule, k, v):
    """The K/V of the forward's last step (ring position (node + 1, local + 1)), for a backward
    called without them: one reverse hop on each ring."""
    if schedule.per_node > 1:
        k, v = schedule.inner.rotate([k, v], GRAD_TAG, reverse=True).wait()
    if schedule.nodes > 1:
        k, v = schedule.outer.rotate([k, v], GRAD_TAG, reverse=True).wait()
    return k, v


class RingSparseAttentionFunction(torch.autograd.Function):
    """Ring sparse attention on striped shards; returns (out in q's dtype, lse fp32 [B, H, S/W]).
    ``kept``: the (out, lse) this call returned before (a forward recomputed under activation
    checkpointing): returned again with the backward attached; no ring step runs, only one hop
    back for the K/V of the forward's last step, where the backward starts. ``sinks`` [H]: join
    after the last step's merge (:mod:`ds_mtraining.sinks`); ``softcap``: the ops' logit cap (0: none)."""

    @staticmethod
    def forward(ctx, q, k, v, index: SparseIndex, scale: float, schedule: RingSchedule, doc_start=None,
                kept=None, sinks=None, softcap: float = 0.0):
        if kept is None:
            # out: the merged fp32 out rounded once, by the last step's kernel; returned, and
            # saved for the backward's delta
            out, lse, (held_k, held_v) = ring_forward(schedule, q, k, v, index, scale, doc_start, softcap)
            if sinks is not None:
                out, lse = with_sinks(out, lse, sinks)
        else:  # the tensors the forward saved, alike (non-reentrant checkpointing's backward pairs
            # them with the first forward's ctx): out, the last step's K/V (one hop back)
            out, lse = kept
            held_k, held_v = _fetch_last_step_kv(schedule, k, v)
        ctx.save_for_backward(q, k, v, out, lse, held_k, held_v, sinks)
        ctx.index, ctx.scale, ctx.schedule, ctx.doc_start, ctx.softcap = index, scale, schedule, doc_start, softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, held_k, held_v, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        delta = ops.attention_delta(dout, out)
        dq, dk, dv = ring_backward(ctx.schedule, dout, q, k, v, out, lse, ctx.index, ctx.scale, held_k, held_v,
                                   ctx.doc_start, delta, ctx.softcap)
        dsinks = sink_gradient(delta, lse, sinks) if sinks is not None and ctx.needs_input_grad[8] else None
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, dsinks, None
