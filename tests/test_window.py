"""Sliding windows through the sparse kernels (ds_mtraining.window): outputs and gradients of
``sparse_attention(..., window=W)`` on the window's band index against float64 dense attention
under transformers' window mask (key j seen by query i iff i - W < j <= i), with and without
packed documents, windows shorter than, equal to and longer than a block, and longer than the
sequence. The 2-rank ring with windows is checked in tests/test_families.py."""
import pytest
import torch

from ds_mtraining import sparse_attention
from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
from ds_mtraining.reference import dense_attention, outputs_and_grads
from ds_mtraining.window import window_block_diagonals, window_index, window_key_start

SEQ, BLOCK, HEADS, KV_HEADS, DIM = 300, 64, 4, 2, 32  # SEQ: a partial last block
OUT_TOL = dict(rtol=0, atol=2e-6)   # fp32 kernels against float64, values of order 1
GRAD_TOL = dict(rtol=0, atol=1e-5)


def window_mask(seq_len: int, window: int, doc_start=None) -> torch.Tensor:
    """bool [S, S] (or [B, S, S] with documents), written from transformers' sliding_window_overlay."""
    i = torch.arange(seq_len)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return mask if doc_start is None else mask & document_causal_mask(doc_start)


@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
@pytest.mark.parametrize("window", [1, 5, 64, 65, 129, 1000])
def test_window_equals_float64_dense(cpu_op, window, documents):
    g = torch.Generator().manual_seed(window)
    q = torch.randn(1, SEQ, HEADS, DIM, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 1, SEQ, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(1, SEQ, HEADS, DIM, generator=g, dtype=torch.float64)
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 70, 201, SEQ]), SEQ) if documents else None
    index = window_index(1, HEADS, SEQ, BLOCK, window)
    got = outputs_and_grads(lambda a, b, c: sparse_attention(a, b, c, index, doc_start=doc_start, window=window),
                            q.float(), k.float(), v.float(), dout.float())
    mask = window_mask(SEQ, window, doc_start)
    want = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, mask), q, k, v, dout)
    for name, mine, reference in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(mine.double(), reference, **(OUT_TOL if name == "out" else GRAD_TOL), msg=name)


def test_window_index_reads_only_the_band():
    """The band's block diagonals: 0..(W + B - 2) // B, clipped to the sequence, no columns."""
    assert [window_block_diagonals(w, 64) for w in (1, 64, 65, 128, 129)] == [1, 2, 2, 3, 3]
    index = window_index(2, 3, 1024, 64, 100)
    assert index.slash.shape == (2, 3, 3) and index.slash[0, 0].tolist() == [0, 1, 2]
    assert int(index.vertical_count.max()) == 0
    assert window_index(1, 1, 300, 64, 10_000).slash[0, 0].tolist() == [0, 1, 2, 3, 4]  # whole sequence


def test_window_key_start_is_the_later_of_document_and_window():
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 4, 10]), 10)
    first = window_key_start(3, 1, 10, "cpu", doc_start)
    assert first.dtype == torch.int32
    assert first[0].tolist() == [0, 0, 0, 1, 4, 4, 4, 5, 6, 7]


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_a_window_that_is_no_token_count_is_refused(window):
    with pytest.raises(ValueError, match="sliding window .* must be a positive number of tokens"):
        window_index(1, 1, 128, 64, window)
