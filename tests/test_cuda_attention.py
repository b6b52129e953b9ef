"""GPU tests of the CUDA sparse attention kernels against float64 dense attention.

Every check compares with ``reference.dense_attention_with_lse`` in float64 on the mask
``reference.dense_mask(index)`` (or ``reference.mask_between`` rows, for the long shape), outputs and
gradients, by relative Frobenius error; with document masking on that mask intersected with
``documents.document_causal_mask(doc_start)``. Skipped without a CUDA device.
"""
from __future__ import annotations

import math

import pytest
import torch

from ds_mtraining import ops
from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
from ds_mtraining.index import PAD, SparseIndex, Stripe
from ds_mtraining.reference import dense_attention_with_lse, dense_mask, mask_between
from ds_mtraining.layout import StripedLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOLERANCE = 2e-2  # relative error for bf16/fp16 inputs (the kernels' stated bound)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "kernel output holds NaN or inf"
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def poison_allocator(nbytes: int = 1 << 28):
    """Fills freed cached memory with NaN so that outputs the kernels leave unwritten show up."""
    torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).fill_(float("nan"))


def random_index(batch, heads, seq, block, n_slash, n_vertical, generator) -> SparseIndex:
    blocks = -(-seq // block)
    slash = torch.randint(1, max(blocks, 2), (batch, heads, n_slash), generator=generator)
    vertical = torch.randint(0, seq, (batch, heads, n_vertical), generator=generator)
    return SparseIndex.from_blocks(slash, vertical, seq, block, local_blocks=1).to("cuda")


def random_qkv(batch, seq, heads, kv_heads, dim, dtype, generator):
    def make(h):
        return torch.randn(batch, seq, h, dim, generator=generator).to("cuda", dtype)
    return make(heads), make(kv_heads), make(kv_heads)


def random_doc_start(batch, seq, generator):
    """CUDA doc_start of random packings: documents of 1-8 tokens (inside one key tile), 9-69 and
    70-299 tokens (across tiles, blocks and stripes) until half the sequence, then a long one."""
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq // 2:
            low, high = [(1, 9), (9, 70), (70, 300)][int(torch.randint(0, 3, (1,), generator=generator))]
            lengths.append(int(torch.randint(low, high, (1,), generator=generator)))
        cu = torch.tensor([0] + lengths).cumsum(0)
        rows.append(torch.cat([cu[cu < seq], torch.tensor([seq])]))
    return doc_start_from_cu_seqlens(rows, seq, batch).cuda()


def with_documents(mask, doc_start):
    """The index's dense mask [B, H, S, S] restricted to the documents (unchanged for None)."""
    return mask if doc_start is None else mask & document_causal_mask(doc_start)[:, None]


def reference_with_grads(q, k, v, mask, dout, scale):
    """Float64 dense masked attention and its autograd gradients."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = dense_attention_with_lse(q64, k64, v64, mask, scale)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def kernel_with_grads(q, k, v, index, dout, scale, stripe=Stripe(), doc_start=None):
    poison_allocator()
    out, lse = ops.attention_forward(q, k, v, index, scale, stripe, doc_start=doc_start)
    poison_allocator()
    dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, index, scale, stripe, doc_start=doc_start)
    return out, lse, dq, dk, dv


def assert_matches(kernel, reference, label):
    names = ("out", "lse", "dq", "dk", "dv")
    for name, actual, expected in zip(names, kernel, reference):
        if name == "lse":
            finite = torch.isfinite(expected)
            assert torch.equal(torch.isfinite(actual), finite), f"{label}: lse finiteness differs"
            assert not torch.isnan(actual).any(), f"{label}: lse holds NaN"
            error = float((actual.double() - expected)[finite].abs().max()) if finite.any() else 0.0
            assert error < 5e-2, f"{label}: lse max abs error {error:.3g}"
            continue
        error = relative_error(actual, expected)
        assert error <= TOLERANCE, f"{label}: {name} relative error {error:.3g} > {TOLERANCE}"


SHAPES = [
    # batch, seq, heads, kv_heads, dim, block, n_slash, n_vertical, dtype
    (2, 1000, 4, 2, 128, 64, 3, 40, torch.bfloat16),    # partial last block, GQA 2:1
    (1, 1024, 8, 1, 64, 128, 2, 24, torch.float16),     # GQA 8:1, head_dim 64, fp16
    (1, 2048, 2, 2, 128, 128, 6, 300, torch.bfloat16),  # many vertical columns (several tiles)
    (1, 777, 2, 1, 64, 64, 4, 3000, torch.bfloat16),    # more vertical candidates than one window
    (2, 1000, 4, 2, 256, 64, 3, 40, torch.bfloat16),    # head_dim 256: column-part key kernels, partial block
    (1, 2048, 4, 1, 256, 128, 6, 300, torch.float16),   # head_dim 256, GQA 4:1, many vertical columns
]


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}S{s[1]}H{s[2]}KV{s[3]}D{s[4]}bs{s[5]}")
def test_matches_dense_reference(shape, documents):
    batch, seq, heads, kv_heads, dim, block, n_slash, n_vertical, dtype = shape
    generator = torch.Generator().manual_seed(seq + heads)
    q, k, v = random_qkv(batch, seq, heads, kv_heads, dim, dtype, generator)
    index = random_index(batch, heads, seq, block, n_slash, n_vertical, generator)
    dout = torch.randn(batch, seq, heads, dim, generator=generator).to("cuda", dtype)
    doc_start = random_doc_start(batch, seq, generator) if documents else None
    scale = 1.0 / math.sqrt(dim)
    reference = reference_with_grads(q, k, v, with_documents(dense_mask(index).cuda(), doc_start), dout, scale)
    assert_matches(kernel_with_grads(q, k, v, index, dout, scale, doc_start=doc_start), reference, str(shape))


@pytest.fixture
def kernel_env(monkeypatch):
    """Sets DS_MTRAINING_CUDA_* test/debug overrides of the kernel paths for one test: the module
    reads them once, so each change and the restore at the end reload them."""
    module = ops.op_module("cuda")

    def set_options(**options):
        for name, value in options.items():
            monkeypatch.setenv(f"DS_MTRAINING_CUDA_{name}", value)
        module.reload_kernel_options()

    yield set_options
    monkeypatch.undo()
    module.reload_kernel_options()


def test_kernel_paths_are_chosen_by_architecture(kernel_env, monkeypatch):
    """Without overrides the paths follow the device (heuristics.h's choose_kernel_paths): on
    compute capability 9.x wgmma, TMA and the warp-specialised query kernels, elsewhere mma.sync,
    cp.async and the plain ones; dQ beside dK/dV everywhere. An override changes its path only."""
    module = ops.op_module("cuda")
    for name in ("MMA", "TMA", "CONCURRENT_DQ", "QUERY"):
        monkeypatch.delenv(f"DS_MTRAINING_CUDA_{name}", raising=False)
    module.reload_kernel_options()
    hopper = torch.cuda.get_device_capability()[0] == 9
    paths = dict(module.kernel_paths(torch.cuda.current_device()))
    assert paths == {"tensor_cores": "wgmma" if hopper else "mma.sync", "tma": hopper, "concurrent_dq": True,
                     "query": "specialized" if hopper else "plain"}
    kernel_env(CONCURRENT_DQ="0")
    assert dict(module.kernel_paths(torch.cuda.current_device())) == {**paths, "concurrent_dq": False}


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("mma, tma", [("warp", "1"), ("auto", "1"), ("auto", "0")])
def test_tensor_core_paths_agree(mma, tma, documents, kernel_env):
    """Every kernel path (mma.sync; wgmma on Hopper, else mma.sync again; with TMA copies of the
    contiguous tiles or cp.async only) matches the reference, forward and gradients, at head_dim 64,
    128 and 256 (mma.sync there: 64-row CTAs, one pipeline stage, as on sm_80) and both block sizes,
    with and without document masking."""
    kernel_env(MMA=mma, TMA=tma)
    paths = ops.op_module("cuda").kernel_paths(torch.cuda.current_device())
    assert paths["tma"] == (paths["tensor_cores"] == "wgmma" and tma == "1")
    for dim, block, dtype in ((128, 128, torch.bfloat16), (64, 64, torch.float16), (256, 128, torch.float16),
                              (256, 64, torch.bfloat16)):
        generator = torch.Generator().manual_seed(dim + block)
        q, k, v = random_qkv(1, 1500, 4, 2, dim, dtype, generator)
        index = random_index(1, 4, 1500, block, 4, 120, generator)
        dout = torch.randn(1, 1500, 4, dim, generator=generator).to("cuda", dtype)
        doc_start = random_doc_start(1, 1500, generator) if documents else None
        reference = reference_with_grads(q, k, v, with_documents(dense_mask(index).cuda(), doc_start), dout, 0.1)
        assert_matches(kernel_with_grads(q, k, v, index, dout, 0.1, doc_start=doc_start), reference,
                       f"{paths} D{dim} bs{block}")


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_query_kernels_agree(documents, kernel_env):
    """The query-side kernels at block 128 (one warpgroup per CTA; warp-specialised, the default
    on Hopper) match the float64 reference, forward and gradients, and give bit for bit the
    same out, lse, dq, dk and dv: a partial last block, GQA 4:1, vertical candidates beyond one list
    window (several gathered tiles and refills), at both head dims."""
    for dim, dtype in ((128, torch.bfloat16), (64, torch.float16)):
        generator = torch.Generator().manual_seed(dim + 7)
        seq, heads = 2900, 8
        q, k, v = random_qkv(1, seq, heads, 2, dim, dtype, generator)
        index = random_index(1, heads, seq, 128, 5, 2500, generator)
        dout = torch.randn(1, seq, heads, dim, generator=generator).to("cuda", dtype)
        doc_start = random_doc_start(1, seq, generator) if documents else None
        reference = reference_with_grads(q, k, v, with_documents(dense_mask(index).cuda(), doc_start), dout, 0.1)
        results = {}
        for query in ("plain", "specialized"):
            kernel_env(QUERY=query)
            paths = ops.op_module("cuda").kernel_paths(torch.cuda.current_device())
            results[query] = kernel_with_grads(q, k, v, index, dout, 0.1, doc_start=doc_start)
            assert_matches(results[query], reference, f"{paths} D{dim}")
        for name, plain, other in zip(("out", "lse", "dq", "dk", "dv"), results["plain"], results["specialized"]):
            assert torch.equal(plain, other), f"specialized {name} differs from plain at D{dim}"


@pytest.mark.parametrize("running_dq", [False, True], ids=["dq", "running_dq"])
def test_concurrent_dq_gives_the_serial_gradients(running_dq, kernel_env):
    """The backward's dQ kernel on a second stream, beside the dK/dV kernels (the default), gives
    bit for bit the serial order's dq, dk and dv, read at once on the current stream (which must
    wait for it): at a size where dQ runs for milliseconds, from a zero or a running dq (the
    ring's), with document masking. Small sizes against float64 are in the tests above."""
    generator = torch.Generator().manual_seed(41)
    seq, heads = 32768, 8
    q, k, v = random_qkv(1, seq, heads, 2, 128, torch.bfloat16, generator)
    index = random_index(1, heads, seq, 128, 24, 400, generator)
    dout = torch.randn(1, seq, heads, 128, generator=generator).to("cuda", torch.bfloat16)
    doc_start = random_doc_start(1, seq, generator)
    out, lse = ops.attention_forward(q, k, v, index, 0.09, doc_start=doc_start)
    start = torch.randn(1, seq, heads, 128, generator=generator).cuda()
    results = {}
    for concurrent in ("0", "1"):
        kernel_env(CONCURRENT_DQ=concurrent)
        assert ops.op_module("cuda").kernel_paths(torch.cuda.current_device())["concurrent_dq"] == (concurrent == "1")
        poison_allocator()
        grads = ops.attention_backward(dout, q, k, v, out, lse, index, 0.09, doc_start=doc_start,
                                       dq=start.clone() if running_dq else None)
        results[concurrent] = [grad.clone() for grad in grads]  # read on the current stream at once
    for name, serial, concurrent in zip(("dq", "dk", "dv"), results["0"], results["1"]):
        assert torch.isfinite(serial).all(), name
        assert torch.equal(serial, concurrent), f"{name} differs with dQ on its own stream"


def merge(outs, lses):
    """Exact merge of partial results over key ranks (float64); rows no rank saw stay 0 / -inf."""
    lse = torch.logsumexp(torch.stack([part.double() for part in lses]), dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = sum(o.double() * torch.exp(l.double() - safe).transpose(1, 2)[..., None] for o, l in zip(outs, lses))
    return out, lse


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("block", [64, 128])
def test_striped_ring_calls_match_dense(world, documents, block, dim):
    """Every (q_rank, k_rank) call of a striped ring, merged, equals global dense attention (with
    document masking: documents crossing stripes and ranks, the global doc_start on every call);
    at block 128 on Hopper through the warp-specialised query kernels, at 64 through the others.
    The ring's way, each call merging into the running out/lse and adding into the running dq in
    its epilogue (own rank last, so rows without keys meet the merge on either side), from one
    delta computed up front, equals the float64 merge and sum of the separate calls (rel 1e-5)."""
    local_blocks, heads, kv_heads = 5, 4, 2
    seq = world * local_blocks * block
    generator = torch.Generator().manual_seed(world)
    q, k, v = random_qkv(1, seq, heads, kv_heads, dim, torch.bfloat16, generator)
    index = random_index(1, heads, seq, block, 5, 30, generator)
    dout = torch.randn(1, seq, heads, dim, generator=generator).to("cuda", torch.bfloat16)
    doc_start = random_doc_start(1, seq, generator) if documents else None
    scale = 1.0 / math.sqrt(dim)
    mask = with_documents(dense_mask(index).cuda(), doc_start)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, mask, dout, scale)

    local = seq // world
    positions = [StripedLayout(world, block).positions(seq, rank).cuda() for rank in range(world)]
    parts = {}
    for r in range(world):
        for s in range(world):
            stripe = Stripe(world, r, s)
            out, lse = ops.attention_forward(q[:, positions[r]], k[:, positions[s]], v[:, positions[s]],
                                             index, scale, stripe, doc_start=doc_start)
            empty = torch.isinf(lse)
            assert not torch.isnan(out).any() and not torch.isnan(lse).any()
            assert (out.transpose(1, 2)[empty] == 0).all(), "rows without keys must give out 0"
            parts[r, s] = (out, lse)
    dq = [torch.zeros(1, local, heads, dim, device="cuda", dtype=torch.float64) for _ in range(world)]
    dk = [torch.zeros(1, local, kv_heads, dim, device="cuda", dtype=torch.float64) for _ in range(world)]
    dv = [torch.zeros_like(t) for t in dk]
    for r in range(world):
        out, lse = merge([parts[r, s][0] for s in range(world)], [parts[r, s][1] for s in range(world)])
        assert relative_error(out, ref_out[:, positions[r]]) <= TOLERANCE
        assert float((lse - ref_lse[..., positions[r]]).abs().max()) < 5e-2
        for s in range(world):
            grads = ops.attention_backward(dout[:, positions[r]], q[:, positions[r]], k[:, positions[s]],
                                           v[:, positions[s]], out.float(), lse.float(), index, scale,
                                           Stripe(world, r, s), doc_start=doc_start)
            dq[r] += grads[0].double()
            dk[s] += grads[1].double()
            dv[s] += grads[2].double()
        order = [(r + 1 + i) % world for i in range(world)]
        running_out = running_lse = running_dq = None
        for s in order:
            running_out, running_lse = ops.attention_forward(
                q[:, positions[r]], k[:, positions[s]], v[:, positions[s]], index, scale, Stripe(world, r, s),
                doc_start=doc_start, out=running_out, lse=running_lse)
        assert relative_error(running_out, out) <= 1e-5 and relative_error(running_lse, lse) <= 1e-5
        delta = ops.attention_delta(dout[:, positions[r]], out.float())  # once, as the ring computes it
        assert relative_error(delta, (dout[:, positions[r]].double() * out).sum(-1).transpose(1, 2)) <= 1e-5
        for s in order:
            running_dq = ops.attention_backward(dout[:, positions[r]], q[:, positions[r]], k[:, positions[s]],
                                                v[:, positions[s]], out.float(), lse.float(), index, scale,
                                                Stripe(world, r, s), doc_start=doc_start, dq=running_dq,
                                                delta=delta)[0]
        assert relative_error(running_dq, dq[r]) <= 1e-5
    for rank in range(world):
        assert relative_error(dq[rank], ref_dq[:, positions[rank]]) <= TOLERANCE
        assert relative_error(dk[rank], ref_dk[:, positions[rank]]) <= TOLERANCE
        assert relative_error(dv[rank], ref_dv[:, positions[rank]]) <= TOLERANCE


def test_step_index_matches_the_contract():
    """The GPU per-call lists equal the contract's derivation, written out in Python."""
    block, world = 64, 4
    generator = torch.Generator().manual_seed(7)
    index = random_index(2, 3, world * 8 * block, block, 9, 50, generator)
    module = ops.op_module("cuda")
    for q_rank, k_rank in [(0, 0), (2, 1), (1, 3)]:
        offsets, num_offsets, keys, num_keys = module.step_index(
            ops.op_index(index, Stripe(world, q_rank, k_rank)), 8 * block)
        for b in range(2):
            for h in range(3):
                slash = [d for d in index.slash[b, h].tolist() if d != PAD]
                vertical = [c for c in index.vertical[b, h].tolist() if c != PAD]
                gap = q_rank - k_rank
                want_offsets = [(d - gap) // world for d in slash if d - gap >= 0 and (d - gap) % world == 0]
                want_keys = [(c // block) // world * block + c % block for c in vertical
                             if (c // block) % world == k_rank]
                assert offsets[b, h, :num_offsets[b, h]].tolist() == want_offsets
                assert keys[b, h, :num_keys[b, h]].tolist() == want_keys


def test_backward_is_deterministic():
    generator = torch.Generator().manual_seed(3)
    q, k, v = random_qkv(1, 1536, 8, 2, 128, torch.bfloat16, generator)
    index = random_index(1, 8, 1536, 128, 4, 200, generator)
    dout = torch.randn(1, 1536, 8, 128, generator=generator).to("cuda", torch.bfloat16)
    first = kernel_with_grads(q, k, v, index, dout, 0.1)
    second = kernel_with_grads(q, k, v, index, dout, 0.1)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two runs differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_input_dtype_outputs_are_the_float32_ones_rounded(dtype):
    """input_dtype=True: the kernels write out and dq in q's dtype, bit-equal to their float32
    results rounded by .to(); delta reads an out in q's dtype as it is, and the float32 out's
    rounding gives the same gradients within bf16/fp16 error. With a running out/lse (dq) the
    kernels merge (add) into it and write the result in q's dtype, bit-equal to the float32 merge
    (sum) rounded, leaving the running out (dq) as it was (a ring's last step)."""
    generator = torch.Generator().manual_seed(9)
    q, k, v = random_qkv(1, 1000, 8, 2, 128, dtype, generator)
    index = random_index(1, 8, 1000, 128, 3, 60, generator)
    dout = torch.randn(1, 1000, 8, 128, generator=generator).to("cuda", dtype)
    out32, lse32 = ops.attention_forward(q, k, v, index, 0.1)
    out, lse = ops.attention_forward(q, k, v, index, 0.1, input_dtype=True)
    assert out.dtype == dtype and torch.equal(out, out32.to(dtype)) and torch.equal(lse, lse32)
    dq32, dk32, dv32 = ops.attention_backward(dout, q, k, v, out, lse, index, 0.1)
    dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, index, 0.1, input_dtype=True)
    assert dq.dtype == dtype and torch.equal(dq, dq32.to(dtype))
    assert dk.dtype == dv.dtype == torch.float32 and torch.equal(dk, dk32) and torch.equal(dv, dv32)
    from_float32_out = ops.attention_backward(dout, q, k, v, out32, lse32, index, 0.1)
    for name, a, b in zip(("dq", "dk", "dv"), (dq32, dk32, dv32), from_float32_out):
        assert relative_error(a, b) < 1e-2, name
    running_out = torch.randn(out32.shape, generator=generator).cuda()
    running_lse = torch.randn(lse32.shape, generator=generator).cuda()
    merged_out, merged_lse = ops.attention_forward(q, k, v, index, 0.1, out=running_out.clone(),
                                                   lse=running_lse.clone())
    kept_out, lse_in_place = running_out.clone(), running_lse.clone()
    out, lse = ops.attention_forward(q, k, v, index, 0.1, out=kept_out, lse=lse_in_place, input_dtype=True)
    assert out.dtype == dtype and torch.equal(out, merged_out.to(dtype))
    assert lse is lse_in_place and torch.equal(lse, merged_lse) and torch.equal(kept_out, running_out)
    running_dq = torch.randn(dq32.shape, generator=generator).cuda()
    summed_dq = ops.attention_backward(dout, q, k, v, out, lse, index, 0.1, dq=running_dq.clone())[0]
    kept_dq = running_dq.clone()
    dq = ops.attention_backward(dout, q, k, v, out, lse, index, 0.1, dq=kept_dq, input_dtype=True)[0]
    assert dq.dtype == dtype and torch.equal(dq, summed_dq.to(dtype)) and torch.equal(kept_dq, running_dq)


def test_kernel_split_names_each_pass():
    """bench.kernel --kernel-split: the profiler's kernel names map to our four passes, each
    with time, and no kernel of ours is left under another label."""
    from ds_mtraining.bench import kernel_split_ms
    from ds_mtraining.bench.kernel import OUR_PASSES, kernel_label
    from ds_mtraining.attention import sparse_attention

    generator = torch.Generator().manual_seed(5)
    q, k, v = random_qkv(1, 2048, 8, 2, 128, torch.bfloat16, generator)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    index = random_index(1, 8, 2048, 128, 4, 100, generator)
    dout = torch.randn(1, 2048, 8, 128, generator=generator).to("cuda", torch.bfloat16)
    split = kernel_split_ms(lambda: torch.autograd.grad(sparse_attention(q, k, v, index, 0.1), (q, k, v), dout),
                            kernel_label)
    for name in OUR_PASSES.values():
        assert split.get(name, 0.0) > 0.0, f"no time under {name}: {split}"
    assert not [label for label in split if label in ("query_kernel", "specialized_query_kernel", "key_kernel")], split


def misaligned(t):
    """A contiguous copy of t that starts 2 bytes past a 16-byte boundary (a slice of a larger buffer)."""
    buffer = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


def test_misaligned_views_give_the_aligned_results():
    """Inputs that start off a 16-byte boundary (the kernels copy 16-byte chunks) give bit-identical
    outputs and gradients to aligned copies of the same values."""
    generator = torch.Generator().manual_seed(11)
    q, k, v = random_qkv(1, 700, 4, 2, 64, torch.bfloat16, generator)
    dout = torch.randn(1, 700, 4, 64, generator=generator).to("cuda", torch.bfloat16)
    index = random_index(1, 4, 700, 64, 3, 40, generator)
    out, lse = ops.attention_forward(q, k, v, index, 0.125)
    grads = ops.attention_backward(dout, q, k, v, out, lse, index, 0.125)
    views = [misaligned(t) for t in (q, k, v, dout)]
    out_view, lse_view = ops.attention_forward(*views[:3], index, 0.125)
    grads_view = ops.attention_backward(views[3], *views[:3], misaligned(out_view), lse_view, index, 0.125)
    for name, expected, actual in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                      (out_view, lse_view, *grads_view)):
        assert torch.equal(expected, actual), f"{name} differs for misaligned inputs"
    for out_dtype in (torch.float32, torch.bfloat16):  # delta on either kind of out
        final = out.to(out_dtype)
        assert torch.equal(ops.attention_delta(views[3], misaligned(final)), ops.attention_delta(dout, final))


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_delta_matches_float64_rowsums(dim):
    """attention_delta = rowsum(dout * out) against float64, for out in q's dtype or float32 (a
    ring's running out), over a row count that leaves the last block partly empty."""
    generator = torch.Generator().manual_seed(dim)
    dout = torch.randn(2, 37, 3, dim, generator=generator).to("cuda", torch.bfloat16)
    out = torch.randn(2, 37, 3, dim, generator=generator).cuda()
    for final in (out, out.to(torch.bfloat16)):
        expected = (dout.double() * final.double()).sum(-1).transpose(1, 2)
        delta = ops.attention_delta(dout, final)
        assert delta.shape == expected.shape and delta.dtype == torch.float32
        assert float((delta.double() - expected).abs().max()) <= 1e-4 * dim ** 0.5


def test_long_sequence_against_row_chunks():
    """32K tokens: the float64 reference runs over query chunks (mask_between rows), with autograd."""
    seq, heads, kv_heads, dim, block = 32768, 2, 1, 128, 128
    generator = torch.Generator().manual_seed(32)
    q, k, v = random_qkv(1, seq, heads, kv_heads, dim, torch.bfloat16, generator)
    index = random_index(1, heads, seq, block, 16, 256, generator)
    dout = torch.randn(1, seq, heads, dim, generator=generator).to("cuda", torch.bfloat16)
    scale = 1.0 / math.sqrt(dim)
    out, lse, dq, dk, dv = kernel_with_grads(q, k, v, index, dout, scale)

    k64, v64 = (t.detach().double().requires_grad_() for t in (k, v))
    keys = torch.arange(seq, device="cuda")
    errors = {"out": [0.0, 0.0], "dq": [0.0, 0.0]}
    max_lse_error = 0.0
    for start in range(0, seq, 1024):
        rows = torch.arange(start, min(start + 1024, seq), device="cuda")
        q64 = q[:, rows].double().requires_grad_()
        ref_out, ref_lse = dense_attention_with_lse(q64, k64, v64, mask_between(index, rows, keys), scale)
        ref_out.backward(dout[:, rows].double())
        for name, actual, expected in (("out", out[:, rows], ref_out.detach()), ("dq", dq[:, rows], q64.grad)):
            errors[name][0] += float((actual.double() - expected).pow(2).sum())
            errors[name][1] += float(expected.pow(2).sum())
        max_lse_error = max(max_lse_error, float((lse[..., rows].double() - ref_lse).abs().max()))
    for name, (diff, norm) in errors.items():
        assert math.sqrt(diff / norm) <= TOLERANCE, f"{name} relative error {math.sqrt(diff / norm):.3g}"
    assert max_lse_error < 5e-2
    assert relative_error(dk, k64.grad) <= TOLERANCE
    assert relative_error(dv, v64.grad) <= TOLERANCE


def test_rejects_float32_with_a_clear_error():
    q = torch.randn(1, 128, 2, 64, device="cuda")
    index = SparseIndex.from_blocks(torch.zeros(1, 2, 1, dtype=torch.long), torch.zeros(1, 2, 1, dtype=torch.long),
                                    128, 64).to("cuda")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        ops.attention_forward(q, q, q, index, 0.125)


@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_any_finite_scale(scale):
    """A negative or zero softmax scale gives the reference result too (forward and gradients)."""
    generator = torch.Generator().manual_seed(11)
    q, k, v = random_qkv(1, 640, 2, 1, 64, torch.bfloat16, generator)
    index = random_index(1, 2, 640, 64, 3, 20, generator)
    dout = torch.randn(1, 640, 2, 64, generator=generator).to("cuda", torch.bfloat16)
    reference = reference_with_grads(q, k, v, dense_mask(index).cuda(), dout, scale)
    assert_matches(kernel_with_grads(q, k, v, index, dout, scale), reference, f"scale={scale}")


def valid_call_arguments():
    """Keyword arguments of a valid forward call of the CUDA op: bf16, 4 query and 2 key/value heads,
    head_dim 64, block 64, 128 tokens."""
    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    index = SparseIndex.from_blocks(torch.zeros(1, 4, 1, dtype=torch.long), torch.zeros(1, 4, 1, dtype=torch.long),
                                    128, 64).to("cuda")
    return dict(q=q, k=kv, v=kv, index=ops.op_index(index), scale=0.125)


def with_index_entries(call, **entries):
    return {**call, "index": {**call["index"], **entries}}


def with_kv_heads(call, kv_heads):
    kv = torch.randn(1, 128, kv_heads, 64, device="cuda", dtype=torch.bfloat16)
    return {**call, "k": kv, "v": kv}


# Messages that format each kind of value: these segfaulted in the module on the H200 when numbers
# went through the message stream (docs/CUDA_NOTES.md), so each kind is checked to arrive as text.
BAD_CALLS = {
    "integers": (lambda call: with_kv_heads(call, 3),
                 r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    "double": (lambda call: {**call, "scale": float("nan")}, r"scale must be finite, got nan"),
    "shapes": (lambda call: {**call, "v": call["v"][:, :, :1]},
               r"k \[1, 128, 2, 64\] and v \[1, 128, 1, 64\] must have the same shape"),
    "devices": (lambda call: with_index_entries(call, slash=call["index"]["slash"].cpu(),
                                                slash_count=call["index"]["slash_count"].cpu()),
                r"slash is on cpu but q is on cuda:0"),
    "cuda_limit": (lambda call: with_index_entries(call, block_size=32), r"block_size must be 64 or 128, got 32"),
    "unknown_entry": (lambda call: with_index_entries(call, cu_seqlens=None), r"unknown index entry 'cu_seqlens'"),
    "doc_start_shape": (lambda call: with_index_entries(call, doc_start=torch.zeros(1, 64, dtype=torch.int32,
                                                                                    device="cuda")),
                        r"doc_start must be \[batch, global seq\] = \[1, 128\] .* got \[1, 64\]"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_rejects_bad_calls_with_a_value_error_naming_the_values(case):
    corrupt, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=message):
        ops.op_module("cuda").forward(**corrupt(valid_call_arguments()))


def test_backward_rejects_a_wrong_dout_shape_naming_both_shapes():
    call = valid_call_arguments()
    op = ops.op_module("cuda")
    out, lse = op.forward(**call)
    with pytest.raises(ValueError, match=r"dout must have q's shape \[1, 128, 4, 64\], got \[1, 64, 4, 64\]"):
        op.backward(dout=out[:, :64], out=out, lse=lse, **call)
