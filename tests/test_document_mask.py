"""Document masking in the CPU op against float64 dense attention.

The reference mask is ``documents.document_causal_mask(doc_start) & reference.dense_mask(index,
stripe)``; out, lse and all three gradients are compared (fp32 inputs: relative tolerance 1e-5
of the largest reference magnitude, as tests/test_attention.py). Covered: many short documents
and one long one, documents shorter than a block, boundaries inside blocks and across stripes
and ranks (every ring step of world 2 and 4), no masking (empty doc_start) unchanged bit for
bit, and the op's errors for a malformed doc_start.
"""
import math

import pytest
import torch

from ds_mtraining import Stripe, ops, sparse_attention_with_lse
from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
from ds_mtraining.reference import dense_mask
from ds_mtraining.layout import StripedLayout
from test_attention import assert_matches, dense_reference, random_qkv

TOLERANCE = 1e-5  # fp32 kernels vs float64


def packing(seq_len, lengths):
    """cu_seqlens of documents of these lengths, then one more holding the rest."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    assert cu[-1] < seq_len
    return torch.tensor(cu + [seq_len])


def document_mask(doc_start, index, stripe=Stripe()):
    """Bool [B, H, Sq, Sk] masks of a call: (the entries it computes with document masking, those
    it computes without)."""
    mask = document_causal_mask(doc_start)
    if stripe.world > 1:
        layout = StripedLayout(stripe.world, index.block_size)
        rows = layout.positions(index.seq_len, stripe.q_rank)
        cols = layout.positions(index.seq_len, stripe.k_rank)
        mask = mask[:, rows][:, :, cols]
    index_mask = dense_mask(index, stripe)
    return mask[:, None] & index_mask, index_mask


def test_single_device_documents_match_dense(cpu_op, random_index):
    """Row 0: many short documents (some shorter than a block) then one long one; row 1: a long
    one first, then short ones; the last block is partial. Through the public autograd API."""
    batch, seq, heads, kv_heads, dim, block = 2, 300, 4, 2, 40, 64
    doc_start = doc_start_from_cu_seqlens([packing(seq, [3, 5, 17, 30, 1, 2, 50, 9]),
                                           packing(seq, [140, 7, 60, 13])], seq, batch)
    index = random_index(batch, heads, seq, block, n_vertical=40, n_slash=6, seed=1)
    generator = torch.Generator().manual_seed(1)
    q, k, v = random_qkv(batch, seq, heads, kv_heads, dim, torch.float32, generator, q_gain=2.0)
    mask, index_mask = document_mask(doc_start, index)
    assert (index_mask & ~mask).any(), "the documents must mask entries the index keeps"

    out, lse = sparse_attention_with_lse(q, k, v, index, doc_start=doc_start)
    dout = torch.randn(out.shape, generator=generator)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_lse, ref_grads = dense_reference(q, k, v, mask, dout)
    assert torch.isfinite(lse).all(), "every token sees itself"
    assert_matches(lse, ref_lse, TOLERANCE, "lse")
    assert_matches(out, ref_out, TOLERANCE, "out")
    for name, grad, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_matches(grad, ref, TOLERANCE, name)


@pytest.mark.parametrize("world", [2, 4])
def test_striped_ring_steps_match_dense(cpu_op, random_index, world):
    """Every (q_rank, k_rank) call computes exactly the document mask of its step's keys: documents
    start inside blocks, span stripes of several ranks, and some are shorter than a block; rows
    whose keys in a step all lie before their document give out 0 and lse -inf."""
    block, local_blocks, heads, kv_heads, dim = 64, 2, 2, 1, 32
    seq = world * local_blocks * block
    local = seq // world
    lengths = [40, 100, 3, 70] if world == 2 else [200, 5, 60, 61, 130, 9, 1]
    doc_start = doc_start_from_cu_seqlens([packing(seq, lengths), packing(seq, lengths[::-1])], seq, 2)
    index = random_index(2, heads, seq, block, n_vertical=24, n_slash=6, seed=world)
    scale = 1.0 / math.sqrt(dim)
    generator = torch.Generator().manual_seed(world)
    empty_rows = 0
    # world 4: the query ranks 1 and 3 against every key rank (keys before, after and the same
    # rank), half of the float64 references that dominate the time
    for q_rank in range(world) if world == 2 else (1, 3):
        for k_rank in range(world):
            stripe = Stripe(world, q_rank, k_rank)
            q, k, v = (t.detach() for t in random_qkv(2, local, heads, kv_heads, dim, torch.float32, generator))
            out, lse = ops.attention_forward(q, k, v, index, scale, stripe, doc_start=doc_start)
            dout = torch.randn(out.shape, generator=generator)
            grads = ops.attention_backward(dout, q, k, v, out, lse, index, scale, stripe, doc_start=doc_start)
            mask, index_mask = document_mask(doc_start, index, stripe)
            ref_out, ref_lse, ref_grads = dense_reference(q, k, v, mask, dout, scale)
            where = f"stripe {stripe}"
            empty = ~mask.any(-1)
            empty_rows += int((empty & index_mask.any(-1)).sum())
            assert (lse[empty] == float("-inf")).all() and (out.transpose(1, 2)[empty] == 0).all(), where
            if (~empty).any():
                assert_matches(lse[~empty], ref_lse[~empty], TOLERANCE, f"{where} lse")
            assert_matches(out, ref_out, TOLERANCE, f"{where} out")
            for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
                assert not torch.isnan(grad).any(), f"{where}: NaN in {name}"
                assert_matches(grad, ref, TOLERANCE, f"{where} {name}")
    assert empty_rows > 0, "some rows must lose all of a step's keys to their document start"


def test_no_masking_is_unchanged_bit_for_bit(cpu_op, random_index):
    """An empty doc_start (the default), and one document spanning the whole sequence, give exactly
    the results without document masking."""
    seq, world = 256, 2
    index = random_index(1, 4, seq, 64, n_vertical=20, n_slash=5, seed=5)
    generator = torch.Generator().manual_seed(5)
    q, k, v = (t.detach() for t in random_qkv(1, seq // world, 4, 2, 64, torch.float32, generator))
    dout = torch.randn(q.shape, generator=generator)
    one_document = torch.zeros(1, seq, dtype=torch.int32)
    results = []
    for doc_start in (None, torch.empty(0, dtype=torch.int32), one_document):
        stripe = Stripe(world, 1, 0)
        out, lse = ops.attention_forward(q, k, v, index, 0.125, stripe, doc_start=doc_start)
        results.append((out, lse) + ops.attention_backward(dout, q, k, v, out, lse, index, 0.125, stripe,
                                                           doc_start=doc_start))
    for other in results[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other):
            assert torch.equal(a, b), f"{name} differs"


def test_rejects_malformed_doc_start(cpu_op, random_index):
    """One clear error for each way the op's doc_start entry can be wrong, and for a doc_start
    that is no packing at the public API."""
    seq, world = 256, 2
    index = random_index(1, 4, seq, 64)
    q = torch.randn(1, seq // world, 4, 32)
    k = v = torch.randn(1, seq // world, 2, 32)
    good = torch.zeros(1, seq, dtype=torch.int32)

    def call(doc_start):
        return cpu_op.forward(q, k, v, ops.op_index(index, Stripe(world, 0, 1), doc_start), 0.125)

    call(good)
    bad = [
        (TypeError, "doc_start must be int32, got Long", good.long()),
        (ValueError, r"doc_start must be \[batch, global seq\] = \[1, 256\] .* got \[1, 128\]",
         good[:, : seq // world]),
        (ValueError, r"doc_start must be \[batch, global seq\] = \[1, 256\] .* got \[256\]", good[0]),
        (ValueError, "doc_start is on meta but q is on cpu", good.to("meta")),
        (ValueError, "doc_start must be contiguous", torch.zeros(1, 2 * seq, dtype=torch.int32)[:, ::2]),
    ]
    for error, message, doc_start in bad:
        with pytest.raises(error, match=message):
            call(doc_start)
    old_index = {name: value for name, value in ops.op_index(index).items() if name != "doc_start"}
    with pytest.raises(ValueError, match="the index has no 'doc_start' entry"):
        cpu_op.forward(q, k, v, old_index, 0.125)
    with pytest.raises(ValueError, match="doc_start is not a packing"):
        full = torch.randn(1, seq, 4, 32)
        sparse_attention_with_lse(full, full, full, index, doc_start=torch.ones(1, seq, dtype=torch.int32))


def test_benchmark_flex_mask_with_documents_is_the_oracle_mask():
    """bench.kernel's FlexAttention anchor computes exactly the documents-and-index entries: its
    mask_mod equals the oracle mask, its block lists hold every block the mask touches and no
    other, and its full (unmasked) blocks lie wholly inside the mask."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from ds_mtraining.bench.kernel import FlexMask, build_index, random_doc_start
    seq, block, heads = 2048, 64, 2
    generator = torch.Generator().manual_seed(0)
    doc_start = random_doc_start(seq, 100, 500, generator)
    index = build_index(1, heads, seq, block, 6, generator, torch.unique(doc_start).tolist())
    flex = FlexMask(1, heads, seq, block, "cpu", doc_start)
    block_mask, _ = flex.for_index(index)
    want = dense_mask(index) & document_causal_mask(doc_start)[:, None]
    rows, cols = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    got = torch.stack([flex.mask_mod(torch.tensor(0), torch.tensor(h), rows, cols) for h in range(heads)])[None]
    assert torch.equal(got, want)
    nb = seq // block
    touched = want.view(1, heads, nb, block, nb, block).any(-1).any(-2)
    assert torch.equal(block_mask.to_dense().bool(), touched)
    inside = want.view(1, heads, nb, block, nb, block).all(-1).all(-2)
    full = torch.zeros_like(touched)
    for h in range(heads):
        counts, indices = block_mask.full_kv_num_blocks[0, h], block_mask.full_kv_indices[0, h]
        for q_block in range(nb):
            full[0, h, q_block, indices[q_block, :counts[q_block]].long()] = True
    assert full.any() and bool((inside | ~full).all())
