"""Recall of a sparse index: the fraction of the exact causal attention it keeps, over ALL rows.

For q [B, S, H, D], k [B, S, Hkv, D] and a :class:`~ds_mtraining.index.SparseIndex`, per (batch,
query head)::

    recall = (1 / S) * sum over rows q, kept keys k of softmax(scale * q . k, causal)[q, k]

the mean over every query row of the share of its softmax mass that the index computes (each row
sums to 1), next to the index's density (computed entries / causal entries). The estimator only
looks at the last ``last_q`` rows; this measures what that choice keeps everywhere else.

An index keeps a key either for every row of a query block or for none (inside the diagonal block
the causal mask already zeroes the future), so per query block only the column sums of its
probabilities matter. They are computed query block by query block against the earlier keys in
chunks (a log-sum-exp pass, then a probability pass), never ``S x S``, on any device. The same
pass gives the true mass of every (query block, key block) pair, from which :func:`oracle_recall`
picks the best blocks at a given density.

    recall(q, k, index)                      # [B, H]
    result = attention_recall(q, k, [index_a, index_b], block_size=128)
    result.recall, result.density            # [2, B, H] each
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .attention import resolve_softmax_scale
from .documents import check_doc_start
from .estimator.rule import check_qk
from .index import SparseIndex, causal_entries, membership


@dataclass
class Recall:
    """Recall and density [n, B, H] (float64) of n indices, and ``block_mass`` [B, H, nb, nb]:
    the true softmax mass of each (query block, key block), summed over its rows and divided by S
    (so it sums to 1 per head)."""

    recall: torch.Tensor
    density: torch.Tensor
    block_mass: torch.Tensor


def _scores(q_rows: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Logits [B, H, rows, keys] with grouped query heads (GQA without expanding K)."""
    b, rows, h, d = q_rows.shape
    hkv = k.shape[2]
    qg = q_rows.view(b, rows, hkv, h // hkv, d)
    return torch.einsum("bqkgd,bskd->bkgqs", qg, k).reshape(b, h, rows, k.shape[1]) * scale


def _column_sums(q_rows, k, row_pos, scale, key_chunk, row_start=None, key_offset: int = 0) -> torch.Tensor:
    """[B, H, keys]: the causal softmax probabilities of these rows, summed over the rows. ``k``
    holds the keys from global position ``key_offset`` on; ``row_start`` [B, rows]: each row's first
    visible key (document masking), None: key 0."""
    chunks = range(0, k.shape[1], key_chunk)

    def logits(start):
        part = _scores(q_rows, k[:, start:start + key_chunk], scale)
        key_pos = torch.arange(start, start + part.shape[-1], device=part.device) + key_offset
        hidden = key_pos[None, :] > row_pos[:, None]
        if row_start is not None:
            hidden = hidden | (key_pos[None, None, :] < row_start[:, :, None])[:, None]
        return part.masked_fill_(hidden, float("-inf"))

    row_max = row_sum = None  # online log-sum-exp over the key chunks
    for start in chunks:
        part = logits(start)
        # a finite floor: under document masking a chunk can hide every key of a row
        part_max = part.amax(-1).clamp(min=torch.finfo(part.dtype).min)
        new_max = part_max if row_max is None else torch.maximum(row_max, part_max)
        part_sum = torch.exp(part - new_max[..., None]).sum(-1)
        row_sum = part_sum if row_sum is None else row_sum * torch.exp(row_max - new_max) + part_sum
        row_max = new_max
    lse = row_max + row_sum.log()
    return torch.cat([torch.exp(logits(start) - lse[..., None]).sum(-2) for start in chunks], -1)


@torch.no_grad()
def attention_recall(q: torch.Tensor, k: torch.Tensor, indices: Sequence[SparseIndex],
                     block_size: int, softmax_scale: float | None = None,
                     key_chunk: int = 4096, doc_start: torch.Tensor | None = None) -> Recall:
    """Recall and density of each index in ``indices`` (all for these q/k and ``block_size``),
    plus the true block masses. Computes in float32, or float64 when q is float64.

    Args:
        q: [B, S, H, D] queries after RoPE; k: [B, S, Hkv, D] keys, H a multiple of Hkv.
        key_chunk: keys scored at once per query block (memory ~ B H block key_chunk).
        doc_start: int [B, S] (:mod:`ds_mtraining.documents`): measure against the document-masked
            attention: the softmax of row i runs over keys ``doc_start[i] .. i`` only, and the
            density is (index AND document mask) entries over the document mask's entries.
    """
    check_qk(q, k)
    b, s, h, d = q.shape
    for index in indices:
        index.check_matches(b, s, h)
        if index.block_size != block_size:
            raise ValueError(f"an index has block_size {index.block_size}, the recall was asked for "
                             f"{block_size}; pass block_size={index.block_size}")
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k = q.to(dtype), k.to(dtype)
    scale = resolve_softmax_scale(d, softmax_scale)
    nb = -(-s // block_size)
    in_slash = [membership(i.slash.to(q.device), nb) for i in indices]
    in_vertical = [membership(i.vertical.to(q.device), s) for i in indices]
    if doc_start is not None:
        doc_start = check_doc_start(doc_start, b, s, q.device).long()
    kept = torch.zeros(len(indices), b, h, dtype=torch.float64, device=q.device)
    computed = torch.zeros_like(kept)  # index AND document mask entries (document masking only)
    block_mass = torch.zeros(b, h, nb, nb, dtype=torch.float64, device=q.device)
    key_block = torch.arange(s, device=q.device) // block_size
    for qb in range(nb):
        start, end = qb * block_size, min(s, (qb + 1) * block_size)
        rows = torch.arange(start, end, device=q.device)
        # keys before every row's document start carry no mass: skip them
        first = 0 if doc_start is None else int(doc_start[:, start].min())
        row_start = None if doc_start is None else doc_start[:, start:end]
        columns = _column_sums(q[:, start:end], k[:, first:end], rows, scale, key_chunk,
                               row_start, first).double()
        block_mass[:, :, qb].index_add_(-1, key_block[first:end], columns)
        for n, (slash, vertical) in enumerate(zip(in_slash, in_vertical)):
            keep = slash.index_select(-1, qb - key_block[first:end]) | vertical[..., first:end]
            kept[n] += (columns * keep).sum(-1)
            if doc_start is not None:
                computed[n] += _kept_in_documents(keep, rows - first, row_start - first)
    if doc_start is None:
        density = torch.stack([index.head_density() for index in indices])
    else:
        density = computed / document_entries(doc_start)[:, None]
    return Recall(kept / s, density, block_mass / s)


def _kept_in_documents(keep: torch.Tensor, rows: torch.Tensor, row_start: torch.Tensor) -> torch.Tensor:
    """Float64 [B, H]: over these rows, the kept keys (``keep`` [B, H, keys], the same for every row
    of the query block) that lie in ``row_start[b, r] .. rows[r]`` (key indices into ``keep``)."""
    before = torch.nn.functional.pad(keep.long().cumsum(-1), (1, 0))  # kept keys before each key
    upto = before.index_select(-1, rows + 1)
    since = before.gather(-1, row_start[:, None, :].expand(*keep.shape[:2], -1))
    return (upto - since).sum(-1).double()


def document_entries(doc_start: torch.Tensor) -> torch.Tensor:
    """Float64 [B]: entries of the document causal mask, sum over rows of ``i - doc_start[i] + 1``."""
    return (1 + torch.arange(doc_start.shape[-1], device=doc_start.device) - doc_start.long()).sum(-1).double()


def recall(q: torch.Tensor, k: torch.Tensor, index: SparseIndex,
           softmax_scale: float | None = None, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 [B, H]: the share of the exact causal (with ``doc_start``: document-masked) attention
    mass over all rows that ``index`` keeps (see the module docstring)."""
    return attention_recall(q, k, [index], index.block_size, softmax_scale, doc_start=doc_start).recall[0]


def block_entries(seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """Float64 [nb, nb]: causal entries of each (query block, key block) pair."""
    nb = -(-seq_len // block_size)
    rows = (torch.clamp(seq_len - torch.arange(nb, device=device) * block_size, max=block_size)).double()
    entries = rows[:, None] * rows[None, :]
    entries = torch.where(torch.ones(nb, nb, dtype=torch.bool, device=device).tril(-1), entries, 0.0)
    return entries + torch.diag(rows * (rows + 1) / 2)


def oracle_recall(block_mass: torch.Tensor, seq_len: int, block_size: int,
                  density: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """The best block-granular pattern at ``density`` (per head [B, H], or one value): blocks in
    descending true mass per entry while their entries fit the budget. Returns (recall, density),
    float64 [B, H] each: an upper reference for any estimator at that density."""
    entries = block_entries(seq_len, block_size, block_mass.device).flatten()
    mass = block_mass.flatten(-2)
    value = torch.where(entries > 0, mass / entries.clamp(min=1), -1.0)
    order = value.sort(dim=-1, descending=True, stable=True).indices
    used = entries[order].cumsum(-1)
    budget = torch.as_tensor(density, dtype=torch.float64, device=mass.device) * causal_entries(seq_len)
    fits = used <= budget.expand(mass.shape[:-1])[..., None] * (1 + 1e-12)
    chosen_entries = torch.where(fits, entries[order], 0.0).sum(-1)
    return (torch.where(fits, mass.gather(-1, order), 0.0).sum(-1),
            chosen_entries / causal_entries(seq_len))
