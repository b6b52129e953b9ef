"""GPU tests of bringing one's own model: sliding windows through the CUDA kernels against float64
dense attention (bf16 and fp16, head_dim 64, 128 and 256, GQA, packed documents, a partial last block,
on both kernel blocks), head dims the kernels lack (32, 80, 96, 192) zero-padded, float32 inputs in
bfloat16 with one warning, logit soft-capping against float64, and families of the matrix
(ds_mtraining.families) in bf16 against the same model with SDPA (eager where SDPA lacks the
feature). Skipped without CUDA."""
from __future__ import annotations

import warnings

import pytest
import torch

from ds_mtraining import sparse_attention
from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
from ds_mtraining.reference import dense_attention, outputs_and_grads
from ds_mtraining.window import window_index

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOLERANCE = 2e-2  # relative Frobenius error of bf16/fp16 kernels against float64 (tests/test_cuda_attention.py)
ZERO_GRADIENT_ATOL = 1e-5  # where the float64 gradient is exactly 0 (seen: up to 3e-7, rounding of dP - delta)
LOSS_RTOL = 2e-3  # a whole model's loss, bf16 MTraining (full index) against bf16 SDPA


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "NaN or inf"
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("window,documents", [(1, False), (100, False), (100, True), (700, True), (5000, False)])
def test_window_through_the_cuda_kernels_equals_float64(dtype, head_dim, block, window, documents):
    seq = 2048 + 37  # a partial last block
    g = torch.Generator().manual_seed(window + head_dim)
    q = torch.randn(1, seq, 8, head_dim, generator=g)
    k, v = torch.randn(2, 1, seq, 2, head_dim, generator=g)
    dout = torch.randn(1, seq, 8, head_dim, generator=g)
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 300, 301, 1500, seq]), seq) if documents else None
    index = window_index(1, 8, seq, block, window, "cuda")
    got = outputs_and_grads(
        lambda a, b, c: sparse_attention(a, b, c, index, doc_start=None if doc_start is None else doc_start.cuda(),
                                         window=window),
        *(t.to("cuda", dtype) for t in (q, k, v, dout)))
    i = torch.arange(seq)
    mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
    if documents:
        mask = mask & document_causal_mask(doc_start)[0]
    want = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, mask.cuda()),
                             *(t.to("cuda", torch.float64) for t in (q, k, v, dout)))
    for name, mine, reference in zip(("out", "dq", "dk", "dv"), got, want):
        if not reference.any():  # window 1: each row sees itself alone, so no score has a gradient
            assert float(mine.abs().max()) < ZERO_GRADIENT_ATOL, name
        else:
            assert relative_error(mine, reference) < TOLERANCE, name


@pytest.mark.parametrize("head_dim", [32, 80, 96, 192])
@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
def test_a_head_dim_the_kernels_lack_runs_padded_and_equals_float64(head_dim, documents):
    """Zero-padded to the next kernel head_dim (ds_mtraining.attention.padded_to_kernel_head_dim),
    with its own scale 1/sqrt(D): outputs and gradients in [.., D], against float64."""
    from ds_mtraining.index import SparseIndex
    from ds_mtraining.reference import dense_mask
    seq, block = 1024 + 17, 64
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(1, seq, 8, head_dim, generator=g)
    k, v = torch.randn(2, 1, seq, 2, head_dim, generator=g)
    dout = torch.randn(1, seq, 8, head_dim, generator=g)
    index = SparseIndex.from_blocks(torch.randint(1, seq // block, (1, 8, 4), generator=g),
                                    torch.randint(0, seq, (1, 8, 16), generator=g), seq, block)
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 200, 700, seq]), seq) if documents else None
    got = outputs_and_grads(
        lambda a, b, c: sparse_attention(a, b, c, index.to("cuda"),
                                         doc_start=None if doc_start is None else doc_start.cuda()),
        *(t.to("cuda", torch.bfloat16) for t in (q, k, v, dout)))
    mask = dense_mask(index)
    if documents:
        mask = mask & document_causal_mask(doc_start)[:, None]
    want = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, mask.cuda()),
                             *(t.to("cuda", torch.float64) for t in (q, k, v, dout)))
    for name, mine, reference in zip(("out", "dq", "dk", "dv"), got, want):
        assert mine.shape == reference.shape, name
        assert relative_error(mine, reference) < TOLERANCE, name


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinks_through_the_cuda_kernels_equal_float64(dtype, head_dim):
    from test_sinks import sink_attention
    from ds_mtraining.index import SparseIndex
    from ds_mtraining.reference import dense_mask
    seq, block = 2048 + 37, 128
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, seq, 8, head_dim, generator=g)
    k, v = torch.randn(2, 1, seq, 2, head_dim, generator=g)
    dout = torch.randn(1, seq, 8, head_dim, generator=g)
    sinks = torch.randn(8, generator=g) * 2
    index = SparseIndex.from_blocks(torch.randint(1, seq // block, (1, 8, 4), generator=g),
                                    torch.randint(0, seq, (1, 8, 16), generator=g), seq, block)
    mine = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)] + [sinks.cuda().requires_grad_()]
    sparse_attention(*mine[:3], index.to("cuda"), sinks=mine[3]).backward(dout.to("cuda", dtype))
    theirs = [t.to("cuda", torch.float64).requires_grad_() for t in (q, k, v, sinks)]
    sink_attention(*theirs[:3], dense_mask(index).cuda(), theirs[3]).backward(dout.to("cuda", torch.float64))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), mine, theirs):
        assert relative_error(a.grad, b.grad) < TOLERANCE, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
def test_softcap_through_the_cuda_kernels_equals_float64(dtype, head_dim, block, documents):
    """Logit soft-capping (softmax.cuh's Logits) forward and backward, GQA, a partial last block,
    against float64 dense attention over the capped logits; a cap of 2 against logits of a few
    units bends most of them (the test checks that it changes the output)."""
    check_softcap(dtype, head_dim, block, documents)


@pytest.mark.parametrize("override", ["MMA=warp", "QUERY=plain", "TMA=0"])
def test_softcap_on_every_kernel_path(override, monkeypatch):
    """The same on the kernel paths the device does not pick by default (mma.sync, the plain
    query kernel, cp.async copies: DS_MTRAINING_CUDA_* overrides, reloaded around the test)."""
    from ds_mtraining import ops
    module = ops.op_module("cuda")
    name, value = override.split("=")
    monkeypatch.setenv(f"DS_MTRAINING_CUDA_{name}", value)
    module.reload_kernel_options()
    try:
        check_softcap(torch.bfloat16, 128, 128, True)
    finally:
        monkeypatch.undo()
        module.reload_kernel_options()


def check_softcap(dtype, head_dim, block, documents):
    from ds_mtraining.index import SparseIndex
    from ds_mtraining.reference import dense_mask
    seq, cap = 2048 + 37, 2.0
    g = torch.Generator().manual_seed(head_dim + block)
    q = torch.randn(1, seq, 8, head_dim, generator=g) * 2
    k, v = torch.randn(2, 1, seq, 2, head_dim, generator=g)
    dout = torch.randn(1, seq, 8, head_dim, generator=g)
    index = SparseIndex.from_blocks(torch.randint(1, seq // block, (1, 8, 4), generator=g),
                                    torch.randint(0, seq, (1, 8, 16), generator=g), seq, block)
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 300, 301, 1500, seq]), seq) if documents else None
    cuda_doc_start = None if doc_start is None else doc_start.cuda()
    inputs = [t.to("cuda", dtype) for t in (q, k, v, dout)]
    got = outputs_and_grads(lambda a, b, c: sparse_attention(a, b, c, index.to("cuda"), doc_start=cuda_doc_start,
                                                             softcap=cap), *inputs)
    uncapped = sparse_attention(*inputs[:3], index.to("cuda"), doc_start=cuda_doc_start)
    mask = dense_mask(index)
    if documents:
        mask = mask & document_causal_mask(doc_start)[:, None]
    want = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, mask.cuda(), softcap=cap),
                             *(t.to("cuda", torch.float64) for t in (q, k, v, dout)))
    assert relative_error(uncapped, want[0]) > 10 * TOLERANCE  # the cap changes the result
    for name, mine, reference in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(mine, reference) < TOLERANCE, name


def test_float32_inputs_run_in_bfloat16_with_one_warning():
    from ds_mtraining.config import SparseConfig
    from ds_mtraining.layer import MTrainingAttentionSettings, attention as layer_attention
    from ds_mtraining.static import StaticPattern
    layer_attention._warned_float32.clear()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1024, 4, 64, generator=g).cuda()
    k, v = torch.randn(2, 1, 1024, 2, 64, generator=g).cuda()
    # every causal entry, through the sparse kernels
    settings = MTrainingAttentionSettings(SparseConfig(block_size=64), pattern=StaticPattern(window_tokens=1024))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = layer_attention.striped_sparse_attention(q, k, v, settings)
        again = layer_attention.striped_sparse_attention(q, k, v, settings)
    messages = [str(w.message) for w in caught if "float32" in str(w.message)]
    assert len(messages) == 1 and '"bf16": {"enabled": true}' in messages[0]
    assert out.dtype == torch.float32 and torch.equal(out, again)
    bf16 = layer_attention.striped_sparse_attention(*(t.bfloat16() for t in (q, k, v)), settings)
    torch.testing.assert_close(out, bf16.float(), rtol=0, atol=0)


@pytest.mark.parametrize("name,head_dim", [("Llama", 64), ("Mistral", 64), ("Gemma-3 (text)", 64), ("Granite", 64),
                                           ("Qwen2 (sliding window)", 64), ("Phi-3", 96), ("gpt-oss", 64),
                                           ("Gemma-2", 256), ("Gemma", 256)])
def test_family_in_bf16_with_a_full_index_matches_sdpa(name, head_dim):
    from transformers import AutoModelForCausalLM
    from ds_mtraining.config import SparseConfig
    from ds_mtraining.families import family, public_shape_config
    from ds_mtraining.hf import use_mtraining_attention
    from ds_mtraining.layer import MTrainingAttentionSettings
    from ds_mtraining.static import StaticPattern
    from ds_mtraining.training.model import MTrainingCausalLM
    seq = 4096
    config = public_shape_config(family(name), head_dim=head_dim, window=1000)
    ids = torch.randint(0, config.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(1)).cuda()

    def build(attention):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention).to("cuda", torch.bfloat16)
    # transformers' SDPA takes no sinks and no soft-capping
    reference = build("eager" if name in ("gpt-oss", "Gemma-2") else "sdpa")
    want = torch.nn.functional.cross_entropy(reference(input_ids=ids[:, :-1]).logits[0].float(), ids[0, 1:])
    model = build("eager")
    pattern = StaticPattern(window_tokens=seq, sink_tokens=0)  # every causal entry, through MTraining's kernels
    use_mtraining_attention(model, MTrainingAttentionSettings(SparseConfig(block_size=128), pattern=pattern), "cuda")
    got = MTrainingCausalLM(model, None, 1024)(ids[:, :-1], ids[:, 1:], torch.arange(seq, device="cuda")[None])
    torch.testing.assert_close(got.float(), want, rtol=LOSS_RTOL, atol=0)
