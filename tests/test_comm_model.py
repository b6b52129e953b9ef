"""The flat vs hierarchical ring cost model against hand-computed cases."""
import json

import pytest

from ds_mtraining.bench.comm import main, ring_times

MB16 = 16 * 2**20


def test_one_node_rings_are_equal_and_compute_bound():
    flat, hier, intra_ms, _ = ring_times(1.0, MB16, nodes=1, per_node=8, intra_gbps=300, inter_gbps=25)
    assert intra_ms == pytest.approx(MB16 / 300e9 * 1e3)
    assert flat == hier == pytest.approx(8 * 1.0)


def test_hierarchical_ring_hides_inter_node_transfers():
    step_ms = 0.2
    flat, hier, intra_ms, inter_ms = ring_times(step_ms, MB16, nodes=4, per_node=8, intra_gbps=300, inter_gbps=25)
    assert inter_ms == pytest.approx(MB16 / 25e9 * 1e3)  # 0.671 ms, slower than a step
    assert flat == pytest.approx(32 * inter_ms)           # every flat step waits for InfiniBand
    assert hier == pytest.approx(4 * max(8 * max(step_ms, intra_ms), inter_ms))
    assert hier < flat


def test_writes_json(tmp_path):
    out = tmp_path / "comm.json"
    main(["--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["direction"] for r in rows} == {"forward", "backward"}
    assert all(r["hierarchical_ms"] <= r["flat_ms"] for r in rows)
