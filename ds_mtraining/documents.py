"""Document boundaries of packed sequences: the one statement of document masking.

A packed sequence of S tokens holds several documents back to back. Their boundaries come as
FlashAttention's ``cu_seqlens``: int32 [n_docs + 1], increasing, from 0 to S (document d is
tokens ``cu[d] .. cu[d+1]-1``). Everything past the loader works on ``doc_start`` instead:
int32 [B, S], for each *global* token position t the global position of the first token of
t's document. With document masking, query i may attend key j iff

    doc_start[i] <= j <= i        (and the sparse index keeps (i, j))

i.e. the block-diagonal causal mask intersected with the index's mask. ``doc_start`` is indexed
by global position, so under striping every rank holds the whole array (4 bytes per token) and
maps a local row to its global position with the stripe arithmetic.

RoPE positions restart at 0 in each document (as HF's packed ``position_ids``):
``positions = t - doc_start[t]``; the striped layout's own checks use the place in the
sequence, never these positions.
"""
from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``cu_seqlens`` as int64 on its device, after checking it is 0 = c0 < c1 < ... < cn = S."""
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries [0, ..., S], got shape {tuple(cu.shape)}")
    if cu.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu.dtype}")
    cu = cu.long()
    if int(cu[0]) != 0 or int(cu[-1]) != seq_len:
        raise ValueError(f"cu_seqlens must start at 0 and end at the sequence length {seq_len}, "
                         f"got {int(cu[0])} .. {int(cu[-1])}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError("cu_seqlens must be strictly increasing (no empty documents)")
    return cu


def doc_start_from_cu_seqlens(cu_seqlens, seq_len: int, batch: int = 1) -> torch.Tensor:
    """int32 [batch, S] ``doc_start`` of one packing (the same for every row of the batch);
    ``cu_seqlens`` may also be a list of per-row tensors (length ``batch``)."""
    rows = list(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else [cu_seqlens] * batch
    if len(rows) != batch:
        raise ValueError(f"{len(rows)} cu_seqlens rows for a batch of {batch}")
    out = []
    for cu in rows:
        cu = check_cu_seqlens(cu, seq_len)
        lengths = cu[1:] - cu[:-1]
        out.append(torch.repeat_interleave(cu[:-1], lengths))
    return torch.stack(out).to(torch.int32)


def cu_seqlens_from_doc_start(doc_start: torch.Tensor) -> torch.Tensor:
    """The ``cu_seqlens`` of one row of ``doc_start`` ([S])."""
    starts = torch.unique_consecutive(doc_start.long())
    return torch.cat([starts, starts.new_tensor([doc_start.numel()])])


def document_ends(doc_start: torch.Tensor) -> torch.Tensor:
    """Int64, ``doc_start``'s shape [B, S]: the end (exclusive) of each token's document."""
    rows = []
    for row in doc_start:
        cu = cu_seqlens_from_doc_start(row).to(row.device)
        rows.append(torch.repeat_interleave(cu[1:], cu[1:] - cu[:-1]))
    return torch.stack(rows)


def document_positions(doc_start: torch.Tensor) -> torch.Tensor:
    """RoPE positions that restart in each document: ``t - doc_start[t]`` (int64, same shape)."""
    t = torch.arange(doc_start.shape[-1], device=doc_start.device)
    return t - doc_start.long()


def document_causal_mask(doc_start: torch.Tensor) -> torch.Tensor:
    """bool [B, S, S]: query i sees key j iff doc_start[i] <= j <= i (the float64 references' mask)."""
    seq_len = doc_start.shape[-1]
    j = torch.arange(seq_len, device=doc_start.device)
    i = j[:, None]
    return (j[None] <= i) & (j[None, None, :] >= doc_start.long()[:, :, None])


def remember_last(fn):
    """``fn(tensor, *args)`` remembered for the last ``tensor`` object it saw (and the same args),
    until that tensor is modified in place (its version counter moves). The layers of a training
    step pass the step's one ``doc_start``, so what is read from it on the host is read once per
    step, not once per layer. The tensor is held, so its identity cannot pass to another object.
    Inference tensors (no version counter) are not remembered."""
    last = []  # [(tensor, version, args, result)]

    def remembered(tensor: torch.Tensor, *args):
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor
            return fn(tensor, *args)
        if last and last[0][0] is tensor and last[0][1] == version and last[0][2] == args:
            return last[0][3]
        result = fn(tensor, *args)
        last[:] = [(tensor, version, args, result)]
        return result

    remembered.__doc__, remembered.__name__, remembered.__wrapped__ = fn.__doc__, fn.__name__, fn
    return remembered


@remember_last
def check_doc_start(doc_start: torch.Tensor, batch: int, seq_len: int, device) -> torch.Tensor:
    """``doc_start`` as a contiguous int32 tensor on ``device`` after checking its shape and that
    each row is a valid packing (doc_start[0] = 0, doc_start[t] in {doc_start[t-1], t}).
    Remembered for the last tensor checked (:func:`remember_last`): the same object returns the
    same checked tensor without another host read."""
    if doc_start.dim() != 2 or tuple(doc_start.shape) != (batch, seq_len):
        raise ValueError(f"doc_start must be [B, S] = [{batch}, {seq_len}] (global positions), "
                         f"got {tuple(doc_start.shape)}")
    d = doc_start.long()
    t = torch.arange(seq_len, device=d.device)
    ok = (d[:, 0] == 0).all() & ((d[:, 1:] == d[:, :-1]) | (d[:, 1:] == t[1:])).all()
    if not bool(ok):
        raise ValueError("doc_start is not a packing: each row must start at 0 and every entry must equal "
                         "the previous one or its own position (build it with doc_start_from_cu_seqlens)")
    return doc_start.to(device=device, dtype=torch.int32).contiguous()
