"""Algorithm 1 (token-diagonal rule) on constructed and planted RoPE'd q/k, single device and
from striped shards (gloo, W = 2, 3)."""
import math

import pytest
import torch

from ds_mtraining import SparseConfig, estimate_vertical_slash, synthetic
from ds_mtraining.bench.recall import reference_rule_index
from ds_mtraining.distributed.spawn import run_on_ranks
from ds_mtraining.estimator.rule import column_and_diagonal_mass, last_query_scores, select_top_p
from ds_mtraining.reference import dense_attention_with_lse, dense_mask
from ds_mtraining.distributed.comm import RingComm
from ds_mtraining.layout import StripedLayout
from ds_mtraining.estimator.distributed import estimate_vertical_slash_distributed

HANG_TIMEOUT_S = 150
# kv head 0 (query heads 0, 1): token diagonal 100 = 64 + 36, straddling block boundaries at
# block 64 (so it needs block diagonals 1 and 2); kv head 1: diagonal 450 = 7 * 64 + 2
OFFSETS, COLUMNS = (100, 450), ((7, 40), (333,))


def planted_qk(seed=0, seq_len=1024):
    return synthetic.planted_qk(seq_len, 4, 2, 64, offsets=OFFSETS, columns=COLUMNS, seed=seed)


def last_rows_kept_mass(q, k, index, last_q):
    mask = dense_mask(index)
    s = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool).tril().expand_as(mask)
    _, lse_full = dense_attention_with_lse(q, k, k, causal, scale)
    _, lse_kept = dense_attention_with_lse(q, k, k, mask, scale)
    return torch.exp(lse_kept - lse_full)[..., -last_q:]  # kept softmax mass of each row


def test_masses_equal_a_loop_over_entries():
    """Column and token-diagonal masses (skewed view) against a float64 loop over every entry."""
    g = torch.Generator().manual_seed(0)
    lq, s = 7, 40
    q_pos = torch.arange(s - lq, s)
    probs = torch.rand(2, 3, lq, s, generator=g, dtype=torch.float64)
    probs *= q_pos[:, None] >= torch.arange(s)[None, :]
    columns, diagonals = column_and_diagonal_mass(probs)
    expected_c = torch.zeros(2, 3, s, dtype=torch.float64)
    expected_d = torch.zeros(2, 3, s, dtype=torch.float64)
    for i in range(lq):
        for key in range(int(q_pos[i]) + 1):
            expected_c[..., key] += probs[..., i, key] / lq
            expected_d[..., int(q_pos[i]) - key] += probs[..., i, key] / lq
    torch.testing.assert_close(columns, expected_c, rtol=0, atol=1e-15)
    torch.testing.assert_close(diagonals, expected_d, rtol=0, atol=1e-15)


def test_known_diagonal_straddling_a_block_boundary_is_kept_whole():
    """Every last row puts mass 0.6 on token diagonal 100 (36 past a block boundary at block 64),
    0.3 on column 5, 0.1 on its own key: the rule selects exactly that diagonal and column, and
    the index covers the diagonal in every row (block diagonals 1 and 2), the column below key 5."""
    s, lq, block = 512, 64, 64
    q_pos = torch.arange(s - lq, s)
    logits = torch.full((1, 1, lq, s), -1e9, dtype=torch.float64)
    rows = torch.arange(lq)
    logits[0, 0, rows, q_pos - 100] = math.log(0.6)
    logits[0, 0, rows, 5] = math.log(0.3)
    logits[0, 0, rows, q_pos] = math.log(0.1)
    columns, diagonals = column_and_diagonal_mass(torch.softmax(logits, -1))
    assert select_top_p(diagonals, 0.5, 4096).tolist() == [[[100]]]
    assert select_top_p(columns, 0.25, 4096).tolist() == [[[5]]]
    torch.testing.assert_close(diagonals[0, 0, [0, 100]], torch.tensor([0.1, 0.6], dtype=torch.float64))

    q, k = planted_qk()
    index = estimate_vertical_slash(q, k, SparseConfig(block_size=block, sink_tokens=0))
    assert {1, 2} <= set(index.slash[0, 0].tolist()), "diagonal 100 needs block diagonals 1 and 2"


def test_recovers_planted_columns_and_diagonals():
    q, k = planted_qk()
    config = SparseConfig(block_size=64, p_vertical=0.9, p_slash=0.9, sink_tokens=0)
    index = estimate_vertical_slash(q, k, config)
    mask = dense_mask(index)
    rows = torch.arange(1024)
    for h in range(4):
        offset, cols = OFFSETS[h // 2], COLUMNS[h // 2]
        assert mask[0, h, rows[offset:], rows[offset:] - offset].all(), f"head {h} misses slash {offset}"
        for c in cols:
            assert mask[0, h, c:, c].all(), f"head {h} misses column {c}"
    assert index.density() < 0.5, "a planted pattern must give a sparse index"


@pytest.mark.parametrize("seed", [0, 1])
def test_equals_reference_rule(seed):
    """The vectorised estimator equals the head-by-head float64 re-implementation of the rule
    (bench.recall.reference_rule_index) on planted and on noise inputs."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, 640, 4, 32, generator=g), torch.randn(1, 640, 2, 32, generator=g)
    for q, k in (planted_qk(seed, 640), noise):
        for config in (SparseConfig(block_size=64, p_vertical=0.8, p_slash=0.9, max_slash_diagonals=30),
                       SparseConfig(block_size=128, last_q=100, p_vertical=0.95, p_slash=0.7)):
            got, expected = estimate_vertical_slash(q, k, config), reference_rule_index(q, k, config)
            assert torch.equal(got.slash, expected.slash) and torch.equal(got.vertical, expected.vertical)


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
    columns, diagonals = column_and_diagonal_mass(probs)
    budgets = []
    for p in (0.05, 0.3, 0.6, 0.9, 1.0):
        vertical, slash = select_top_p(columns, p, 4096), select_top_p(diagonals, p, 4096)
        budget = ((vertical >= 0).sum(-1), (slash >= 0).sum(-1))
        assert (budget[0] >= 1).all() and (budget[1] >= 1).all()
        budgets.append(budget)
        config = SparseConfig(block_size=64, p_vertical=p, p_slash=p, sink_tokens=0)
        index = estimate_vertical_slash(q, k, config)
        mask = dense_mask(index)
        for h in range(4):
            chosen = vertical[0, h][vertical[0, h] >= 0]
            assert all(mask[0, h, c:, c].all() for c in chosen.tolist())
            assert index.vertical_count[0, h] <= budget[0][0, h]
    for (v0, s0), (v1, s1) in zip(budgets, budgets[1:]):
        assert (v0 <= v1).all() and (s0 <= s1).all()
    assert (budgets[-1][0] == 512).all() and (budgets[-1][1] == 512).all(), "p = 1 selects everything"
    assert (index.slash_count == 8).all() and (index.vertical_count == 0).all(), \
        "every block diagonal is kept, so every column is redundant"


def test_caps_sinks_and_local_blocks():
    q, k = torch.randn(1, 1024, 2, 64), torch.randn(1, 1024, 2, 64)
    config = SparseConfig(block_size=64, p_vertical=1.0, p_slash=1.0, max_vertical=10, max_slash_diagonals=2,
                          sink_tokens=3, local_blocks=2)
    index = estimate_vertical_slash(q, k, config)
    assert (index.vertical_count <= 10 + 3).all()
    assert (index.slash_count <= 2 * 2 + 2).all(), "each token diagonal marks at most 2 block diagonals"
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
    (dict(max_slash_diagonals=0), "max_slash_diagonals"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseConfig(**kwargs)


def test_renamed_cap_is_refused_with_the_new_key():
    with pytest.raises(ValueError, match="'max_slash' in 'SparseConfig' .* use 'max_slash_diagonals'"):
        SparseConfig(max_slash=4096)
    with pytest.raises(ValueError, match="'max_slash' in 'mtraining.sparse' .* use 'max_slash_diagonals'"):
        SparseConfig.from_dict({"max_slash": 4096}, "mtraining.sparse")


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['p_vert'\]"):
        SparseConfig.from_dict({"p_vert": 0.9})


def test_bad_qk_layout():
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        estimate_vertical_slash(torch.randn(1, 128, 3, 64), torch.randn(1, 128, 2, 64), SparseConfig())
    with pytest.raises(ValueError, match="FlashAttention layout"):
        estimate_vertical_slash(torch.randn(128, 3, 64), torch.randn(128, 3, 64), SparseConfig())


# ---------------------------------------------------------------------------- distributed
def distributed_equals_single_device(rank, world):
    """Striped shards give the single-device index: planted (diagonals straddling blocks, split
    over ranks) and noise; last_q <= block (one spill hop) and last_q > 2 blocks (three hops)."""
    comm = RingComm(None)
    g = torch.Generator().manual_seed(world)
    for block, last_q in ((64, 64), (64, 150), (128, 64)):
        seq_len = world * block * 4
        layout = StripedLayout(world, block)
        noise = torch.randn(1, seq_len, 4, 32, generator=g), torch.randn(1, seq_len, 2, 32, generator=g)
        for what, (q, k) in (("planted", planted_qk(seq_len=seq_len)), ("noise", noise)):
            config = SparseConfig(block_size=block, last_q=last_q, p_vertical=0.95, p_slash=0.95,
                                  max_slash_diagonals=60)
            expected = estimate_vertical_slash(q, k, config)
            got = estimate_vertical_slash_distributed(layout.shard(q, rank), layout.shard(k, rank), config, comm)
            where = f"{what}, block {block}, last_q {last_q}, W={world}"
            assert torch.equal(got.slash, expected.slash), f"{where}: slash differs"
            assert torch.equal(got.vertical, expected.vertical), f"{where}: vertical differs"


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_equals_single_device(world):
    run_on_ranks(distributed_equals_single_device, world, timeout=HANG_TIMEOUT_S)
