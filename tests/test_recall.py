"""Recall of an index (share of the exact causal attention mass over all rows) against a
hand-computed case and float64 dense attention; the oracle and the benchmark's rules."""
import pytest
import torch

from ds_mtraining import SparseConfig, SparseIndex, estimate_vertical_slash, synthetic
from ds_mtraining.bench.recall import block_pooled_index, main as bench_main, static_index
from ds_mtraining.recall import attention_recall, block_entries, oracle_recall, recall
from ds_mtraining.reference import dense_attention_with_lse, dense_mask

EXACT = dict(rtol=0, atol=1e-12)   # float64 blockwise vs float64 dense: summation order only
FP32 = dict(rtol=0, atol=2e-5)     # float32 blockwise vs float64 dense


def dense_recall(q, k, index):
    """Float64 reference: the mean over rows of exp(lse over kept keys - lse over causal keys)."""
    mask = dense_mask(index)
    s = q.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril().expand_as(mask)
    _, full = dense_attention_with_lse(q.double(), k.double(), k.double(), causal)
    _, kept = dense_attention_with_lse(q.double(), k.double(), k.double(), mask)
    return torch.exp(kept - full).mean(-1)


def test_uniform_attention_by_hand():
    """q = 0 makes every row uniform over its i + 1 causal keys. With the diagonal blocks (64)
    and column 0 kept, a row i >= 64 keeps keys 0 and 64 .. i: (i - 62) / (i + 1) of its mass;
    rows of block 0 keep everything. Density: two causal diagonal blocks plus column 0 under
    block 0, over the 128 * 129 / 2 causal entries."""
    s = 128
    q, k = torch.zeros(1, s, 1, 16, dtype=torch.float64), torch.randn(1, s, 1, 16, dtype=torch.float64)
    index = SparseIndex.from_blocks(torch.zeros(1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, dtype=torch.long),
                                    s, 64)
    expected = (64 + sum((i - 62) / (i + 1) for i in range(64, s))) / s
    result = attention_recall(q, k, [index], 64, key_chunk=48)
    assert result.recall.item() == pytest.approx(expected, abs=1e-13)
    assert result.density.item() == pytest.approx((2 * 64 * 65 / 2 + 64) / (s * (s + 1) / 2), abs=1e-15)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, EXACT), (torch.float32, FP32)])
def test_equals_dense_attention(random_index, dtype, tol):
    """Random indices (columns, token diagonals) and planted q/k, GQA, a partial last block,
    keys in chunks that cut blocks: every head's recall equals float64 dense attention."""
    s = 64 * 5 + 17
    q, k = synthetic.planted_qk(s, 4, 2, 32, offsets=(70, 150), columns=((3, 90), (200,)), dtype=dtype)
    indices = [random_index(1, 4, s, 64, n_vertical=6, n_slash=3, seed=seed) for seed in range(3)]
    result = attention_recall(q, k, indices, 64, key_chunk=100)
    for n, index in enumerate(indices):
        torch.testing.assert_close(result.recall[n], dense_recall(q, k, index), **tol)
        torch.testing.assert_close(result.density[n], dense_mask(index).sum((-1, -2)).double() / (s * (s + 1) / 2),
                                   rtol=0, atol=1e-15)
    torch.testing.assert_close(recall(q, k, indices[0]), result.recall[0], **tol)


def test_block_mass_and_oracle():
    """Block masses equal the dense probabilities summed per block over S; the oracle keeps
    everything at density 1, never loses to a block-granular index of its density, and grows
    with the density."""
    s, block = 256, 64
    q, k = synthetic.planted_qk(s, 2, 1, 32, offsets=(90,), columns=((10,),), dtype=torch.float64)
    config = SparseConfig(block_size=block, sink_tokens=0)
    static = static_index(1, 2, s, config, 2, q.device)
    result = attention_recall(q, k, [static], block)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k.expand(1, s, 2, 32)) / 32 ** 0.5
    probs = torch.softmax(logits.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf")), -1)
    expected = probs.view(1, 2, 4, block, 4, block).sum((3, 5)) / s
    torch.testing.assert_close(result.block_mass, expected, **EXACT)
    assert block_entries(s, block).sum().item() == s * (s + 1) / 2

    full, density = oracle_recall(result.block_mass, s, block, 1.0)
    torch.testing.assert_close(full, torch.ones(1, 2, dtype=torch.float64), **EXACT)
    assert (density == 1).all()
    matched, density = oracle_recall(result.block_mass, s, block, result.density[0])
    assert (density <= result.density[0] + 1e-12).all() and (matched >= result.recall[0] - 1e-12).all()
    lower, _ = oracle_recall(result.block_mass, s, block, 0.3)
    assert (lower <= matched).all()


def test_token_rule_keeps_a_straddling_diagonal_that_block_pooling_splits():
    """A planted diagonal at 100 = 64 + 36 (block 64): the token rule keeps block diagonals 1
    and 2 and so the whole diagonal; pooling per block diagonal over the last rows keeps one."""
    s = 1024
    q, k = synthetic.planted_qk(s, 1, 1, 64, offsets=(100,), columns=((),), sharp=3.0)
    config = SparseConfig(block_size=64, sink_tokens=0, p_vertical=0.5, p_slash=0.5)
    token, pooled = estimate_vertical_slash(q, k, config), block_pooled_index(q, k, config)
    assert {1, 2} <= set(token.slash[0, 0].tolist())
    rec = attention_recall(q, k, [token, pooled], 64).recall
    assert rec[0].item() > rec[1].item() + 0.05, f"token {rec[0].item():.3f}, pooled {rec[1].item():.3f}"


def test_bench_writes_curves(tmp_path):
    """The command end to end on one small planted input: JSON and PNG, verdict met."""
    assert bench_main(["--seq-lens", "1024", "--out", str(tmp_path), "--name", "recall_small"]) == 0
    assert (tmp_path / "recall_small.json").is_file() and (tmp_path / "recall_small.png").is_file()
