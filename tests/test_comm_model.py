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


def test_tiny_case_by_hand():
    """2 nodes x 2: 3 GB steps take 3 ms over 1000 GB/s links, 10 ms over 300 GB/s ones; a 2 ms step:
    flat = 4 steps x max(2, 10) = 40 ms, hierarchical = 2 x max(2 x max(2, 3), 10) = 20 ms."""
    assert ring_times(2.0, 3e9, nodes=2, per_node=2, intra_gbps=1000, inter_gbps=300) == \
        pytest.approx((40.0, 20.0, 3.0, 10.0))
    # compute bound inside the node: hierarchical = 2 x max(2 x 8, 10) = 32, flat = 4 x max(8, 10)
    assert ring_times(8.0, 3e9, 2, 2, 1000, 300)[:2] == pytest.approx((40.0, 32.0))


def test_writes_json_with_the_hand_computed_default_rows(tmp_path):
    """Defaults: 512K tokens on 4 x 8 ranks, 2 KV heads x 128 dims in bf16, so a shard's K and V
    are 2 x 16384 x 2 x 128 x 2 B = 16 MiB (backward: 48 MiB with fp32 dK, dV); a step computes
    1/64 of the 128K anchor time scaled by (512K / 128K)^2 = 16 (so x 1/64 overall), forward 1/3.5 of it."""
    out = tmp_path / "comm.json"
    main(["--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and {r["direction"] for r in rows} == {"forward", "backward"}
    row = {r["direction"]: r for r in rows if r["density"] == 0.034}
    # density 3.4%: 46.6 ms fwd+bwd at 128K -> forward step 46.6 / 3.5 / 64 = 0.20804 ms,
    # backward step (46.6 - 13.314) / 64 = 0.52009 ms; 16 MiB over 25 GB/s = 0.67109 ms,
    # over 300 GB/s = 0.055924 ms (48 MiB: 2.0133 and 0.16777 ms)
    expected = {"forward": dict(step_compute_ms=0.20804, step_mb=16, inter_ms=0.67109, intra_ms=0.055924,
                                flat_ms=32 * 0.67109, hierarchical_ms=4 * 8 * 0.20804),
                "backward": dict(step_compute_ms=0.52009, step_mb=48, inter_ms=2.0133, intra_ms=0.16777,
                                 flat_ms=32 * 2.0133, hierarchical_ms=4 * 8 * 0.52009)}
    for direction, values in expected.items():
        for key, value in values.items():
            assert row[direction][key] == pytest.approx(value, rel=1e-4), (direction, key)


def scaling_record(one_gpu_kernel_ms: float, ring_ms: float, launch: str, ring: str) -> dict:
    """A bench.scaling JSON of one 128K case (Hkv 2, D 128)."""
    return {"shape": {"heads": 16, "kv_heads": 2, "head_dim": 128},
            "cases": [{"seq_len": 131072, "mode": "given_index", "ring": ring, "launch": launch,
                       "times": {"ring_ms": ring_ms, "one_gpu_kernel_ms": one_gpu_kernel_ms},
                       "breakdown": {"mean_ms": {"comm_wait": 0.01}}}]}


def test_model_against_measured_scaling_by_hand(tmp_path):
    """1 node x 2 at 128K from a 35 ms one-device kernel: steps of 35/3.5/4 = 2.5 ms (forward)
    and 6.25 ms (backward) outweigh their 64 MiB / 192 MiB over 300 GB/s (0.22 / 0.67 ms), so the
    model is 2 x 2.5 + 2 x 6.25 = 17.5 ms against the 20 ms measured. At 0.01 GB/s the transfers
    bound it: 2 x 6710.9 + 2 x 20132.7 ms. A launch without 'N node(s) x P' is an error."""
    path = tmp_path / "multi_gpu_x2.json"
    path.write_text(json.dumps(scaling_record(35.0, 20.0, "1 node x 2", "flat")))
    (row,) = main(["--against-scaling", str(path), "--intra-gbps", "300", "--inter-gbps", "300",
                   "--out", str(tmp_path / "vs.json")])["rows"]
    assert row["model_ring_ms"] == pytest.approx(17.5) and row["bound"] == "compute"
    assert row["model_over_measured"] == pytest.approx(17.5 / 20.0)
    (slow,) = main(["--against-scaling", str(path), "--intra-gbps", "0.01", "--inter-gbps", "0.01",
                    "--out", str(tmp_path / "slow.json")])["rows"]
    kv_ms = 2 * 65536 * 2 * 128 * 2 / 0.01e9 * 1e3
    assert slow["model_ring_ms"] == pytest.approx(2 * kv_ms + 2 * 3 * kv_ms) and slow["bound"] == "transfer"
    path.write_text(json.dumps(scaling_record(35.0, 20.0, "somewhere", "flat")))
    with pytest.raises(SystemExit, match="launch 'somewhere' does not say 'N node\\(s\\) x P'"):
        main(["--against-scaling", str(path), "--out", str(tmp_path / "bad.json")])
