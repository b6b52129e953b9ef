"""The check that every rank of a ring was called with its shard of the same attention."""
from __future__ import annotations

from dataclasses import fields

import torch
import torch.distributed as dist

from ..attention import SUPPORTED_DTYPES
from ..config import SparseConfig
from ..index import SparseIndex
from .comm import RingComm

# What each entry of a rank's descriptor holds: its call (_describe), then its index's fingerprint.
_CALL_FIELDS = (["q.batch", "q.seq", "q.heads", "q.head_dim", "q.dtype",
                 "k.batch", "k.seq", "k.heads", "k.head_dim", "k.dtype",
                 "v.batch", "v.seq", "v.heads", "v.head_dim", "v.dtype", "index.seq_len"]
                + [f"config.{f.name}" for f in fields(SparseConfig)])
_FINGERPRINT_FIELDS = ["index.slash size", "index.vertical size", "index.slash sum",
                       "index.vertical sum"]


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
