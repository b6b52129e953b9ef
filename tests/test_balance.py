"""Per-(worker, step) work from the compact index, the imbalance metrics and the balance bench."""
import json

import pytest
import torch

from ds_mtraining import SparseConfig, SparseIndex
from ds_mtraining.bench import balance
from ds_mtraining.index import Stripe
from ds_mtraining.reference import dense_mask, mask_between
from ds_mtraining.layout import StripedLayout, ZigzagLayout
from ds_mtraining.ring import imbalance, pair_work, step_work

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


# two batch rows packed differently: a document shorter than a block, boundaries inside blocks
# and on block edges, one long document
DOCUMENT_ROWS = [[0, 5, 64, 100, 101, 230, 400], [0, 300]]


@pytest.mark.parametrize("layout_kind", ["striped", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_pair_work_with_documents_counts_the_masked_entries(world, layout_kind):
    from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
    seq_len = 2 * world * BLOCK * 4
    layout = StripedLayout(world, BLOCK) if layout_kind == "striped" else ZigzagLayout(world, BLOCK)
    index = random_index(seq_len, seed=20 + world)
    doc_start = doc_start_from_cu_seqlens([torch.tensor(r + [seq_len]) for r in DOCUMENT_ROWS], seq_len, 2)
    documents = document_causal_mask(doc_start)[:, None]
    work = pair_work(index, layout, doc_start)
    for r in range(world):
        for s in range(world):
            q_pos, k_pos = layout.positions(seq_len, r), layout.positions(seq_len, s)
            allowed = documents[..., q_pos[:, None], k_pos[None, :]]
            assert work[r, s] == (mask_between(index, q_pos, k_pos) & allowed).sum(), (r, s)
    assert work.sum() < pair_work(index, layout).sum()  # the documents matter: the test can fail


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


@pytest.mark.parametrize("documents", [[], ["--documents", "300", "2000"]], ids=["plain", "documents"])
def test_balance_cli_writes_json_and_png(tmp_path, documents):
    assert balance.main(["--seq-lens", "8192", "--worlds", "2", "4", "--heads", "2",
                         "--sparsity", "0.9", "--block-size", "64", "--max-vertical", "256",
                         "--out", str(tmp_path), "--name", "smoke", *documents]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert all((r["documents"] is None) == (not documents) for r in result["rows"])
    assert result["command"].startswith("python -m ds_mtraining.bench.balance")
    rows = result["rows"]
    assert [r["world"] for r in rows] == [2, 4]
    for r in rows:
        steps = torch.tensor(r["striped"]["steps"])
        assert steps.shape == (r["world"], r["world"])
        assert steps.sum() == pytest.approx(r["entries"])  # every entry on one (worker, step)
        assert r["striped"]["worker_level"] == pytest.approx(imbalance(steps)["worker_level"])
    assert (tmp_path / "smoke.png").stat().st_size > 10_000


def test_attention_stats_with_documents_count_the_masked_entries():
    """The training metrics with document masking: density = index entries inside documents /
    the document-masked causal entries (one process), and the ring's imbalance from the same
    document-aware counts."""
    from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
    from ds_mtraining.layer import AttentionStats
    seq_len = 2 * 2 * BLOCK * 4
    index = random_index(seq_len, seed=30)
    doc_start = doc_start_from_cu_seqlens([torch.tensor(r + [seq_len]) for r in DOCUMENT_ROWS], seq_len, 2)
    allowed = document_causal_mask(doc_start)[:, None].expand(-1, index.heads, -1, -1)
    stats = AttentionStats()
    stats.record(index, 1, doc_start)
    stats.record(index, 2, doc_start)
    stats.record(index, 2)
    expected = float((dense_mask(index) & allowed).sum()) / float(allowed.sum())
    assert stats.densities[:2] == pytest.approx([expected, expected]) and stats.densities[2] == index.density()
    pairs = pair_work(index, StripedLayout(2, BLOCK), doc_start)
    assert stats.imbalances == pytest.approx([1.0, imbalance(step_work(pairs))["worker_level"],
                                              imbalance(step_work(pair_work(index, StripedLayout(2, BLOCK))))["worker_level"]])
    assert expected != pytest.approx(index.density())
