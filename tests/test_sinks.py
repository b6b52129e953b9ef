"""Attention sinks (ds_mtraining.sinks, gpt-oss's s_aux) on one process: outputs and the gradients
of q, k, v and the sinks against float64 dense attention with the sink as an extra softmax
column (as transformers' eager gpt-oss attention computes it), with and without documents and
a window. The 2-rank ring with sinks is checked in tests/test_families.py."""
import pytest
import torch

from ds_mtraining import sparse_attention
from ds_mtraining.documents import doc_start_from_cu_seqlens
from helpers import ring_inputs, visible_mask

SEQ, BLOCK = 300, 64
TOL = dict(atol=2e-5, rtol=1e-4)  # fp32 kernels against float64


def sink_attention(q, k, v, mask, sinks, scale=None, softcap=None):
    """float64 reference: softmax over [scores | sink] per row, the sink column dropped; q [B, S, H, D],
    k/v [B, S, Hkv, D], mask [S, S] or [B, 1 or H, S, S] bool, sinks [H]; scores soft-capped at
    ``softcap`` when given."""
    heads, kv_heads = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
    scale = scale or q.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    column = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("case", ["plain", "documents", "window"])
def test_sinks_equal_float64(cpu_op, case):
    q, k, v, dout, index = ring_inputs(SEQ, BLOCK, seed=3)
    sinks = torch.tensor([1.0, -2.0, 0.3, 3.0])
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 90, 91, SEQ]), SEQ) if case == "documents" else None
    window = 70 if case == "window" else None
    mask = visible_mask(index, doc_start, window)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = sparse_attention(*inputs[:3], index, doc_start=doc_start, window=window, sinks=inputs[3])
    out.backward(dout)
    reference = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    want = sink_attention(*reference[:3], mask, reference[3])
    want.backward(dout.double())
    no_sinks = sparse_attention(q, k, v, index, doc_start=doc_start, window=window)
    assert (no_sinks - out).abs().max() > 1e-2  # the sinks change the output: the test can fail
    torch.testing.assert_close(out, want.detach().float(), **TOL)
    for name, mine, theirs in zip(("dq", "dk", "dv", "dsinks"), inputs, reference):
        torch.testing.assert_close(mine.grad, theirs.grad.float(), **TOL, msg=name)


def test_sinks_of_another_shape_are_refused():
    q, k, v, _, index = ring_inputs(SEQ, BLOCK)
    with pytest.raises(ValueError, match=r"attention sinks must be a tensor of one logit per query head \[4\]"):
        sparse_attention(q, k, v, index, sinks=torch.zeros(2))
