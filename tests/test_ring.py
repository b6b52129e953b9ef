"""Striped sparse ring attention on CPU with gloo: spawned ranks against single-process references.

Every rank builds the same global q/k/v (same seed), runs the ring on its striped shard and
compares its shard of the output and of dq/dk/dv with (a) the single-process ``sparse_attention``
on the unstriped sequence with the same index and (b) float64 dense causal attention when the
index selects everything. One spawned group per world size serves several checks.
"""

import pytest
import torch
import torch.distributed as dist
from helpers import TorchPasses

from ds_mtraining import SparseConfig, SparseIndex, estimate_vertical_slash, sparse_attention, synthetic
from ds_mtraining.distributed.spawn import run_on_ranks
from ds_mtraining.reference import dense_attention, outputs_and_grads
from ds_mtraining.distributed.comm import RingComm
from ds_mtraining.layout import StripedLayout
from ds_mtraining.ring import merge_lse, merge_partial, ring_sparse_attention
from ds_mtraining.step import new_step
from ds_mtraining.estimator.distributed import estimate_vertical_slash_distributed, select_top_p_across_ranks
from ds_mtraining.estimator.rule import select_top_p

BLOCK = 64
HANG_TIMEOUT_S = 150
OUT_TOL = dict(atol=2e-5, rtol=1e-4)    # fp32 kernel vs fp32 kernel, different merge order
GRAD_TOL = dict(atol=1e-4, rtol=1e-3)
DENSE_TOL = dict(atol=1e-4, rtol=1e-3)  # fp32 ring vs float64 dense


# ---------------------------------------------------------------------------- shared inputs
def global_qkv(seq_len, heads=4, kv_heads=2, dim=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq_len, heads, dim, generator=g)
    k = torch.randn(1, seq_len, kv_heads, dim, generator=g)
    v = torch.randn(1, seq_len, kv_heads, dim, generator=g)
    dout = torch.randn(1, seq_len, heads, dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def random_index(seq_len, heads=4, seed=0):
    """Slash diagonals at every residue mod the world (so every ring step has work), columns
    anywhere (some inside selected diagonals, which the kernel must skip)."""
    g = torch.Generator().manual_seed(seed)
    nb = seq_len // BLOCK
    slash = torch.randint(-1, nb, (1, heads, 4), generator=g)
    vertical = torch.randint(-1, seq_len, (1, heads, 6), generator=g)
    return SparseIndex.from_blocks(slash, vertical, seq_len, BLOCK)


def full_index(seq_len, heads=4):
    nb = seq_len // BLOCK
    slash = torch.arange(nb).expand(1, heads, nb)
    return SparseIndex.from_blocks(slash, torch.full((1, heads, 1), -1), seq_len, BLOCK)


def diagonal_only_index(seq_len, heads=4):
    """Only the token-causal diagonal blocks: every ring step but the first sees no key at all."""
    return SparseIndex.from_blocks(torch.zeros(1, heads, 1, dtype=torch.long),
                                   torch.full((1, heads, 1), -1), seq_len, BLOCK)


def ring_on_shards(rank_in_group, world, group, config, q, k, v, dout, index=None):
    """The ring's results on this rank's shards, next to the same shards of the global tensors."""
    layout = StripedLayout(world, config.block_size)
    shard = lambda t: layout.shard(t, rank_in_group)  # noqa: E731
    return outputs_and_grads(lambda a, b, c: ring_sparse_attention(a, b, c, config, group, index=index),
                      shard(q), shard(k), shard(v), shard(dout)), shard


def assert_matches(got, expected, shard, what, tols=(OUT_TOL, GRAD_TOL, GRAD_TOL, GRAD_TOL)):
    """got: this rank's (out, dq, dk, dv); expected: the global ones (sharded here)."""
    for name, g, e, tol in zip(("out", "dq", "dk", "dv"), got, expected, tols):
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN/inf"
        torch.testing.assert_close(g.double(), shard(e).double(), **tol,
                                   msg=lambda m: f"{what}: {name} differs: {m}")


def check_ring_equals_references(rank_in_group, world, group, seed):
    """Ring == single-process sparse_attention (random and diagonal-only indices) and == float64
    dense causal attention when the index selects everything."""
    config = SparseConfig(block_size=BLOCK)
    seq_len = world * BLOCK * 3
    q, k, v, dout = global_qkv(seq_len, seed=seed)
    for what, index in (("random index", random_index(seq_len, seed=seed)),
                        ("diagonal-only index (rows without keys in most steps)",
                         diagonal_only_index(seq_len))):
        expected = outputs_and_grads(lambda a, b, c: sparse_attention(a, b, c, index), q, k, v, dout)
        got, shard = ring_on_shards(rank_in_group, world, group, config, q, k, v, dout, index)
        assert_matches(got, expected, shard, f"{what} vs single-process sparse_attention")

    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril().expand(1, 4, -1, -1)
    expected = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, causal), q.double(), k.double(),
                          v.double(), dout.double())
    got, shard = ring_on_shards(rank_in_group, world, group, config, q, k, v, dout,
                                full_index(seq_len))
    assert_matches(got, expected, shard, "full index vs float64 dense causal attention",
                   tols=(DENSE_TOL,) * 4)


def check_ring_in_bf16(rank_in_group, world, group):
    """bf16 shards (the ring merges in fp32, then saves its bf16 out for the backward's delta):
    outputs and gradients within 2% (relative Frobenius error) of float64 dense causal attention
    on the same bf16 values, with the full index."""
    config = SparseConfig(block_size=BLOCK)
    seq_len = world * BLOCK * 3
    q, k, v, dout = global_qkv(seq_len, seed=4, dtype=torch.bfloat16)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril().expand(1, 4, -1, -1)
    expected = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, causal), q.double(), k.double(),
                                 v.double(), dout.double())
    got, shard = ring_on_shards(rank_in_group, world, group, config, q, k, v, dout, full_index(seq_len))
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), f"bf16 ring: {name}"
        error = float((g.double() - shard(e)).norm() / shard(e).norm())
        assert error < 2e-2, f"bf16 ring vs float64 dense: {name} relative error {error:.2e}"


def check_estimation_equals_single_device(rank_in_group, world, group):
    """The distributed estimator returns the single-device index of the unstriped sequence, on
    a planted RoPE pattern and on noise whose vertical top-p needs the second candidate round."""
    check_distributed_estimator(rank_in_group, world, group, estimate_vertical_slash_distributed,
                                "noise, wide vertical top-p", dict(last_q=80))


def check_distributed_estimator(rank_in_group, world, group, estimator, noise_case, noise_config):
    """``estimator`` on this rank's shards returns the single-device torch rule's index of the
    unstriped sequence: a planted RoPE pattern, and noise with a wide vertical top-p under
    ``noise_config``."""
    comm = RingComm(group)
    seq_len = world * BLOCK * -(-1024 // (world * BLOCK))
    layout = StripedLayout(world, BLOCK)
    planted = synthetic.planted_qk(seq_len, 4, 2, 64, offsets=(320, 512), columns=((7, 40), (333,)))
    noise = global_qkv(seq_len, dim=64, seed=3)[:2]
    cases = (("planted", planted, SparseConfig(block_size=BLOCK)),
             (noise_case, noise,
              SparseConfig(block_size=BLOCK, p_vertical=0.99, p_slash=0.5, **noise_config)))
    for what, (q, k), config in cases:
        expected = estimate_vertical_slash(q, k, config)
        got = estimator(layout.shard(q, rank_in_group), layout.shard(k, rank_in_group), config, comm)
        assert torch.equal(got.slash, expected.slash), f"{what}: slash differs"
        assert torch.equal(got.vertical, expected.vertical), f"{what}: vertical differs"


def check_top_p_across_ranks(rank_in_group, world, group):
    """The merged per-rank candidates pick exactly select_top_p's set: integer masses with many
    ties, and masses piled on rank 0 so that its first candidate list runs out (second round)."""
    comm = RingComm(group)
    local, layout = 2 * BLOCK, StripedLayout(world, BLOCK)
    g = torch.Generator().manual_seed(11)
    ties = torch.randint(0, 4, (2, 3, local * world), generator=g).float()
    piled = torch.rand(2, 3, local * world, generator=g)
    piled[..., layout.positions(local * world, 0)] += 10
    positions = layout.positions(local * world, rank_in_group)
    for what, mass, p, cap in (("ties", ties, 0.5, 1000), ("ties", ties, 0.9, 40),
                               ("ties", ties, 1.0, local * world), ("piled on rank 0", piled, 0.9, 100)):
        got = select_top_p_across_ranks(layout.shard(mass, rank_in_group, dim=-1), positions, p, cap, comm)
        expected = select_top_p(mass, p, cap)
        assert torch.equal(got, expected), f"{what}, p={p} cap={cap}: selection differs"


def check_bad_inputs_fail_everywhere(rank, world):
    """Each mistake raises the same clear error on every rank (a hang would time out), at the
    first call of a step (a call that raised leaves the next one checked)."""
    new_step()
    config = SparseConfig(block_size=BLOCK)
    q, k, v, _ = global_qkv(BLOCK * 2)
    odd = slice(0, BLOCK + 32)
    with pytest.raises(ValueError, match="divisible by world x block_size"):
        ring_sparse_attention(q[:, odd], k[:, odd], v[:, odd], config)
    mine = slice(0, BLOCK * (1 + rank))  # rank 0 passes 64 tokens, rank 1 passes 128
    with pytest.raises(ValueError, match="different inputs"):
        ring_sparse_attention(q[:, mine], k[:, mine], v[:, mine], config)
    with pytest.raises(ValueError, match="index was built for"):
        ring_sparse_attention(q, k, v, config, index=random_index(BLOCK * 2))
    with pytest.raises(ValueError, match="block_size"):
        ring_sparse_attention(q, k, v, SparseConfig(block_size=128), index=random_index(BLOCK * 2 * world))


def check_agreement_once_per_step(rank, world):
    """The agreement check runs at a step's first call only (counted), at every call with
    DS_MTRAINING_CHECK_RANKS=every_call, and then catches a mismatch in a step's later call."""
    import os
    from unittest import mock

    from ds_mtraining.ring import ring_attention

    config = SparseConfig(block_size=BLOCK)
    q, k, v, _ = global_qkv(BLOCK * 2 * world)
    shard = lambda t: StripedLayout(world, BLOCK).shard(t, rank)  # noqa: E731
    calls = []
    real = ring_attention.check_ranks_agree
    with mock.patch.object(ring_attention, "check_ranks_agree",
                           lambda *a: calls.append(1) or real(*a)):
        new_step()
        for _ in range(3):
            ring_sparse_attention(shard(q), shard(k), shard(v), config)
        assert len(calls) == 1, f"{len(calls)} agreement checks in one step"
        new_step()
        ring_sparse_attention(shard(q), shard(k), shard(v), config)
        assert len(calls) == 2, "new_step() did not re-arm the check"
        os.environ["DS_MTRAINING_CHECK_RANKS"] = "every_call"
        try:
            ring_sparse_attention(shard(q), shard(k), shard(v), config)
            assert len(calls) == 3
            mine = slice(0, BLOCK * (1 + rank))
            with pytest.raises(ValueError, match="different inputs"):
                ring_sparse_attention(q[:, mine], k[:, mine], v[:, mine], config)
        finally:
            del os.environ["DS_MTRAINING_CHECK_RANKS"]


def check_fused_estimator_scheme_on_cpu(rank_in_group, world, group):
    """The distributed scheme of the fused CUDA estimator (diagonal shares spilled to the next
    ranks, fixed-width candidate selection), run with torch versions of the CUDA passes: the
    single-device index, on planted patterns and on noise (last_q > block: several hops)."""
    from ds_mtraining.estimator.distributed import estimate_vertical_slash_cuda_distributed

    def estimator(q, k, config, comm):
        return estimate_vertical_slash_cuda_distributed(q, k, config, comm, passes=TorchPasses)
    check_distributed_estimator(rank_in_group, world, group, estimator, "noise, last_q 150",
                                dict(last_q=150, max_vertical=300))


def check_group_of_one_is_single_device(rank, world):
    """A one-rank group runs (and estimates) exactly like the single-device path."""
    singles = [dist.new_group([r]) for r in range(world)]
    config = SparseConfig(block_size=BLOCK)
    q, k, v, dout = global_qkv(BLOCK * 3, seed=rank)
    index = estimate_vertical_slash(q, k, config)
    expected = outputs_and_grads(lambda a, b, c: sparse_attention(a, b, c, index), q, k, v, dout)
    got = outputs_and_grads(lambda a, b, c: ring_sparse_attention(a, b, c, config, singles[rank]), q, k, v, dout)
    assert_matches(got, expected, lambda t: t, "group of one vs sparse_attention")


def check_one_comm_one_scale_one_check_per_call(rank, world):
    """A layer call (striped_sparse_attention: estimate and ring) and a direct ring call each make
    one RingComm, resolve the default scale once and run the agreement check once (at a step's
    first call; the layer's estimate runs on the call's ring, after the check)."""
    from unittest import mock

    from ds_mtraining import attention
    from ds_mtraining.distributed import comm as comm_module
    from ds_mtraining.layer import MTrainingAttentionSettings, striped_sparse_attention
    from ds_mtraining.layer import attention as layer
    from ds_mtraining.ring import ring_attention

    config = SparseConfig(block_size=BLOCK)
    q, k, v, _ = global_qkv(BLOCK * 2 * world)
    q, k, v = (StripedLayout(world, BLOCK).shard(t, rank) for t in (q, k, v))
    made, defaults, checks, estimates = [], [], [], []
    real_init, real_resolve = comm_module.RingComm.__init__, attention.resolve_softmax_scale
    real_check, real_estimate = ring_attention.check_ranks_agree, layer.estimate_index

    def resolve(head_dim, softmax_scale=None):
        defaults.extend([head_dim] if softmax_scale is None else [])
        return real_resolve(head_dim, softmax_scale)

    def estimate(q_, k_, config_, comm, *args):
        estimates.append(comm)
        return real_estimate(q_, k_, config_, comm, *args)

    with mock.patch.object(comm_module.RingComm, "__init__", lambda self, *a: made.append(1) or real_init(self, *a)), \
            mock.patch.object(layer, "resolve_softmax_scale", resolve), \
            mock.patch.object(ring_attention, "resolve_softmax_scale", resolve), \
            mock.patch.object(ring_attention, "check_ranks_agree", lambda *a: checks.append(1) or real_check(*a)), \
            mock.patch.object(layer, "estimate_index", estimate):
        for call in (lambda: striped_sparse_attention(q, k, v, MTrainingAttentionSettings(config)),
                     lambda: ring_sparse_attention(q, k, v, config)):
            new_step()
            made.clear(), defaults.clear(), checks.clear()
            call()
            assert (len(made), defaults, len(checks)) == (1, [q.shape[-1]], 1)
    assert len(estimates) == 1 and isinstance(estimates[0], comm_module.RingComm)


def world_2(rank, world):
    check_ring_equals_references(rank, world, None, seed=0)
    check_ring_in_bf16(rank, world, None)
    check_estimation_equals_single_device(rank, world, None)
    check_fused_estimator_scheme_on_cpu(rank, world, None)
    check_bad_inputs_fail_everywhere(rank, world)
    check_agreement_once_per_step(rank, world)
    check_one_comm_one_scale_one_check_per_call(rank, world)
    check_group_of_one_is_single_device(rank, world)


def world_3(rank, world):
    check_ring_equals_references(rank, world, None, seed=1)
    check_estimation_equals_single_device(rank, world, None)
    check_fused_estimator_scheme_on_cpu(rank, world, None)
    check_top_p_across_ranks(rank, world, None)


def world_4_and_sub_groups(rank, world):
    check_ring_equals_references(rank, world, None, seed=2)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    mine = pairs[rank // 2]
    check_ring_equals_references(rank % 2, 2, mine, seed=3)  # [2, 3] runs beside [0, 1]
    check_estimation_equals_single_device(rank % 2, 2, mine)
    check_top_p_across_ranks(rank % 2, 2, mine)


@pytest.mark.parametrize("world, check", [(2, world_2), (3, world_3), (4, world_4_and_sub_groups)],
                         ids=["world2", "world3", "world4-and-subgroups-0-1-2-3"])
@pytest.mark.usefixtures("built_ops")  # built before the ranks start
def test_ring_on_gloo(world, check):
    run_on_ranks(check, world, timeout=HANG_TIMEOUT_S)


# ---------------------------------------------------------------------------- in-process
def test_merge_is_exact_and_nan_free():
    g = torch.Generator().manual_seed(0)
    lse = torch.randn(2, 3, 5, generator=g) * 30
    lse[0, 0, :2] = float("-inf")                       # rows without keys in the first part
    step_lse = torch.randn(2, 3, 5, generator=g) * 30
    step_lse[0, 0, 1:3] = float("-inf")                 # row 1 saw no key in either part
    out, step_out = torch.randn(2, 5, 3, 4, generator=g), torch.randn(2, 5, 3, 4, generator=g)
    out[0, :2, 0] = 0
    step_out[0, 1:3, 0] = 0
    merged_out, merged_lse = merge_partial(out, lse, step_out, step_lse)
    expected_lse = torch.logsumexp(torch.stack([lse.double(), step_lse.double()]), 0)
    torch.testing.assert_close(merged_lse.double(), expected_lse, atol=1e-5, rtol=1e-6)
    finite = torch.isfinite(expected_lse)
    w = torch.exp(lse.double() - torch.where(finite, expected_lse, 0.0))
    ws = torch.exp(step_lse.double() - torch.where(finite, expected_lse, 0.0))
    expected_out = out.double() * w.transpose(1, 2)[..., None] + step_out.double() * ws.transpose(1, 2)[..., None]
    torch.testing.assert_close(merged_out.double(), expected_out, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(merged_lse[0, 0, 1]) and (merged_out[0, 1, 0] == 0).all()
    assert not merged_out.isnan().any() and not merged_lse.isnan().any()
    assert torch.equal(merge_lse(torch.tensor([float("-inf")]), torch.tensor([float("-inf")])),
                       torch.tensor([float("-inf")]))


def test_layout_shards_and_unshards():
    layout = StripedLayout(3, BLOCK)
    x = torch.arange(3 * BLOCK * 2).view(1, -1, 1)
    shards = [layout.shard(x, r) for r in range(3)]
    assert torch.equal(shards[1][0, :, 0], torch.cat([torch.arange(64, 128), torch.arange(256, 320)]))
    assert torch.equal(layout.unshard(shards), x)
    with pytest.raises(ValueError, match="divisible by world x block_size"):
        layout.shard(x[:, :100], 0)
    # shards along the last dim, stacked rank-major (an all-gather's output), several leading dims
    y = torch.randn(2, 4, 3 * BLOCK * 2)
    stacked = torch.stack([layout.shard(y, r, dim=-1) for r in range(3)])
    assert torch.equal(layout.unshard_stacked(stacked), y)
    with pytest.raises(ValueError, match="expected"):
        layout.unshard_stacked(stacked[:2])
