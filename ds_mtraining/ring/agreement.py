"""The check that every rank of a ring was called with its shard of the same attention, and when
it runs.

The check (:func:`check_ranks_agree`) all-gathers a small descriptor and reads it on the host: a
host synchronisation. It therefore runs once per training step, not per attention call: at the
first ring call on a process group in each step of the step clock (:mod:`ds_mtraining.step`, which
this module only reads: whoever runs the steps advances it; the first call of a process counts as
a step's first). ``DS_MTRAINING_CHECK_RANKS`` chooses:

* ``step`` (default): that first call of each step, per process group;
* ``every_call``: every ring call (debugging);
* ``off``: never.

What the per-step check still catches: any difference, at the step's first call, in the ranks'
shapes, dtypes, sparse config or given index (sizes and sums of its lists), i.e. wrong sharding,
mismatched batches or configs, raised as the same error on every rank before any ring transfer.
What it no longer catches: a difference that appears only in a later call of the same step
(e.g. one layer called with another config or shape on one rank); such a ring can hang or
compute garbage. Run with ``DS_MTRAINING_CHECK_RANKS=every_call`` to find those. Calls made by
the autograd engine (the forward recomputed under activation checkpointing) are never checked:
they repeat a checked forward.
"""
from __future__ import annotations

import os
from dataclasses import fields

import torch
import torch.distributed as dist

from ..attention import SUPPORTED_DTYPES
from ..config import SparseConfig
from ..index import SparseIndex
from ..distributed.comm import RingComm
from ..step import current_step

# What each entry of a rank's descriptor holds: its call (_describe), then its index's fingerprint.
_CALL_FIELDS = (["q.batch", "q.seq", "q.heads", "q.head_dim", "q.dtype",
                 "k.batch", "k.seq", "k.heads", "k.head_dim", "k.dtype",
                 "v.batch", "v.seq", "v.heads", "v.head_dim", "v.dtype", "index.seq_len"]
                + [f"config.{f.name}" for f in fields(SparseConfig)])
_FINGERPRINT_FIELDS = ["index.slash size", "index.vertical size", "index.slash sum",
                       "index.vertical sum"]

CHECK_ENV = "DS_MTRAINING_CHECK_RANKS"
CHECK_MODES = ("step", "every_call", "off")
_checked: dict = {}  # key -> the step (ds_mtraining.step.current_step) it was last checked in


def check_mode() -> str:
    mode = os.environ.get(CHECK_ENV, "step").strip().lower() or "step"
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECK_ENV}={mode!r}: use one of {', '.join(CHECK_MODES)}")
    return mode


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (a forward called
    now is recomputed under activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


def check_due(key) -> bool:
    """Whether a once-per-step check keyed ``key`` runs at this call (see the module docstring).
    Every rank of a group takes the same decision as long as they make the same calls."""
    mode = check_mode()
    if mode == "off" or in_backward():
        return False
    return mode == "every_call" or _checked.get(key) != current_step()


def mark_checked(key):
    """Records that ``key``'s check passed in this step (after the call's other checks passed, so
    that a call that raised leaves the next call checked)."""
    _checked[key] = current_step()


def _describe(q, k, v, config: SparseConfig, index: SparseIndex | None) -> list[int]:
    """Ints that every rank's call must agree on: shapes, dtypes, config, index identity."""
    desc = []
    for t in (q, k, v):
        shape = list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else [-1] * 4
        desc += shape
        desc.append(SUPPORTED_DTYPES.index(t.dtype) if isinstance(t, torch.Tensor)
                    and t.dtype in SUPPORTED_DTYPES else -1)
    desc.append(-1 if index is None else index.seq_len)
    for value in config.to_dict().values():
        desc.append(round(value * 1_000_000) if isinstance(value, float) else int(value))
    assert len(desc) == len(_CALL_FIELDS)
    return desc


def _index_fingerprint(index: SparseIndex | None, device) -> torch.Tensor:
    """Int64 [4]: sizes and sums of the index lists (O(selected)), zeros without an index."""
    if index is None:
        return torch.zeros(len(_FINGERPRINT_FIELDS), dtype=torch.int64, device=device)
    return torch.stack([torch.tensor(index.slash.numel(), device=device),
                        torch.tensor(index.vertical.numel(), device=device),
                        index.slash.to(device).long().sum(), index.vertical.to(device).long().sum()])


def check_ranks_agree(comm: RingComm, q, k, v, config: SparseConfig, index: SparseIndex | None):
    """One small all-gather before any ring step: raises the same error on every rank when the
    ranks' shapes, dtypes, configs or indices differ (instead of hanging in a mismatched ring)."""
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    mine = torch.cat([torch.tensor(_describe(q, k, v, config, index), dtype=torch.int64,
                                   device=device), _index_fingerprint(index, device)])
    parts = [torch.empty_like(mine) for _ in range(comm.world)]
    dist.all_gather(parts, mine, group=comm.group)
    table = torch.stack(parts).cpu()
    differ = (table != table[0]).any(0)
    if bool(differ.any()):
        names = _CALL_FIELDS + _FINGERPRINT_FIELDS
        lines = [f"  {names[i]}: " + ", ".join(
            f"rank {r}={int(table[r, i])}" for r in range(comm.world))
            for i in differ.nonzero().flatten().tolist()]
        raise ValueError("ring_sparse_attention: the ranks of the group were called with different "
                         "inputs; every rank must pass its S/W-token shard of the same attention "
                         "(same shapes, dtype, config and index):\n" + "\n".join(lines))


def check_ranks_before_collectives(comm, q, k, v, config: SparseConfig):
    """The ranks' agreement check (:func:`check_ranks_agree`, without an index) when it is due,
    for a caller that runs a collective of its own before it even has the ring call's inputs (the
    Ulysses drop-in's re-stripe all-to-all, :mod:`ds_mtraining.layer.ulysses`): a mismatch then
    raises on every rank instead of hanging in it. It counts as the ring's check of this step
    (same key), so the ring call's own (:func:`~.ring_attention.prepare_ring_call`, where every
    other caller's check runs) does not repeat it."""
    if comm is None:
        return
    key = ranks_check_key(comm)
    if check_due(key):
        check_ranks_agree(comm, q, k, v, config, None)
        mark_checked(key)


def ranks_check_key(comm) -> tuple:
    """The once-per-step key of the ranks' agreement check on ``comm``'s group."""
    return ("ranks", id(comm.group))
