"""Fused CUDA estimator of the vertical-slash pattern: the rule of
:func:`ds_mtraining.estimator.rule.estimate_vertical_slash`, without host synchronisation.

Four kernels (``csrc/cuda/estimator/estimate_kernels.cuh``), each exposed here for the distributed path
(:func:`ds_mtraining.estimator.distributed.estimate_vertical_slash_cuda_distributed`: passes A and B on
each rank's keys, the row statistics merged across ranks, the diagonal shares
spilled to the next rank(s) instead of all-reduced, the selection over fixed-width candidates):

* :func:`row_stats` (pass A): per query row, the max logit over the local keys and the sum of
  ``exp(logit - max)``, from bf16/fp16 tensor-core scores (fp32 accumulate);
* :func:`masses` (pass B): with the global row statistics, the column masses of the local keys and
  the token-diagonal masses ``[B, H, S]`` of the local keys' entries (summed over ranks they are
  the global ones), both divided by the row count;
* :func:`select_top_p_padded` (:func:`select_top_p_padded_pair`: two lists in the same launches): the top-p
  entries of each mass row (multi-CTA radix threshold search, ties to the lower index), as a
  fixed-width ascending list plus counts;
* :func:`build_index` : token diagonals and columns to the compact :class:`SparseIndex`
  (:meth:`SparseIndex.from_vertical_slash`), in fixed widths.

With document masking, :func:`document_masses` runs passes A and B over every document's slice
of q and k, all documents in the same launches (the document-aware rule's masses), and
:func:`index_from_document_masses` selects from them with the same kernels, every document's
sinks merged into the columns.

Every list has a width fixed by the shapes and caps (never by the data), so nothing waits for the
GPU; the index is built through :func:`trusted_index`, which skips ``SparseIndex.__init__``'s
validation (that reads values back to the host). Reductions are in a fixed order: results are
bitwise reproducible for a given device and shape.
"""
from __future__ import annotations

import sys

import torch

from ..attention import resolve_softmax_scale
from ..config import SUPPORTED_BLOCK_SIZES, SparseConfig
from ..documents import remember_last
from ..index import PAD, SparseIndex
from ..ops import CUDA_DTYPES as SUPPORTED_DTYPES, CUDA_HEAD_DIMS as SUPPORTED_HEAD_DIMS
from .rule import DOCUMENT_WEIGHTS, check_qk, document_sink_columns, document_spans

MAX_LAST_Q = 256  # query rows the kernels keep in shared memory (4 chunks of 64)

__all__ = ["estimate_vertical_slash_cuda", "row_stats", "masses", "select_top_p_padded", "select_top_p_padded_pair",
           "build_index", "trusted_index", "supports", "document_masses"]


def _op():
    from ..ops import op_module
    return op_module("cuda")


def supports(q: torch.Tensor, k: torch.Tensor, config: SparseConfig, seq_len: int) -> str | None:
    """Why the fused estimator cannot take q/k of a ``seq_len``-token sequence (``None`` when it
    can): the one statement of what it takes, for one device and for the ring alike."""
    if q.device.type != "cuda":
        return f"q is on {q.device}, not a CUDA device"
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype:
        return f"q/k are {q.dtype}/{k.dtype}; the fused estimator takes bfloat16 or float16 for both"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={q.shape[-1]}; the fused estimator takes {SUPPORTED_HEAD_DIMS}"
    if min(config.last_q, seq_len) > MAX_LAST_Q:
        return f"last_q={config.last_q} > {MAX_LAST_Q}"
    return None


def trusted_index(slash: torch.Tensor, slash_count: torch.Tensor, vertical: torch.Tensor,
                  vertical_count: torch.Tensor, seq_len: int, block_size: int) -> SparseIndex:
    """A :class:`SparseIndex` from lists the kernels built valid (sorted, PAD padded, diagonal 0
    first, in range) and their counts, without the constructor's checks, which synchronise."""
    index = SparseIndex.__new__(SparseIndex)
    index.seq_len = int(seq_len)
    index.block_size = int(block_size)
    index.slash = slash
    index.vertical = vertical
    index.slash_count = slash_count
    index.vertical_count = vertical_count
    return index


# ---------------------------------------------------------------------- the passes
def row_stats(q_last: torch.Tensor, k: torch.Tensor, q_start: int, seq_len: int, scale: float,
              world: int = 1, rank: int = 0, block_size: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass A. ``q_last`` [B, L, H, D]: the queries at global positions ``q_start .. q_start + L - 1``;
    ``k`` [B, Sk, Hkv, D]: this rank's keys (local key ``t`` is global position
    ``((t // block) * world + rank) * block + t % block``).

    Returns (row_max, row_sum) float32 [B, H, L]: the max logit ``scale * q.k`` of each row over the
    visible local keys and the sum of ``exp(logit - row_max)`` (``-inf`` and 0 if none is visible)."""
    return tuple(_op().estimate_row_stats(q_last, k, int(q_start), int(seq_len), int(world),
                                          int(rank), _stripe_block(world, block_size), float(scale)))


def masses(q_last: torch.Tensor, k: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor,
           q_start: int, seq_len: int, scale: float, world: int = 1, rank: int = 0,
           block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass B, given the global row statistics (:func:`row_stats`, merged over ranks by
    :func:`~ds_mtraining.estimator.distributed.merge_row_stats`). Returns float32 (columns [B, H, Sk]: the mass of each local key,
    diagonals [B, H, seq_len]: the mass of token diagonal ``t = query - key`` over the local keys),
    both summed over the L rows and divided by L."""
    return tuple(_op().estimate_masses(q_last, k, row_max, row_sum, int(q_start), int(seq_len),
                                       int(world), int(rank), _stripe_block(world, block_size),
                                       float(scale)))


def _stripe_block(world: int, block_size: int | None) -> int:
    """The stripe width the passes map local keys with: required on a ring (world > 1); on one
    device every width maps local key t to position t, so any supported one will do."""
    if block_size is None:
        if world > 1:
            raise ValueError(f"block_size (the stripe width the keys were sharded with) is required "
                             f"when world={world} > 1")
        return SUPPORTED_BLOCK_SIZES[0]
    return int(block_size)


def select_top_p_padded(mass: torch.Tensor, p: float, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p rule of :func:`ds_mtraining.estimator.rule.select_top_p` on each row of ``mass``
    [..., n] (float32, non-negative, summing to at most 16): the fewest largest entries (ties to the
    lower index) whose mass reaches ``p`` times the row's total, at least 1 and at most ``cap``.

    Returns (indices int32 [..., min(cap, n)] ascending, ``PAD`` padded; count int32 [...])."""
    return tuple(_op().estimate_select(mass.float(), float(p), int(cap)))


def select_top_p_padded_pair(mass_a: torch.Tensor, p_a: float, cap_a: int, mass_b: torch.Tensor, p_b: float,
                      cap_b: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`select_top_p_padded` on two mass lists (each with its own ``p`` and ``cap``) in the same
    kernel launches: ((indices_a, count_a), (indices_b, count_b)), equal to two separate calls."""
    ia, ca, ib, cb = _op().estimate_select_pair(mass_a.float(), float(p_a), int(cap_a), mass_b.float(),
                                                float(p_b), int(cap_b))
    return (ia, ca), (ib, cb)


def build_index(slash_tokens: torch.Tensor, slash_count: torch.Tensor, columns: torch.Tensor,
                column_count: torch.Tensor, seq_len: int, config: SparseConfig) -> SparseIndex:
    """The index of :meth:`SparseIndex.from_vertical_slash` from selected token diagonals
    [B, H, a] (any order, first ``slash_count`` entries read) and selected key columns [B, H, c]
    (ascending, first ``column_count`` read), plus the sink tokens and local diagonals; lists of
    fixed width (``min(nb, local_blocks + 2 a)`` and ``min(sink_tokens, S) + c``)."""
    slash, s_count, vertical, v_count = _op().estimate_finalize(
        slash_tokens.int(), slash_count.int(), columns.int(), column_count.int(), int(seq_len),
        config.block_size, config.local_blocks, config.sink_tokens)
    return trusted_index(slash, s_count, vertical, v_count, seq_len, config.block_size)


# ---------------------------------------------------------------------- single device
@torch.no_grad()
def estimate_vertical_slash_cuda(q: torch.Tensor, k: torch.Tensor, config: SparseConfig,
                                 softmax_scale: float | None = None) -> SparseIndex:
    """:func:`ds_mtraining.estimator.rule.estimate_vertical_slash` on the GPU in eleven kernel launches
    (one a memset) and no host synchronisation. q [B, S, H, D], k [B, S, Hkv, D] (bfloat16 or
    float16, D 64, 128 or 256, on CUDA). The lists are fixed-width (``PAD`` tails); the selected
    entries equal the torch rule's up to float summation order (only entries at the top-p
    threshold can differ)."""
    check_qk(q, k)
    reason = supports(q, k, config, q.shape[1])
    if reason is not None:
        raise ValueError(f"estimate_vertical_slash_cuda: {reason}; use ds_mtraining.estimator.rule."
                         f"estimate_vertical_slash")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"q ({q.dtype}, {q.device}) and k ({k.dtype}, {k.device}) must share dtype and device")
    b, s, h, d = q.shape
    scale = resolve_softmax_scale(d, softmax_scale)
    lq = min(config.last_q, s)
    q_last = q[:, s - lq:]
    stats = row_stats(q_last, k, s - lq, s, scale)
    columns, diagonals = masses(q_last, k, *stats, s - lq, s, scale)
    (vertical, v_count), (slash, s_count) = select_top_p_padded_pair(
        columns, config.p_vertical, config.max_vertical, diagonals, config.p_slash, config.max_slash_diagonals)
    return build_index(slash, s_count, vertical, v_count, s, config)


def _kernels(passes):
    """``passes`` where a test gives torch versions of the passes, else this module's kernels."""
    return passes if passes is not None else sys.modules[__name__]


def merge_columns(selected: torch.Tensor, count: torch.Tensor, extra: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of ``selected`` [B, H, a] (int32, ascending, the first ``count`` [B, H] read) and
    each batch row's ``extra`` columns [B, e] (int32, ascending, ``PAD`` padded), ascending
    without repeats and ``PAD`` padded to a + e, with counts int32 [B, H]: one kernel, no host
    synchronisation."""
    return tuple(_op().estimate_merge_columns(selected, count, extra))


@remember_last
def document_sinks(doc_start: torch.Tensor, config: SparseConfig) -> torch.Tensor:
    """int32 [B, n]: :func:`~ds_mtraining.estimator.rule.document_sink_columns` of each batch row,
    ``PAD`` padded (remembered: one conversion per ``doc_start``)."""
    sinks = document_sink_columns(doc_start, 1, config)[:, 0]
    return torch.where(sinks < 0, PAD, sinks).to(torch.int32).contiguous()


def index_from_document_masses(columns: torch.Tensor, diagonals: torch.Tensor, config: SparseConfig,
                               doc_start: torch.Tensor, passes=None) -> SparseIndex:
    """:func:`ds_mtraining.estimator.rule.index_from_masses` with ``doc_start`` from the fused kernels:
    the top-p selection of both lists, every document's sinks merged into the selected columns
    (:func:`merge_columns`), the finalize kernel (its sequence sinks, tokens 0 .. sink_tokens - 1,
    are always among the documents' sinks). No host synchronisation once the step's documents
    are known (:func:`document_sinks` is remembered). The selected entries equal the torch rule's
    up to float summation order, as in :func:`estimate_vertical_slash_cuda`. ``passes``:
    ``select_top_p_padded_pair``, ``merge_columns`` and ``build_index`` (default: this module's kernels;
    tests pass torch versions)."""
    passes = _kernels(passes)
    (vertical, vertical_count), (slash, slash_count) = passes.select_top_p_padded_pair(
        columns, config.p_vertical, config.max_vertical, diagonals, config.p_slash, config.max_slash_diagonals)
    sinks = document_sinks(doc_start, config)
    if sinks.shape[-1] > 0:
        vertical, vertical_count = passes.merge_columns(vertical, vertical_count, sinks)
    return passes.build_index(slash, slash_count, vertical, vertical_count, columns.shape[-1], config)


def trimmed(index: SparseIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """(slash, vertical) cut to their longest row, as the torch estimator returns them (tests;
    synchronises)."""
    ws = max(int(index.slash_count.max()), 1)
    wv = max(int(index.vertical_count.max()), 1)
    return index.slash[..., :ws], index.vertical[..., :wv]


assert PAD == 1 << 30, "the kernels pad with 2^30 (estimate_api.cuh kPad)"


# ---------------------------------------------------------------------- documents
@remember_last
def position_slots(q_positions: torch.Tensor) -> dict[int, int]:
    """{global position: row} of ``q_positions`` (remembered: the ring passes the same
    positions object to every layer of a step)."""
    return {p: i for i, p in enumerate(q_positions.tolist())}


@remember_last
def document_table(doc_start: torch.Tensor, last_q: int, weight: str) -> tuple[list, list, list, list, list]:
    """(starts, lengths, rows, first scored positions, weights) of every document of every row, as
    host lists for the op (remembered: one host read per ``doc_start``)."""
    start, length, row = zip(*document_spans(doc_start))
    n = torch.tensor(length, dtype=torch.float64)  # host: the weights need no device
    scored = n.clamp(max=last_q)
    weights = DOCUMENT_WEIGHTS[weight](n, scored, doc_start.shape[1]).tolist()
    first_scored = [s + m - min(m, last_q) for s, m in zip(start, length)]
    return list(start), list(length), list(row), first_scored, weights


@torch.no_grad()
def document_masses(q: torch.Tensor, k: torch.Tensor, doc_start: torch.Tensor, last_q: int, scale: float,
                    q_positions: torch.Tensor | None = None, weight: str = "tokens"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ds_mtraining.estimator.rule.document_column_and_diagonal_mass` fused: column and
    token-diagonal masses [B, H, S] float32 of every document's last ``min(last_q, n)`` queries
    against its own keys, row means weighted by ``DOCUMENT_WEIGHTS[weight]``, summed per batch
    row. Every document is a contiguous slice of q and k, an ordinary causal sequence of n
    tokens: passes A and B of all documents run in the same launches (the op's
    ``estimate_document_masses``), whatever their number. The document list is read on the host
    once per ``doc_start`` (:func:`document_table`), and ``q_positions`` once per object
    (:func:`position_slots`).

    ``q``: [B, S, H, D], or with ``q_positions`` [B, len(q_positions), H, D], the rows at those
    global positions (at least :func:`~ds_mtraining.estimator.rule.document_query_positions`)."""
    starts, lengths, rows, first_scored, weights = document_table(doc_start, last_q, weight)
    if q_positions is not None:  # a document's scored rows are consecutive there too
        slots = position_slots(q_positions)
        first_scored = [slots[position] for position in first_scored]
    columns, diagonals = _op().estimate_document_masses(q, k, starts, lengths, rows, first_scored, weights,
                                                        int(last_q), float(scale))
    return columns, diagonals
