"""Per-(worker, step) work from the compact index, the imbalance metrics and the balance bench."""
import json

import pytest
import torch

from ds_mtraining import SparseConfig, SparseIndex
from ds_mtraining.bench import balance
from ds_mtraining.index import Stripe
from ds_mtraining.reference import dense_mask, mask_between
from ds_mtraining.ring import StripedLayout, ZigzagLayout, imbalance, pair_work, step_work

BLOCK = 64


def random_index(seq_len, heads=3, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = seq_len // BLOCK
    slash = torch.randint(-1, nb, (batch, heads, 6), generator=g)
    vertical = torch.randint(-1, seq_len, (batch, heads, 9), generator=g)
    return SparseIndex.from_blocks(slash, vertical, seq_len, BLOCK)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_striped_pair_work_counts_the_kernels_dense_masks(world):
    index = random_index(world * BLOCK * 4, seed=world)
    work = pair_work(index, StripedLayout(world, BLOCK))
    for r in range(world):
        for s in range(world):
            assert work[r, s] == dense_mask(index, Stripe(world, r, s)).sum(), (r, s)
    assert work.sum() == index.num_entries().sum()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_pair_work_counts_the_dense_mask_at_zigzag_positions(world):
    seq_len = 2 * world * BLOCK * 2
    index = random_index(seq_len, seed=10 + world)
    layout = ZigzagLayout(world, BLOCK)
    work = pair_work(index, layout)
    for r in range(world):
        for s in range(world):
            dense = mask_between(index, layout.positions(seq_len, r), layout.positions(seq_len, s))
            assert work[r, s] == dense.sum(), (r, s)


def test_zigzag_layout_positions_and_roundtrip():
    layout = ZigzagLayout(3, BLOCK)
    seq_len = 6 * BLOCK
    assert torch.equal(layout.positions(seq_len, 0), torch.cat([torch.arange(64), torch.arange(320, 384)]))
    x = torch.randn(1, seq_len, 2)
    assert torch.equal(layout.unshard([layout.shard(x, r) for r in range(3)]), x)
    owner = layout.block_owner(6)
    assert owner.tolist() == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="2 x world x block_size"):
        layout.positions(5 * BLOCK, 0)


def test_step_work_follows_the_ring_and_metrics_match_hand_counts():
    pairs = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    # worker r at step t holds the keys of rank (r - t) mod 3
    steps = step_work(pairs)
    assert steps.tolist() == [[1, 3, 2], [5, 4, 6], [9, 8, 7]]
    m = imbalance(steps)
    assert m["worker_level"] == pytest.approx((9 + 8 + 7) / ((15 + 15 + 15) / 3))
    assert m["worker_total"] == pytest.approx(24 / 15)
    assert m["step_level_worst"] == pytest.approx(3 / 2)       # worker 0: max 3, mean 2
    assert m["step_level_mean"] == pytest.approx((3 / 2 + 6 / 5 + 9 / 8) / 3)
    balanced = imbalance(torch.ones(4, 4))
    assert all(v == pytest.approx(1.0) for v in balanced.values())


def test_synthetic_index_is_the_estimators_and_denser_with_more_slashes():
    config = SparseConfig(block_size=BLOCK, max_slash_diagonals=8192)
    sparse = balance.synthetic_index(8192, 2, 2, config, seed=0)
    dense = balance.synthetic_index(8192, 2, 24, config, seed=0)
    assert sparse.heads == 2 and sparse.seq_len == 8192
    assert dense.density() > sparse.density()
    # the sink tokens and the local window always make it in
    assert (sparse.slash[..., 0] == 0).all() and (sparse.vertical[..., :4] == torch.arange(4)).all()


def test_balance_cli_writes_json_and_png(tmp_path):
    assert balance.main(["--seq-lens", "8192", "--worlds", "2", "4", "--heads", "2",
                         "--sparsity", "0.9", "--block-size", "64", "--max-vertical", "256",
                         "--out", str(tmp_path), "--name", "smoke"]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["command"].startswith("python -m ds_mtraining.bench.balance")
    rows = result["rows"]
    assert [r["world"] for r in rows] == [2, 4]
    for r in rows:
        steps = torch.tensor(r["striped"]["steps"])
        assert steps.shape == (r["world"], r["world"])
        assert steps.sum() == pytest.approx(r["entries"])  # every entry on one (worker, step)
        assert r["striped"]["worker_level"] == pytest.approx(imbalance(steps)["worker_level"])
    assert (tmp_path / "smoke.png").stat().st_size > 10_000
