"""Document masking under the striped ring, the hierarchical ring and the Ulysses drop-in (gloo,
4 CPU ranks): each rank's outputs and gradients against one process (the CPU op) and against
float64 dense attention with the document mask intersected with the index's mask."""
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import every_entry_config, ring_inputs

from ds_mtraining import SparseConfig, sparse_attention
from ds_mtraining.distributed.spawn import run_on_ranks
from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
from ds_mtraining.layer import DistributedAttention
from ds_mtraining.reference import dense_attention, dense_mask, outputs_and_grads
from ds_mtraining.layout import StripedLayout
from ds_mtraining.ring import ring_sparse_attention
from ds_mtraining.distributed.topology import Topology, create_hierarchical_groups

BLOCK, WORLD = 64, 4
SEQ = WORLD * BLOCK * 2
TOL = dict(atol=1e-5, rtol=1e-5)         # fp32 ring vs fp32 single process
REF_TOL = dict(atol=2e-5, rtol=1e-4)     # fp32 vs float64
# a document shorter than a block, boundaries inside stripes, on stripe edges (64, 128) and
# documents spanning every rank
CU_SEQLENS = torch.tensor([0, 5, 64, 128, 140, 300, 301, 450, SEQ])
# p = 1, caps >= S: the drop-in's own estimate keeps every causal entry
FULL = every_entry_config(SEQ, BLOCK)


def inputs():
    return (*ring_inputs(SEQ, BLOCK), doc_start_from_cu_seqlens(CU_SEQLENS, SEQ))


def ring_worker(rank, world):
    q, k, v, dout, index, doc_start = inputs()
    layout = StripedLayout(world, BLOCK)
    config = SparseConfig(block_size=BLOCK)
    shards = [layout.shard(t, rank) for t in (q, k, v, dout)]
    flat = outputs_and_grads(lambda a, b, c: ring_sparse_attention(a, b, c, config, index=index,
                                                                   doc_start=doc_start), *shards)
    hierarchy = create_hierarchical_groups(Topology(2, 2), [list(range(world))])
    hier = outputs_and_grads(lambda a, b, c: ring_sparse_attention(a, b, c, config, index=index, hierarchy=hierarchy,
                                                                   doc_start=doc_start), *shards)
    # the drop-in on Ulysses' contiguous shards, boundaries as FlashAttention's cu_seqlens
    local = SEQ // world
    drop_in = DistributedAttention(functools.partial(F.scaled_dot_product_attention, is_causal=True),
                                   torch.distributed.group.WORLD, sparse_config=FULL)
    contiguous = [t[:, rank * local:(rank + 1) * local] for t in (q, k, v, dout)]
    ulysses = outputs_and_grads(lambda a, b, c: drop_in(a, b, c, 0, cu_seqlens=CU_SEQLENS), *contiguous)
    return flat, hier, ulysses


@pytest.mark.usefixtures("built_ops")  # built before the ranks start
def test_ring_and_hierarchical_ring_with_documents_equal_one_process():
    q, k, v, dout, index, doc_start = inputs()
    single = outputs_and_grads(lambda a, b, c: sparse_attention(a, b, c, index, doc_start=doc_start), q, k, v, dout)
    mask = dense_mask(index) & document_causal_mask(doc_start)[:, None]
    reference = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, mask), *(t.double() for t in (q, k, v, dout)))
    unmasked = sparse_attention(q, k, v, index)
    assert (unmasked - single[0]).abs().max() > 1e-2  # the documents change the output: the test can fail
    layout = StripedLayout(WORLD, BLOCK)
    for got, want in zip(single, reference):
        torch.testing.assert_close(got, want.float(), **REF_TOL)
    documents_only = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, document_causal_mask(doc_start)[:, None]),
                                       *(t.double() for t in (q, k, v, dout)))
    local = SEQ // WORLD
    for rank, (flat, hier, ulysses) in enumerate(run_on_ranks(ring_worker, WORLD, timeout=240)):
        for name, f, h, want in zip("out dq dk dv".split(), flat, hier, single):
            torch.testing.assert_close(f, layout.shard(want, rank), **TOL, msg=lambda m: f"flat {name} rank {rank}: {m}")
            torch.testing.assert_close(h, f, **TOL, msg=lambda m: f"hierarchical {name} rank {rank}: {m}")
        for name, got, want in zip("out dq dk dv".split(), ulysses, documents_only):
            torch.testing.assert_close(got, want[:, rank * local:(rank + 1) * local].float(), **REF_TOL,
                                       msg=lambda m: f"drop-in {name} rank {rank}: {m}")
