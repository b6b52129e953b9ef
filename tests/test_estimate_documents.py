"""Document masking in the estimator (rules 1'-2' of ds_mtraining.estimator.rule) and in the recall,
against plain float64 loops written here."""
import math

import pytest
import torch

from ds_mtraining import SparseConfig, SparseIndex, estimate_vertical_slash, synthetic
from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
from ds_mtraining.estimator import fused as estimate_cuda
from ds_mtraining.estimator.rule import (column_and_diagonal_mass, document_column_and_diagonal_mass,
                                         index_from_masses, last_query_scores, select_top_p)
from ds_mtraining.recall import attention_recall, recall
from ds_mtraining.reference import dense_attention_with_lse, dense_mask

# lengths of packings: a document shorter than a block (64) straddling a boundary, single tokens,
# and many short documents next to one long one
PACKINGS = {
    "mixed": [3, 40, 1, 100, 21, 155],
    "short-then-long": [5, 17, 2, 30, 9, 11, 1, 25] * 3 + [200],
    "long-then-short": [230, 1, 7, 60, 22],
}


def packed_qk(lengths, heads=4, kv_heads=2, dim=32, seed=0):
    """Noise q/k of the packing plus doc_start [1, S]."""
    s = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s, heads, dim, generator=g)
    k = torch.randn(1, s, kv_heads, dim, generator=g)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return q, k, doc_start_from_cu_seqlens(cu, s)


def loop_masses(q, k, doc_start, last_q, scale, weight):
    """Float64 column and token-diagonal masses of rules 1'-2', one query row at a time."""
    b, s, h, _ = q.shape
    group = h // k.shape[2]
    columns = torch.zeros(b, h, s, dtype=torch.float64)
    diagonals = torch.zeros(b, h, s, dtype=torch.float64)
    for row in range(b):
        starts = [t for t in range(s) if int(doc_start[row, t]) == t]
        documents = list(zip(starts, starts[1:] + [s]))
        scored = [min(last_q, end - begin) for begin, end in documents]
        for (begin, end), n_scored in zip(documents, scored):
            n = end - begin
            w = {"tokens": n / s, "queries": n_scored / sum(scored),
                 "entries": n * (n + 1) / sum((e - b_) * (e - b_ + 1) for b_, e in documents),
                 "documents": 1 / len(documents)}[weight]
            for head in range(h):
                for i in range(end - n_scored, end):
                    keys = k[row, begin:i + 1, head // group].double()
                    p = torch.softmax(scale * keys @ q[row, i, head].double(), 0)
                    columns[row, head, begin:i + 1] += p * w / n_scored  # key j = begin + index
                    diagonals[row, head, :i - begin + 1] += p.flip(0) * w / n_scored  # t = i - j
    return columns, diagonals


@pytest.mark.parametrize("weight", ["tokens", "queries", "entries", "documents"])
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_document_masses_equal_a_loop_over_rows(packing, weight):
    q, k, doc_start = packed_qk(PACKINGS[packing])
    scale = 1 / math.sqrt(q.shape[-1])
    columns, diagonals = document_column_and_diagonal_mass(q, k, doc_start, 16, scale, weight)
    expected_c, expected_d = loop_masses(q, k, doc_start, 16, scale, weight)
    torch.testing.assert_close(columns.double(), expected_c, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(diagonals.double(), expected_d, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(columns.sum(-1), torch.ones(1, 4), rtol=0, atol=1e-5)  # weights sum to 1


def test_two_batch_rows_with_their_own_packings():
    """Each batch row uses its own documents (one packing per row)."""
    lengths = ([3, 40, 1, 100, 21, 155], [200, 120])
    s = 320
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, s, 2, 16, generator=g), torch.randn(2, s, 1, 16, generator=g)
    doc_start = doc_start_from_cu_seqlens([torch.tensor([0, *n]).cumsum(0) for n in lengths], s, batch=2)
    got = document_column_and_diagonal_mass(q, k, doc_start, 24, 0.25)
    expected = loop_masses(q, k, doc_start, 24, 0.25, "tokens")
    for a, e in zip(got, expected):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("packing", list(PACKINGS))
def test_index_is_the_selection_of_the_loop_masses(packing):
    """Steps 3-4 run per sequence on the document masses: the index equals top-p (with caps) of the
    float64 loop masses, every document's own sinks (its first 2 tokens, or its one token) and the
    local blocks added."""
    lengths = PACKINGS[packing]
    q, k, doc_start = packed_qk(lengths, seed=1)
    config = SparseConfig(block_size=64, last_q=16, p_vertical=0.7, p_slash=0.8, max_vertical=50,
                          max_slash_diagonals=20, sink_tokens=2)
    columns, diagonals = loop_masses(q, k, doc_start, 16, 1 / math.sqrt(q.shape[-1]), "tokens")
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    sinks = torch.tensor([start + t for start, n in zip(starts, lengths) for t in range(min(2, n))])
    vertical = torch.cat([select_top_p(columns, config.p_vertical, config.max_vertical),
                          sinks.expand(1, 4, -1)], -1)
    slash = select_top_p(diagonals, config.p_slash, config.max_slash_diagonals)
    expected = SparseIndex.from_vertical_slash(vertical, slash, q.shape[1], 64)
    got = estimate_vertical_slash(q, k, config, doc_start=doc_start)
    assert torch.equal(got.slash, expected.slash) and torch.equal(got.vertical, expected.vertical)


@pytest.mark.parametrize("seq_len,last_q", [(1000, 64), (640, 100), (50, 64)])
def test_one_document_is_todays_estimator_bit_for_bit(seq_len, last_q):
    q, k = synthetic.planted_qk(seq_len, 4, 2, 64, offsets=(100, 30), columns=((7,), (20,)))
    scale = 0.125
    config = SparseConfig(block_size=64, last_q=last_q)
    one_document = torch.zeros(1, seq_len, dtype=torch.int32)
    pos = torch.arange(seq_len)
    lq = min(last_q, seq_len)
    today = column_and_diagonal_mass(torch.softmax(
        last_query_scores(q[:, seq_len - lq:], k, pos[seq_len - lq:], pos, scale), -1))
    for got, expected in zip(document_column_and_diagonal_mass(q, k, one_document, last_q, scale), today):
        assert torch.equal(got, expected)
    plain = estimate_vertical_slash(q, k, config)
    for index in (estimate_vertical_slash(q, k, config, doc_start=one_document),
                  estimate_vertical_slash(q, k, config, doc_start=None)):
        assert torch.equal(index.slash, plain.slash) and torch.equal(index.vertical, plain.vertical)


def test_a_short_document_keeps_its_pattern():
    """A short document (180 tokens, planted column at its key 30 and slash 70) before a long one
    (planted elsewhere): the document rule keeps the short document's column and diagonal, which
    scoring only the sequence's last queries would never see."""
    short = synthetic.planted_qk(180, 2, 1, 64, offsets=(70,), columns=((30,),), seed=1)
    long = synthetic.planted_qk(900, 2, 1, 64, offsets=(300,), columns=((500,),), seed=2)
    q, k = (torch.cat([a, b], 1) for a, b in zip(short, long))
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 180, 1080]), 1080)
    config = SparseConfig(block_size=64, sink_tokens=0)
    index = estimate_vertical_slash(q, k, config, doc_start=doc_start)
    mask = dense_mask(index)[0, 0]
    rows = torch.arange(70, 180)
    assert mask[rows, rows - 70].all(), "the short document's slash 70 is lost"
    assert mask[31:180, 30].all(), "the short document's column 30 is lost"
    long_rows = torch.arange(180 + 300, 1080)
    assert mask[180 + 500:, 180 + 500].all() and mask[long_rows, long_rows - 300].all()
    documents = document_causal_mask(doc_start)[0]
    short_rows = recall_of_rows(q, k, index, documents)[:, :180]
    assert short_rows.mean() > 0.9


def recall_of_rows(q, k, index, allowed):
    """Float64 [H, S]: each row's kept share of its softmax over the keys ``allowed`` [S, S]."""
    kept = dense_mask(index)[0] & allowed
    _, full = dense_attention_with_lse(q.double(), k.double(), k.double(), allowed.expand_as(kept)[None])
    _, part = dense_attention_with_lse(q.double(), k.double(), k.double(), kept[None])
    return torch.exp(part - full)[0]


def test_recall_with_documents_by_hand():
    """q = 0: row i is uniform over keys doc_start[i] .. i. Documents [0, 100) and [100, 128),
    index = the diagonal blocks (64) only. Rows 0-63 keep all; rows 64-99 keep keys 64..i of
    0..i; rows 100-127 keep all (their keys 100..i lie in block 1). Density: kept entries
    (i - max(64 block start, doc start) + 1 summed) over the document entries."""
    s = 128
    q, k = torch.zeros(1, s, 1, 16, dtype=torch.float64), torch.randn(1, s, 1, 16, dtype=torch.float64)
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 100, 128]), s)
    index = SparseIndex.from_blocks(torch.zeros(1, 1, 1, dtype=torch.long), torch.full((1, 1, 1), -1), s, 64)
    expected_recall = (64 + sum((i - 63) / (i + 1) for i in range(64, 100)) + 28) / s
    entries = sum(i + 1 for i in range(100)) + sum(i - 99 for i in range(100, 128))
    kept = sum(i + 1 for i in range(64)) + sum(i - 63 for i in range(64, 100)) + sum(i - 99 for i in range(100, 128))
    result = attention_recall(q, k, [index], 64, key_chunk=48, doc_start=doc_start)
    assert result.recall.item() == pytest.approx(expected_recall, abs=1e-13)
    assert result.density.item() == pytest.approx(kept / entries, abs=1e-15)
    without = attention_recall(q, k, [index], 64)
    assert without.recall.item() < expected_recall - 0.01, "without documents rows 100+ see block 0 too"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_recall_with_documents_equals_dense_attention(random_index, dtype, tol):
    """Random indices, GQA, a partial last block, key chunks that cut blocks, two batch rows with
    their own packings: recall and density equal the float64 dense document-masked attention."""
    s = 64 * 5 + 17
    q, k = synthetic.planted_qk(s, 4, 2, 32, offsets=(70, 150), columns=((3, 90), (200,)), batch=2, dtype=dtype)
    cu = [torch.tensor([0, 5, 6, 90, 250, s]), torch.tensor([0, 130, s])]
    doc_start = doc_start_from_cu_seqlens(cu, s, batch=2)
    documents = document_causal_mask(doc_start)
    indices = [random_index(2, 4, s, 64, n_vertical=6, n_slash=3, seed=seed) for seed in range(3)]
    result = attention_recall(q, k, indices, 64, key_chunk=100, doc_start=doc_start)
    for n, index in enumerate(indices):
        kept = dense_mask(index) & documents[:, None]
        _, full = dense_attention_with_lse(q.double(), k.double(), k.double(), documents[:, None].expand_as(kept))
        _, part = dense_attention_with_lse(q.double(), k.double(), k.double(), kept)
        torch.testing.assert_close(result.recall[n], torch.exp(part - full).mean(-1), rtol=0, atol=tol)
        torch.testing.assert_close(result.density[n], kept.sum((-1, -2)).double() / documents.sum((-1, -2))[:, None],
                                   rtol=0, atol=1e-15)
    torch.testing.assert_close(recall(q, k, indices[0], doc_start=doc_start), result.recall[0], rtol=0, atol=tol)


def distributed_documents_equal_single_device(rank, world):
    """The document-aware index from striped shards (keys and only the read query rows gathered)
    equals the single-device one: packings with documents shorter than a block, documents across
    ranks, last_q longer than short documents' windows, two batch rows packed differently."""
    from ds_mtraining.distributed.comm import RingComm
    from ds_mtraining.estimator import estimate_index
    from ds_mtraining.layout import StripedLayout
    comm = RingComm(None)
    block = 64
    seq_len = world * block * 4
    layout = StripedLayout(world, block)
    g = torch.Generator().manual_seed(world)
    q, k = torch.randn(2, seq_len, 4, 16, generator=g), torch.randn(2, seq_len, 2, 16, generator=g)
    rows = [torch.tensor([0, 3, 40, 41, 100, seq_len]), torch.tensor([0, seq_len - 70, seq_len])]
    doc_start = doc_start_from_cu_seqlens(rows, seq_len, 2)
    for last_q in (16, 64):
        config = SparseConfig(block_size=block, last_q=last_q, p_vertical=0.9, p_slash=0.9, max_slash_diagonals=40,
                              sink_tokens=2)
        expected = estimate_vertical_slash(q, k, config, doc_start=doc_start)
        got = estimate_index(layout.shard(q, rank), layout.shard(k, rank), config, comm, None, doc_start)
        assert torch.equal(got.slash, expected.slash), f"last_q {last_q}, W={world}: slash differs"
        assert torch.equal(got.vertical, expected.vertical), f"last_q {last_q}, W={world}: vertical differs"


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_documents_equal_single_device(world):
    from ds_mtraining.distributed.spawn import run_on_ranks
    run_on_ranks(distributed_documents_equal_single_device, world, timeout=120)


@pytest.mark.parametrize("lengths", [(300,), (2, 1, 60, 1, 200, 120), (130, 126, 128)])
def test_fused_document_index_equals_the_torch_rule(lengths):
    """estimate_cuda.index_from_document_masses (fused selection, the documents' sinks merged into
    the selected columns, fused finalize; here the torch versions of the two kernels) builds
    index_from_masses's index from the same masses: documents shorter than sink_tokens (so the
    finalize's sequence sinks fall in later documents), two batch rows packed differently."""
    from helpers import TorchPasses
    s = sum(lengths)
    cu = [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
          torch.tensor([0, *torch.tensor(lengths[::-1]).cumsum(0).tolist()])]
    doc_start = torch.cat([doc_start_from_cu_seqlens(c, s) for c in cu])
    q, k = synthetic.planted_qk(s, 4, 2, 32, offsets=(3, 40), columns=((2, 77), (150,)), batch=2)
    config = SparseConfig(block_size=64, last_q=64, p_vertical=0.8, p_slash=0.8, max_vertical=20,
                          max_slash_diagonals=30)
    masses = document_column_and_diagonal_mass(q, k, doc_start, config.last_q, 32 ** -0.5)
    expected = index_from_masses(*masses, config, doc_start)
    got = estimate_cuda.index_from_document_masses(*masses, config, doc_start, passes=TorchPasses)
    for name in ("slash", "slash_count", "vertical", "vertical_count"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_doc_start_checks_and_document_lists_are_read_once_per_tensor(monkeypatch):
    """check_doc_start and the document lists derived from it (also the query rows a ring
    gathers, and their slots) are remembered for the last doc_start object (the layers of a step
    share it) until it is modified in place; an invalid modification is still caught."""
    from ds_mtraining import documents
    from ds_mtraining.estimator.rule import document_query_positions, document_spans
    from ds_mtraining.estimator.fused import document_table, position_slots
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 3, 8, 20]), 20, batch=2)
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or original(self))
    checked = documents.check_doc_start(doc_start, 2, 20, "cpu")
    assert documents.check_doc_start(doc_start, 2, 20, "cpu") is checked
    assert document_spans(checked) == [(0, 3, 0), (3, 5, 0), (8, 12, 0), (0, 3, 1), (3, 5, 1), (8, 12, 1)]
    positions = document_query_positions(checked, 4)
    assert position_slots(positions)[positions[-1].item()] == len(positions) - 1
    # the fused op's list: each document's first scored query (its last min(4, n)) and weight n / S
    table = document_table(checked, 4, "tokens")
    assert table[3] == [0, 4, 16] * 2 and table[4] == pytest.approx([3 / 20, 5 / 20, 12 / 20] * 2, abs=1e-15)
    before = len(reads)
    assert document_spans(checked) == document_spans(checked)
    assert document_table(checked, 4, "tokens") is table
    # what a ring's later layers ask again: the query rows it gathers and their slots
    assert document_query_positions(checked, 4) is positions and position_slots(positions) is position_slots(positions)
    assert len(reads) == before, "the document list was read again"
    doc_start[1, 5:8] = 5  # in place: a new packing of row 1, [0, 3, 5, 8, 20]
    assert len(document_spans(documents.check_doc_start(doc_start, 2, 20, "cpu"))) == 7
    doc_start[0, 4] = 2  # not a packing
    with pytest.raises(ValueError, match="not a packing"):
        documents.check_doc_start(doc_start, 2, 20, "cpu")
    with pytest.raises(ValueError, match=r"must be \[B, S\]"):
        documents.check_doc_start(doc_start_from_cu_seqlens(torch.tensor([0, 20]), 20), 2, 20, "cpu")
