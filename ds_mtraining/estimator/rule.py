"""Online vertical-slash pattern estimation (the paper's Algorithm 1), vectorised over heads.

The rule, exactly (also the contract of a fused GPU estimator). Per (batch, query head), with
``L = min(last_q, S)`` and the last L queries at positions ``q_i = S - L + i``:

1. logits ``l[i, k] = scale * q_i . k_k`` in fp32, ``-inf`` where ``k > q_i``; ``P = softmax`` of
   each row over the whole sequence (GQA: a query head reads its key/value head).
2. column mass ``c[k] = sum_i P[i, k] / L`` (k in [0, S)); token-diagonal mass
   ``d[t] = sum_i P[i, q_i - t] / L`` (t = query - key in [0, S); a diagonal straddling a block
   boundary keeps its whole mass).
3. top-p of a mass list: sort descending, ties by ascending position (stable); keep the fewest
   leading entries whose mass reaches ``p * total`` (an entry is kept iff the mass sorted ahead of
   it is below ``p * total * (1 - 1e-6)``), then clamp that count to ``[1, cap]``. Vertical:
   ``p_vertical``, cap ``max_vertical`` columns; slash: ``p_slash``, cap ``max_slash_diagonals``.
4. index: the kept columns plus sink tokens ``0 .. sink_tokens-1``; each kept token diagonal ``t``
   marks block diagonal ``t // block_size`` and, unless ``t % block_size == 0``, the next one;
   block diagonals ``0 .. local_blocks-1`` always (:meth:`SparseIndex.from_vertical_slash`).

With document masking (``doc_start`` [B, S], :mod:`ds_mtraining.documents`: query i sees keys
``doc_start[i] .. i``) the last L queries of the sequence would see only its last document, so
short documents would lose their pattern. Step 1-2 then run per document instead:

1'. each document d of n_d tokens scores its own last ``L_d = min(last_q, n_d)`` queries against its
   own causal keys (softmax over the document only);
2'. its column masses (at global key positions) and token-diagonal masses (query - key, shared by
   all documents) are divided by L_d, weighted by ``w_d = n_d / S`` (its share of the sequence's
   query rows, :data:`DOCUMENT_WEIGHTS` ``"tokens"``: the weight each document's rows carry in
   the recall) and summed over the documents of the row;

then steps 3-4 select per sequence with the same budgets, and step 4's sinks are the first
``sink_tokens`` tokens of *every* document (each document's own sink, as when it runs alone). One
document per row gives today's masses and index bit for bit. Cost: documents are grouped by
length into power-of-two key windows (at most log2 S groups, each one batched einsum), so the
work stays about ``2 last_q S`` logits per head however many documents there are.

Token diagonals are summed through a skewed strided view of P (no scatter). The pieces
(:func:`last_query_scores`, :func:`last_key_mass`, :func:`top_p_count`) are shared with the
distributed estimator, which computes the same masses from sequence shards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import resolve_softmax_scale
from ..config import SparseConfig
from ..documents import check_doc_start, cu_seqlens_from_doc_start, remember_last
from ..index import SparseIndex


def check_qk(q: torch.Tensor, k: torch.Tensor):
    """Validates the [B, S, H, D] layout and GQA head counts of q and k."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be [batch, seq, heads, head_dim] (FlashAttention layout); got "
            f"{tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, seq and head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for GQA")


def last_query_scores(q_last: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Fp32 logits [B, H, Lq, Sk] of the trailing queries against keys, -inf where k_pos > q_pos.
    GQA is handled by grouping query heads, never by expanding K."""
    b, lq, h, d = q_last.shape
    hkv = k.shape[2]
    qg = q_last.float().view(b, lq, hkv, h // hkv, d)
    logits = torch.einsum("bqkgd,bskd->bkgqs", qg, k.float()).reshape(b, h, lq, k.shape[1])
    visible = q_pos.view(-1, 1) >= k_pos.view(1, -1)
    return logits.mul_(scale).masked_fill_(~visible, float("-inf"))


def last_key_mass(probs: torch.Tensor) -> torch.Tensor:
    """Token-diagonal masses, each filed under its last key.

    ``probs`` [..., L, n]: the last L query rows of a sequence (row i is query ``S - L + i``)
    against n consecutive keys ``k0 .. k0 + n - 1``. Entry (i, k) lies on the diagonal whose key in
    row L - 1 is ``e = k + (L - 1 - i)``; returns ``m`` [..., n + L - 1] with ``m[u]`` the summed
    probabilities of the diagonal with that last key ``e = k0 + u`` (query minus key
    ``t = S - 1 - e``). A skewed view (row stride + 1) lines the diagonals up as columns."""
    lq, n = probs.shape[-2:]
    padded = F.pad(probs, (lq - 1, lq - 1)).contiguous()  # [..., L, n + 2 (L - 1)], zero borders
    # skewed[i, u] = padded[i, u + i] = probs[i, k = k0 + u - (L - 1 - i)]
    skewed = padded.as_strided(
        (*padded.shape[:-1], n + lq - 1), (*padded.stride()[:-2], padded.stride(-2) + 1, 1))
    return skewed.sum(-2)


def column_and_diagonal_mass(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From probabilities [B, H, L, S] of the last L queries against every key (rows sum to 1):
    column masses [B, H, S] and token-diagonal masses [B, H, S] (index t = query - key), both
    divided by L."""
    lq, s = probs.shape[-2:]
    by_last_key = last_key_mass(probs)[..., :s]  # last keys past S would be future keys: zero
    return probs.sum(-2) / lq, by_last_key.flip(-1) / lq


def top_p_count(sorted_mass: torch.Tensor, p: float, cap: int,
                total: torch.Tensor | None = None) -> torch.Tensor:
    """The fewest leading entries of a descending mass list [..., n] whose sum reaches p * total,
    clamped to [1, min(cap, n)]. ``total`` [...] defaults to the list's sum; the distributed
    estimator passes the all-reduced total when the list holds only the leading candidates."""
    total = sorted_mass.sum(-1, keepdim=True) if total is None else total[..., None]
    before = sorted_mass.cumsum(-1) - sorted_mass  # mass of the entries ahead of each one
    count = (before < p * total * (1 - 1e-6)).sum(-1)
    return count.clamp(min=1, max=min(cap, sorted_mass.shape[-1]))


def select_top_p(mass: torch.Tensor, p: float, cap: int) -> torch.Tensor:
    """Positions [..., <=cap] of the top-p entries of ``mass``, -1 padded (ties broken by
    position, so every caller selects the same set)."""
    values, order = mass.sort(dim=-1, descending=True, stable=True)
    count = top_p_count(values, p, cap)
    width = int(count.max())
    keep = torch.arange(width, device=mass.device) < count[..., None]
    return torch.where(keep, order[..., :width], -1)


# weight of document d's row-mean masses (n: its tokens, lq: its scored queries, both [docs] float64;
# seq_len: S). Compared by bench.recall_documents; "tokens" is the default (see the module docstring).
DOCUMENT_WEIGHTS = {
    "tokens": lambda n, lq, seq_len: n / seq_len,
    "queries": lambda n, lq, seq_len: lq / lq.sum(),
    "entries": lambda n, lq, seq_len: n * (n + 1) / (n * (n + 1)).sum(),
    "documents": lambda n, lq, seq_len: torch.full_like(n, 1.0 / n.numel()),
}


@remember_last
def document_windows(doc_start: torch.Tensor):
    """Every document of every row: (start, end, row, length, window) [docs] each, window the key
    window of rules 1'-2' (the next power of two >= its length, at most S). Remembered for the
    last ``doc_start`` (:func:`~ds_mtraining.documents.remember_last`)."""
    starts, ends, rows = [], [], []
    for row in range(doc_start.shape[0]):  # a loop over the batch rows only
        cu = cu_seqlens_from_doc_start(doc_start[row])
        starts.append(cu[:-1])
        ends.append(cu[1:])
        rows.append(torch.full_like(cu[:-1], row))
    start, end, row = (torch.cat(t).to(doc_start.device) for t in (starts, ends, rows))
    length = end - start
    window = torch.minimum(2 ** torch.ceil(torch.log2(length.double())).long(), length.new_tensor(doc_start.shape[1]))
    return start, end, row, length, window


@remember_last
def document_window_groups(doc_start: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """The documents grouped by key window: [(window, indices into document_windows' lists)], the
    windows ascending. Remembered like document_windows, so the layers after a step's first read
    no group from the device (no host synchronisation)."""
    window = document_windows(doc_start)[4]
    return [(width, (window == width).nonzero().squeeze(1)) for width in torch.unique(window).tolist()]


@remember_last
def document_query_positions(doc_start: torch.Tensor, last_q: int) -> torch.Tensor:
    """Ascending global positions of the query rows that rules 1'-2' read in any batch row: each
    window's last min(last_q, window) rows (rows before a document's start are read, then masked).
    Remembered for the last ``doc_start`` (one host read per step)."""
    _, end, _, _, window = document_windows(doc_start)
    count = window.clamp(max=last_q)
    offsets = torch.arange(int(count.max()), device=end.device)
    rows = end[:, None] - count[:, None] + offsets
    return torch.unique(rows.clamp(min=0)[offsets < count[:, None]])  # (clamped as the rule reads them)


def document_column_and_diagonal_mass(q: torch.Tensor, k: torch.Tensor, doc_start: torch.Tensor,
                                      last_q: int, scale: float, weight: str = "tokens",
                                      q_positions: torch.Tensor | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Column masses [B, H, S] (global key positions) and token-diagonal masses [B, H, S] of rules
    1'-2' (module docstring): each document's last ``min(last_q, n_d)`` queries against its own
    keys, row-mean masses weighted by ``DOCUMENT_WEIGHTS[weight]`` and summed per batch row.

    ``q`` is [B, S, H, D], or with ``q_positions`` [B, len(q_positions), H, D]: only the rows at
    those global positions, at least :func:`document_query_positions` (what a sequence-parallel
    estimate gathers instead of every query).

    Documents go in groups of equal window W (the next power of two >= n_d, at most S): a window
    holds the W keys ending at the document's last token, right-aligned, so every document of a
    group shares the causal mask of :func:`last_query_scores` and the diagonal view of
    :func:`column_and_diagonal_mass`; keys before the document's start are masked."""
    b, s, h = k.shape[0], k.shape[1], q.shape[2]
    start, end, row, length, _ = document_windows(doc_start)
    query_slot = None
    if q_positions is not None:  # global position -> row of q
        query_slot = torch.zeros(s, dtype=torch.long, device=q.device)
        query_slot[q_positions] = torch.arange(len(q_positions), device=q.device)
    scored = length.clamp(max=last_q)
    weights = DOCUMENT_WEIGHTS[weight](length.double(), scored.double(), s)
    columns = torch.zeros(b * s, h, dtype=torch.float32, device=q.device)
    diagonals = torch.zeros(b, h, s, dtype=torch.float32, device=q.device)
    for width, docs in document_window_groups(doc_start):
        lq = min(last_q, width)
        local = torch.arange(width, device=q.device)
        key_pos = end[docs, None] - width + local  # global positions of the window, [docs, W]
        query_pos = key_pos[:, width - lq:].clamp(min=0)
        keys = k[row[docs, None], key_pos.clamp(min=0)]
        queries = q[row[docs, None], query_pos if query_slot is None else query_slot[query_pos]]
        logits = last_query_scores(queries, keys, local[width - lq:], local, scale)
        before_start = key_pos < start[docs, None]  # also masks rows of queries before the start
        logits.masked_fill_(before_start[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits, -1).masked_fill_(before_start[:, None, width - lq:, None], 0.0)
        # (sum / L_d) * w_d: with one document w_d = 1.0 and this is today's sum / L exactly
        scale_rows, weight = scored[docs, None, None], weights[docs, None, None].float()
        col = probs.sum(-2) / scale_rows * weight
        diag = last_key_mass(probs)[..., :width].flip(-1) / scale_rows * weight
        flat = (row[docs, None] * s + key_pos.clamp(min=0)).flatten()
        columns.index_add_(0, flat, col.transpose(1, 2).reshape(-1, h))
        diagonals[..., :width].index_add_(0, row[docs], diag)
    return columns.view(b, s, h).transpose(1, 2).contiguous(), diagonals


def sink_columns(batch: int, heads: int, config: SparseConfig, seq_len: int, device) -> torch.Tensor:
    sinks = torch.arange(min(config.sink_tokens, seq_len), device=device)
    return sinks.expand(batch, heads, -1)


@remember_last
def document_spans(doc_start: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, length, row) of every document of every row, as host integers (remembered: one
    host read per ``doc_start``)."""
    start, _, row, length, _ = document_windows(doc_start)
    return list(zip(start.tolist(), length.tolist(), row.tolist()))


@remember_last
def document_sink_columns(doc_start: torch.Tensor, heads: int, config: SparseConfig) -> torch.Tensor:
    """[B, H, n] the first ``sink_tokens`` tokens of every document of each row (inside the
    document), -1-padded, ascending: step 4's sinks under document masking (remembered)."""
    start, end, row, _, _ = document_windows(doc_start)
    sinks = start[:, None] + torch.arange(config.sink_tokens, device=doc_start.device)
    inside = sinks < end[:, None]
    rows = [sinks[row == r][inside[row == r]] for r in range(doc_start.shape[0])]
    width = max(len(r) for r in rows)
    padded = torch.full((len(rows), width), -1, dtype=torch.long, device=doc_start.device)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    return padded[:, None].expand(-1, heads, -1)


@torch.no_grad()
def estimate_vertical_slash(q: torch.Tensor, k: torch.Tensor, config: SparseConfig,
                            softmax_scale: float | None = None,
                            doc_start: torch.Tensor | None = None) -> SparseIndex:
    """Estimates the vertical-slash index of causal attention ``softmax(q k^T)`` for this step.

    Args:
        q: [B, S, H, D] queries (after RoPE); k: [B, S, Hkv, D] keys, H a multiple of Hkv.
        config: budgets and granularity.
        doc_start: int [B, S] (:mod:`ds_mtraining.documents`) for packed documents: the masses
            come from every document's own last queries and keys (rules 1'-2' of the module
            docstring); None: one document per row (rules 1-2).
    Returns:
        A :class:`SparseIndex` for [B, S, H].
    """
    check_qk(q, k)
    b, s, h, d = q.shape
    scale = resolve_softmax_scale(d, softmax_scale)
    if doc_start is None:
        lq = min(config.last_q, s)
        pos = torch.arange(s, device=q.device)
        logits = last_query_scores(q[:, s - lq:], k, pos[s - lq:], pos, scale)
        columns, diagonals = column_and_diagonal_mass(torch.softmax(logits, dim=-1))
    else:
        doc_start = check_doc_start(doc_start, b, s, q.device)
        columns, diagonals = document_column_and_diagonal_mass(q, k, doc_start, config.last_q, scale)
    return index_from_masses(columns, diagonals, config, doc_start)


def index_from_masses(columns: torch.Tensor, diagonals: torch.Tensor, config: SparseConfig,
                      doc_start: torch.Tensor | None = None) -> SparseIndex:
    """Steps 3-4: the index of the top-p columns and token diagonals of masses [B, H, S] each (with
    ``doc_start``, every document's sinks)."""
    b, h, s = columns.shape
    vertical = select_top_p(columns, config.p_vertical, config.max_vertical)
    sinks = (sink_columns(b, h, config, s, columns.device) if doc_start is None
             else document_sink_columns(doc_start, h, config))
    vertical = torch.cat([vertical, sinks], -1)
    slash = select_top_p(diagonals, config.p_slash, config.max_slash_diagonals)
    return SparseIndex.from_vertical_slash(vertical, slash, s, config.block_size, config.local_blocks)
