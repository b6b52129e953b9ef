"""Algorithm 1 on synthetic RoPE'd q/k with planted vertical columns and slash diagonals."""
import math

import pytest
import torch

from ds_mtraining import SparseConfig, estimate_vertical_slash, synthetic
from ds_mtraining.estimate import column_and_diagonal_mass, last_query_scores, select_top_p
from ds_mtraining.reference import dense_attention_with_lse


def planted_qk(seed=0):
    """Kv head 0 (query heads 0, 1): slash 320, columns 7 and 40; kv head 1: slash 512, column 333."""
    return synthetic.planted_qk(1024, 4, 2, 64, offsets=(320, 512), columns=((7, 40), (333,)), seed=seed)


def last_rows_kept_mass(q, k, index, last_q):
    mask = index.to_dense_mask()
    s = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool).tril().expand_as(mask)
    _, lse_full = dense_attention_with_lse(q, k, k, causal, scale)
    _, lse_kept = dense_attention_with_lse(q, k, k, mask, scale)
    return torch.exp(lse_kept - lse_full)[..., -last_q:]  # kept softmax mass of each row


def test_recovers_planted_columns_and_diagonals():
    q, k = planted_qk()
    config = SparseConfig(block_size=64, p_vertical=0.9, p_slash=0.9, sink_tokens=0)
    index = estimate_vertical_slash(q, k, config)
    mask = index.to_dense_mask()
    rows = torch.arange(1024)
    for h, (offset, cols) in enumerate([(320, (7, 40)), (320, (7, 40)), (512, (333,)), (512, (333,))]):
        assert mask[0, h, rows[offset:], rows[offset:] - offset].all(), f"head {h} misses slash {offset}"
        for c in cols:
            assert mask[0, h, c:, c].all(), f"head {h} misses column {c}"
    assert index.density() < 0.5, "a planted pattern must give a sparse index"


@pytest.mark.parametrize("p", [0.5, 0.8, 0.95])
def test_kept_mass_of_last_rows_reaches_p(p):
    q, k = planted_qk(seed=1)
    config = SparseConfig(block_size=64, last_q=64, p_vertical=p, p_slash=p)
    index = estimate_vertical_slash(q, k, config)
    kept = last_rows_kept_mass(q, k, index, config.last_q)
    assert kept.mean(-1).min() >= p - 1e-4


def test_budgets_grow_with_p_and_are_at_least_one():
    """Top-p budgets (selection counts) per head; the index then keeps the selected columns
    except those its leading diagonals already cover."""
    q = torch.randn(1, 512, 4, 64)
    k = torch.randn(1, 512, 2, 64)
    pos = torch.arange(512)
    probs = torch.softmax(last_query_scores(q[:, -64:], k, pos[-64:], pos, 1 / 8), -1)
    columns, diagonals = column_and_diagonal_mass(probs, pos[-64:], pos, 512, 64)
    budgets = []
    for p in (0.05, 0.3, 0.6, 0.9, 1.0):
        vertical, slash = select_top_p(columns, p, 4096), select_top_p(diagonals, p, 4096)
        budget = ((vertical >= 0).sum(-1), (slash >= 0).sum(-1))
        assert (budget[0] >= 1).all() and (budget[1] >= 1).all()
        budgets.append(budget)
        config = SparseConfig(block_size=64, p_vertical=p, p_slash=p, sink_tokens=0)
        index = estimate_vertical_slash(q, k, config)
        mask = index.to_dense_mask()
        for h in range(4):
            chosen = vertical[0, h][vertical[0, h] >= 0]
            assert all(mask[0, h, c:, c].all() for c in chosen.tolist())
            assert index.vertical_count[0, h] <= budget[0][0, h]
    for (v0, s0), (v1, s1) in zip(budgets, budgets[1:]):
        assert (v0 <= v1).all() and (s0 <= s1).all()
    assert (budgets[-1][0] == 512).all() and (budgets[-1][1] == 8).all(), "p = 1 selects everything"
    assert (index.vertical_count == 0).all(), "under every diagonal each column is redundant"


def test_caps_sinks_and_local_blocks():
    q, k = torch.randn(1, 1024, 2, 64), torch.randn(1, 1024, 2, 64)
    config = SparseConfig(block_size=64, p_vertical=1.0, p_slash=1.0, max_vertical=10, max_slash=128,
                          sink_tokens=3, local_blocks=2)
    index = estimate_vertical_slash(q, k, config)
    assert (index.vertical_count <= 10 + 3).all()
    assert (index.slash_count <= 2 + 2).all()
    assert (index.vertical[..., :3] == torch.arange(3, dtype=torch.int32)).all()
    assert (index.slash[..., :2] == torch.arange(2, dtype=torch.int32)).all()


def test_a_peaked_head_still_gets_budget_one():
    """A head whose top entry alone reaches p keeps exactly that entry (no off-by-one)."""
    q = torch.zeros(1, 256, 1, 64)
    k = torch.zeros(1, 256, 1, 64)
    q[..., 0] = 30.0
    k[0, 5, 0, 0] = 30.0  # every query puts almost all mass on key 5
    index = estimate_vertical_slash(q, k, SparseConfig(block_size=64, p_vertical=0.5, sink_tokens=0))
    assert index.vertical_count.item() == 1 and index.vertical[0, 0, 0].item() == 5


@pytest.mark.parametrize("kwargs,message", [
    (dict(p_vertical=0.0), "top-p must be in"),
    (dict(p_slash=1.5), "top-p must be in"),
    (dict(block_size=32), "block_size=32 is unsupported"),
    (dict(local_blocks=0), "local_blocks"),
    (dict(last_q=0), "last_q"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseConfig(**kwargs)


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['p_vert'\]"):
        SparseConfig.from_dict({"p_vert": 0.9})


def test_bad_qk_layout():
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        estimate_vertical_slash(torch.randn(1, 128, 3, 64), torch.randn(1, 128, 2, 64), SparseConfig())
    with pytest.raises(ValueError, match="FlashAttention layout"):
        estimate_vertical_slash(torch.randn(128, 3, 64), torch.randn(128, 3, 64), SparseConfig())
