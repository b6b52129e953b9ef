"""The CPU sparse attention kernels against float64 dense masked attention.

Forward output, log-sum-exp and all three gradients are compared with
``ds_mtraining.reference.dense_attention_with_lse`` on ``reference.dense_mask(index)``: single device
(full and partial last block, GQA, both block sizes, fp32/bf16/fp16, indices from explicit lists
and from the estimator) and every (query rank, key rank) pair of a striped ring step.
"""
import math

import pytest
import torch

from ds_mtraining import SparseConfig, Stripe, estimate_vertical_slash, ops, sparse_attention_with_lse
from ds_mtraining.reference import dense_attention_with_lse, dense_mask, vertical_lists

# relative tolerance (of the largest reference magnitude) per input dtype: fp32 math throughout;
# bf16/fp16 results are rounded to the input dtype
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}

# batch, q heads, kv heads, head_dim, block, seq_len, index source, dtype
CASES = [
    (1, 4, 4, 64, 64, 256, "lists", torch.float32),
    (2, 8, 2, 128, 128, 300, "lists", torch.float32),
    (2, 4, 4, 128, 64, 300, "estimate", torch.float32),
    (1, 8, 2, 64, 128, 384, "estimate", torch.float32),
    (2, 8, 2, 64, 64, 300, "lists", torch.bfloat16),
    (1, 4, 4, 128, 128, 428, "estimate", torch.float16),
    (1, 8, 2, 128, 64, 256, "estimate", torch.bfloat16),
    (1, 4, 2, 40, 64, 300, "lists", torch.float32),  # head_dim not a multiple of the CPU vector width
]


def assert_matches(actual, expected, rel, what):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=rel, atol=rel * scale,
                               msg=lambda m: f"{what}: {m}")


def random_qkv(batch, seq, heads, kv_heads, dim, dtype, generator, q_gain=1.0):
    q = torch.randn(batch, seq, heads, dim, generator=generator) * q_gain
    k = torch.randn(batch, seq, kv_heads, dim, generator=generator)
    v = torch.randn(batch, seq, kv_heads, dim, generator=generator)
    return tuple(t.to(dtype).requires_grad_() for t in (q, k, v))


def dense_reference(q, k, v, mask, dout, scale=None, softcap=None):
    """Float64 out, lse and gradients of dense attention restricted to ``mask``."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = dense_attention_with_lse(*leaves, mask, scale, softcap)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return out.detach(), lse, grads


@pytest.mark.parametrize("batch,heads,kv_heads,dim,block,seq,source,dtype", CASES)
def test_single_device_matches_dense(cpu_op, random_index, batch, heads, kv_heads, dim, block,
                                     seq, source, dtype):
    generator = torch.Generator().manual_seed(seq * dim + block + heads)
    # a larger query gain sharpens the attention so the estimator picks a real pattern
    q, k, v = random_qkv(batch, seq, heads, kv_heads, dim, dtype, generator, q_gain=3.0)
    if source == "lists":
        index = random_index(batch, heads, seq, block, n_slash=2, seed=seq + dim)
    else:
        config = SparseConfig(block_size=block, last_q=64, p_vertical=0.5, p_slash=0.5,
                              max_vertical=24, max_slash_diagonals=1, sink_tokens=2)
        index = estimate_vertical_slash(q.detach(), k.detach(), config)
    # the case must skip some entries and read some vertical columns outside its slash blocks
    assert index.density() < 1.0 and vertical_lists(index).indices.numel() > 0
    out, lse = sparse_attention_with_lse(q, k, v, index)
    assert out.dtype == dtype and lse.dtype == torch.float32
    dout = torch.randn(out.shape, generator=generator).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    ref_out, ref_lse, ref_grads = dense_reference(q, k, v, dense_mask(index), dout)
    rel = TOLERANCE[dtype]
    assert torch.isfinite(lse).all(), "every row sees its diagonal block"
    assert_matches(lse, ref_lse, 1e-5, "lse")  # fp32 from exactly upcast inputs
    assert_matches(out, ref_out, rel, "out")
    for name, grad, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert grad.dtype == dtype
        assert_matches(grad, ref, rel, name)


@pytest.mark.parametrize("world", [2, 3])
def test_striped_pairs_match_dense(cpu_op, random_index, world):
    """Each ring step (q_rank, k_rank) computes exactly dense_mask(index, stripe), with global
    positions; rows that see no key give out 0 and lse -inf, and no NaN anywhere."""
    block, local_blocks, heads, kv_heads, dim = 64, 3, 4, 2, 64
    local = local_blocks * block
    index = random_index(2, heads, local * world, block, n_vertical=12, n_slash=4, seed=world)
    scale = 1.0 / math.sqrt(dim)
    generator = torch.Generator().manual_seed(world)
    empty_rows = visible_rows = 0
    for q_rank in range(world):
        for k_rank in range(world):
            stripe = Stripe(world, q_rank, k_rank)
            q, k, v = (t.detach() for t in random_qkv(2, local, heads, kv_heads, dim,
                                                      torch.float32, generator))
            out, lse = ops.attention_forward(q, k, v, index, scale, stripe)
            dout = torch.randn(out.shape, generator=generator)
            dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, index, scale, stripe)
            mask = dense_mask(index, stripe)
            ref_out, ref_lse, ref_grads = dense_reference(q, k, v, mask, dout, scale)
            where = f"stripe {stripe}"
            empty = ~mask.any(-1)  # [B, H, Sq]
            empty_rows += int(empty.sum())
            visible_rows += int((~empty).sum())
            for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
                assert not torch.isnan(t).any(), f"{where}: NaN in {name}"
            assert (lse[empty] == float("-inf")).all(), f"{where}: empty rows need lse -inf"
            assert (out.transpose(1, 2)[empty] == 0).all(), f"{where}: empty rows need out 0"
            assert_matches(lse[~empty], ref_lse[~empty], 1e-5, f"{where} lse")
            assert_matches(out, ref_out, 1e-5, f"{where} out")
            for name, grad, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
                assert_matches(grad, ref, 1e-5, f"{where} {name}")
    assert empty_rows > 0 and visible_rows > 0, "the pairs must include rows with and without keys"


@pytest.mark.parametrize("world,softcap", [(2, None), (3, None), (2, 1.5)])
def test_running_out_lse_and_dq_accumulate_over_key_ranks(cpu_op, random_index, world, softcap):
    """One rank's queries over every key rank, as the ring calls them: the first call's (out,
    lse) passed to the next calls as the running ones, merged in place, equal float64 dense
    attention over the union of the calls' masks; each call's dq, from the delta computed once,
    added into the running dq equals the dense dq (fp32: rel 1e-5). With logit soft-capping
    each call's lse is over the capped logits: the merge is the same."""
    block, local_blocks, heads, kv_heads, dim = 64, 3, 4, 2, 64
    local = local_blocks * block
    index = random_index(2, heads, local * world, block, n_vertical=12, n_slash=4, seed=10 + world)
    scale = 1.0 / math.sqrt(dim)
    generator = torch.Generator().manual_seed(world)
    q_rank, order = 0, [*range(1, world), 0]  # block 0 sees no key of ranks 1.. : -inf in the running lse
    q = torch.randn(2, local, heads, dim, generator=generator)
    keys = [(torch.randn(2, local, kv_heads, dim, generator=generator),
             torch.randn(2, local, kv_heads, dim, generator=generator)) for _ in range(world)]
    dout = torch.randn(2, local, heads, dim, generator=generator)
    out = lse = None
    for k_rank in order:
        k, v = keys[k_rank]
        running = out
        out, lse = ops.attention_forward(q, k, v, index, scale, Stripe(world, q_rank, k_rank), out=out, lse=lse,
                                         softcap=softcap or 0.0)
        assert running is None or out is running, "the running out is merged in place"
    delta = ops.attention_delta(dout, out)  # once for every call, as the ring does
    assert_matches(delta, (dout.double() * out.double()).sum(-1).transpose(1, 2), 1e-6, "delta")
    dq = None
    for k_rank in order:
        k, v = keys[k_rank]
        running = dq
        dq, _, _ = ops.attention_backward(dout, q, k, v, out, lse, index, scale, Stripe(world, q_rank, k_rank),
                                          dq=dq, delta=delta, softcap=softcap or 0.0)
        assert running is None or dq is running, "the running dq is added into in place"

    k_all, v_all = (torch.cat([pair[i] for pair in keys], dim=1) for i in (0, 1))
    mask = torch.cat([dense_mask(index, Stripe(world, q_rank, k_rank)) for k_rank in range(world)], dim=-1)
    ref_out, ref_lse, (ref_dq, _, _) = dense_reference(q, k_all, v_all, mask, dout, scale, softcap)
    assert (~dense_mask(index, Stripe(world, q_rank, order[0])).any(-1)).any()
    assert_matches(lse, ref_lse, 1e-5, "merged lse")
    assert_matches(out, ref_out, 1e-5, "merged out")
    assert_matches(dq, ref_dq, 1e-5, "summed dq")


def test_running_accumulators_are_checked(cpu_op, small_problem):
    q, k, v, index = small_problem
    out, lse = cpu_op.forward(*_call_args(q, k, v, index))
    call = _call_args(q, k, v, index)
    for kwargs, error, message in (
            (dict(out=out), ValueError, "pass both the running out and lse"),
            (dict(out=out.double(), lse=lse), TypeError, "the running out must be float32"),
            (dict(out=out, lse=lse[:, :, :64]), ValueError, r"the running lse must be \[1, 4, 128\]"),
            (dict(out=out.transpose(1, 2).contiguous().transpose(1, 2), lse=lse), ValueError,
             "the running out must be contiguous")):
        with pytest.raises(error, match=message):
            cpu_op.forward(*call, **kwargs)
    with pytest.raises(ValueError, match=r"the running dq must be \[1, 128, 4, 32\]"):
        cpu_op.backward(out, q, k, v, out, lse, *call[3:], dq=out[:, :64].contiguous())
    with pytest.raises(ValueError, match=r"delta must be \[1, 4, 128\]"):
        cpu_op.backward(out, q, k, v, out, lse, *call[3:], delta=lse[:, :, :64].contiguous())
    with pytest.raises(ValueError, match=r"out \[1, 64, 4, 32\] must have dout's shape \[1, 128, 4, 32\]"):
        cpu_op.delta(out, out[:, :64])


def test_input_dtype_outputs_are_the_float32_ones_rounded(cpu_op, small_problem):
    """input_dtype=True: out (forward) and dq (backward) in q's dtype, equal to the float32 results
    rounded as .to() rounds; dk/dv stay float32. With a running out/lse (dq), the merged out (the
    sum) in q's dtype, equal to the float32 merge (sum) rounded, in a new tensor: the running out
    (dq) is left as it was, the running lse is merged in place (a ring's last step)."""
    q, k, v, index = (t.to(torch.bfloat16) if isinstance(t, torch.Tensor) else t for t in small_problem)
    call = _call_args(q, k, v, index)
    out32, lse32 = cpu_op.forward(*call)
    out, lse = cpu_op.forward(*call, input_dtype=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out32.to(torch.bfloat16)) and torch.equal(lse, lse32)
    dout = torch.randn(out.shape).to(torch.bfloat16)
    dq32, dk32, dv32 = cpu_op.backward(dout, q, k, v, out, lse, *call[3:])
    dq, dk, dv = cpu_op.backward(dout, q, k, v, out, lse, *call[3:], input_dtype=True)
    assert dq.dtype == torch.bfloat16 and torch.equal(dq, dq32.to(torch.bfloat16))
    assert dk.dtype == dv.dtype == torch.float32 and torch.equal(dk, dk32) and torch.equal(dv, dv32)
    running_out, running_lse = torch.randn(out32.shape), torch.randn(lse32.shape)
    merged_out, merged_lse = cpu_op.forward(*call, out=running_out.clone(), lse=running_lse.clone())
    kept_out, lse_in_place = running_out.clone(), running_lse.clone()
    out, lse = cpu_op.forward(*call, out=kept_out, lse=lse_in_place, input_dtype=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, merged_out.to(torch.bfloat16))
    assert lse is lse_in_place and torch.equal(lse, merged_lse) and torch.equal(kept_out, running_out)
    running_dq = torch.randn(dq32.shape)
    summed_dq = cpu_op.backward(dout, q, k, v, out, lse, *call[3:], dq=running_dq.clone())[0]
    kept_dq = running_dq.clone()
    dq = cpu_op.backward(dout, q, k, v, out, lse, *call[3:], dq=kept_dq, input_dtype=True)[0]
    assert dq.dtype == torch.bfloat16 and torch.equal(dq, summed_dq.to(torch.bfloat16))
    assert torch.equal(kept_dq, running_dq)


def test_deterministic_across_runs_and_thread_counts(cpu_op, random_index):
    """Bit-identical results run to run and for 1 or 2 threads: each output element has one
    owner that sums in a fixed order (no atomics)."""
    generator = torch.Generator().manual_seed(7)
    q, k, v = (t.detach() for t in random_qkv(1, 512, 8, 2, 64, torch.float32, generator))
    index = random_index(1, 8, 512, 64, n_vertical=40, n_slash=6, seed=7)
    dout = torch.randn(q.shape, generator=generator)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (2, 2, 1):
            torch.set_num_threads(count)
            out, lse = ops.attention_forward(q, k, v, index, 0.125, Stripe())
            results.append((out, lse) + ops.attention_backward(dout, q, k, v, out, lse, index,
                                                               0.125, Stripe()))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other):
            assert torch.equal(a, b), f"{name} differs between runs"


# ---------------------------------------------------------------------------- bad inputs
def _call_args(q, k, v, index, world=1, q_rank=0, k_rank=0, block=None):
    op_index = ops.op_index(index, Stripe(world, q_rank, k_rank))
    return (q, k, v, {**op_index, "block_size": block or index.block_size}, 0.125)


def raw_lists(slash, vertical, heads, device="cpu"):
    """The op's index argument (block 64, one device) with the same slash and vertical list for
    every head."""
    slash = torch.tensor(slash, dtype=torch.int32).expand(1, heads, -1).contiguous()
    vertical = torch.tensor(vertical, dtype=torch.int32).expand(1, heads, -1).contiguous()
    counts = [torch.full((1, heads), t.shape[-1], dtype=torch.int32) for t in (slash, vertical)]
    return dict(slash=slash.to(device), slash_count=counts[0].to(device), vertical=vertical.to(device),
                vertical_count=counts[1].to(device), block_size=64, world=1, q_rank=0, k_rank=0,
                doc_start=torch.empty(0, dtype=torch.int32, device=device))


@pytest.fixture
def small_problem(random_index):
    q = torch.randn(1, 128, 4, 32)
    k = torch.randn(1, 128, 2, 32)
    v = torch.randn(1, 128, 2, 32)
    return q, k, v, random_index(1, 4, 128, 64)


def test_public_api_rejects_bad_inputs(small_problem, random_index):
    q, k, v, index = small_problem
    with pytest.raises(ValueError, match="must share batch, seq and head_dim"):
        sparse_attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), index)
    with pytest.raises(TypeError, match="has dtype torch.int64"):
        sparse_attention_with_lse(q.long(), k.long(), v.long(), index)
    with pytest.raises(TypeError, match="must share a dtype"):
        sparse_attention_with_lse(q, k.half(), v, index)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sparse_attention_with_lse(q[:, :, :3], k, v, random_index(1, 3, 128, 64))
    with pytest.raises(ValueError, match="index was built for batch=1, seq_len=256"):
        sparse_attention_with_lse(q, k, v, random_index(1, 4, 256, 64))
    with pytest.raises(ValueError, match="no sparse attention op for device type 'meta'"):
        ops.attention_forward(q.to("meta"), k.to("meta"), v.to("meta"), index, 0.125)


def test_op_rejects_bad_inputs(cpu_op, small_problem, random_index):
    """The compiled op validates on its own (ring code calls it directly): one clear error each."""
    q, k, v, index = small_problem
    bad = [
        (ValueError, "q must be a 4-d tensor", _call_args(q[0], k, v, index)),
        (TypeError, "q has dtype Long", _call_args(q.long(), k, v, index)),
        (TypeError, "q, k, v must share a dtype", _call_args(q, k.half(), v, index)),
        (ValueError, "q is on meta but this op runs on CPU tensors",
         _call_args(q.to("meta"), k, v, index)),
        (ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)",
         _call_args(q, torch.randn(1, 128, 3, 32), torch.randn(1, 128, 3, 32), index)),
        (ValueError, "the index was built for another shape",
         _call_args(q, k, v, random_index(1, 2, 128, 64))),
        (ValueError, "the index was built for another length",
         _call_args(q, k, v, random_index(1, 4, 1024, 64, n_vertical=4, n_slash=8, seed=3))),
        (ValueError, "must be a multiple of block_size=64",
         _call_args(q[:, :100], k[:, :100], v[:, :100], index, world=2)),
        (ValueError, "0 <= q_rank, k_rank < world", _call_args(q, k, v, index, world=2, q_rank=2)),
        (ValueError, "queries and keys must be the same length",
         _call_args(q, k[:, :64], v[:, :64], index)),
    ]
    for error, message, args in bad:
        with pytest.raises(error, match=message):
            cpu_op.forward(*args)

    for slash, vertical, message in (([1, 0], [5], "must start with diagonal 0"),
                                     ([0, 1, 1], [5], "is not strictly ascending"),
                                     ([0], [9, 5], "must be strictly ascending key positions")):
        with pytest.raises(ValueError, match=message):
            cpu_op.forward(q, k, v, raw_lists(slash, vertical, heads=4), 0.125)
    with pytest.raises(ValueError, match="slash is on meta but q is on cpu"):
        cpu_op.forward(q, k, v, raw_lists([0], [5], heads=4, device="meta"), 0.125)

    out, lse = cpu_op.forward(*_call_args(q, k, v, index))
    call = _call_args(q, k, v, index)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        cpu_op.backward(out[:, :64], q, k, v, out, lse, *call[3:])
    with pytest.raises(TypeError, match="lse must be float32"):
        cpu_op.backward(out, q, k, v, out, lse.double(), *call[3:])
    with pytest.raises(ValueError, match=r"lse must be \[batch, heads, seq\]"):
        cpu_op.backward(out, q, k, v, out, lse.transpose(1, 2), *call[3:])
