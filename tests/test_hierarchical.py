"""Hierarchical (inner x outer) sparse ring on CPU with gloo: spawned ranks against the flat ring
and the single-process kernel, group membership, and topology errors."""
import pytest
import torch
import torch.distributed as dist
from helpers import ring_inputs

from ds_mtraining import SparseConfig, sparse_attention
from ds_mtraining.distributed.spawn import run_on_ranks
from ds_mtraining.reference import outputs_and_grads
from ds_mtraining.layout import StripedLayout
from ds_mtraining.ring import ring_sparse_attention
from ds_mtraining.distributed.topology import Topology, create_hierarchical_groups, read_hostfile

BLOCK = 64
TOL = dict(atol=2e-5, rtol=1e-4)  # fp32 kernels, different merge/accumulation order
GRAD_TOL = dict(atol=1e-4, rtol=1e-3)


def ring_grads(q, k, v, dout, index, layout, rank, **ring_kwargs):
    """This rank's (out, dq, dk, dv) shards from the ring."""
    config = SparseConfig(block_size=BLOCK)
    return outputs_and_grads(lambda a, b, c: ring_sparse_attention(a, b, c, config, index=index, **ring_kwargs),
                             *(layout.shard(t, rank) for t in (q, k, v, dout)))


def compare_topologies(rank, world, topologies):
    """On every rank: hierarchical ring for each (nodes, per_node) vs flat ring vs one process."""
    seq_len = world * BLOCK * 2
    q, k, v, dout, index = ring_inputs(seq_len, BLOCK)
    layout = StripedLayout(world, BLOCK)
    reference = outputs_and_grads(lambda a, b, c: sparse_attention(a, b, c, index), q, k, v, dout)
    expected = [layout.shard(t, rank) for t in reference]
    flat = ring_grads(q, k, v, dout, index, layout, rank)
    for got, want in zip(flat, expected):
        torch.testing.assert_close(got, want, **GRAD_TOL)
    members = {}
    for nodes, per_node in topologies:
        hierarchy = create_hierarchical_groups(Topology(nodes, per_node), [list(range(world))])
        assert hierarchy.position == rank
        hier = ring_grads(q, k, v, dout, index, layout, rank, hierarchy=hierarchy)
        for name, got, flat_value, want in zip("out dq dk dv".split(), hier, flat, expected):
            torch.testing.assert_close(got, flat_value, **TOL, msg=lambda m: f"{nodes}x{per_node} {name}: {m}")
            torch.testing.assert_close(got, want, **GRAD_TOL)
        members[(nodes, per_node)] = (dist.get_process_group_ranks(hierarchy.inner),
                                      dist.get_process_group_ranks(hierarchy.outer))
        # a collective on the inner group sums its members only, one on the outer group its own
        value = torch.tensor([float(rank + 1)])
        inner_sum, outer_sum = value.clone(), value.clone()
        dist.all_reduce(inner_sum, group=hierarchy.inner)
        dist.all_reduce(outer_sum, group=hierarchy.outer)
        members[(nodes, per_node)] += (inner_sum.item(), outer_sum.item())
    return members


@pytest.mark.parametrize("world,topologies", [(4, [(2, 2), (1, 4), (4, 1)]), (6, [(2, 3), (3, 2)])])
@pytest.mark.usefixtures("built_ops")  # built before the ranks start
def test_hierarchical_ring_equals_flat_ring_and_single_process(world, topologies):
    results = run_on_ranks(compare_topologies, world, topologies, timeout=240)
    for rank, members in enumerate(results):
        for (nodes, per_node), (inner, outer, inner_sum, outer_sum) in members.items():
            node, local = divmod(rank, per_node)
            assert inner == [node * per_node + i for i in range(per_node)]
            assert outer == [n * per_node + local for n in range(nodes)]
            assert inner_sum == sum(r + 1 for r in inner) and outer_sum == sum(r + 1 for r in outer)


def test_topology_from_launcher_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_SIZE", "4")  # what the deepspeed launcher exports
    assert Topology.from_env() == Topology(2, 4)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=4\nnode-b slots=4\n")
    assert read_hostfile(str(hostfile)) == [("node-a", 4), ("node-b", 4)]
    assert Topology.from_env(hostfile=str(hostfile)) == Topology(2, 4)


def test_bad_topologies_fail_before_any_communication(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    with pytest.raises(ValueError, match="the world of 6 ranks is not whole nodes of 4 ranks"):
        Topology.from_env()
    with pytest.raises(ValueError, match="straddle nodes unevenly"):
        Topology(2, 4).split([0, 1, 2, 4])
    with pytest.raises(ValueError, match="not distinct ranks of a world of 8"):
        Topology(2, 4).split([0, 9])
    uneven = tmp_path / "hostfile"
    uneven.write_text("a slots=4\nb slots=2\n")
    with pytest.raises(ValueError, match="every node needs the same slots"):
        Topology.from_env(hostfile=str(uneven))
    uneven.write_text("a slots=four\n")
    with pytest.raises(ValueError, match="expected 'HOST slots=N'"):
        read_hostfile(str(uneven))
    # dist is not initialised here: create_hierarchical_groups validates before touching it
    with pytest.raises(ValueError, match="straddle nodes unevenly"):
        create_hierarchical_groups(Topology(2, 2), [[0, 1, 2]])


@pytest.mark.slow
@pytest.mark.usefixtures("built_ops")  # built before the launched ranks start
def test_deepspeed_launcher_two_fake_nodes_build_groups_and_match_flat_ring(tmp_path):
    """Two `deepspeed --hostfile --no_ssh --node_rank N` commands on one machine = 2 nodes x 2
    (2 blocks of 64 tokens per rank: every ring step still has work)."""
    import json
    import sys

    from helpers import finish, start

    from ds_mtraining.distributed.spawn import free_port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = str(free_port())
    nodes = []
    for node in (0, 1):
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
                   "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                   "--master_port", port, "--module", "ds_mtraining.tools.ring_check",
                   "--out", str(tmp_path / "out"), "--blocks-per-rank", "2"]
        log = tmp_path / f"node{node}.txt"
        nodes.append((start(command, log), log))
    for process, log in nodes:  # each launcher's process group is killed if it outlives the deadline
        finish(process, log, timeout=300)
    reports = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(4)]
    for r, report in enumerate(reports):
        assert (report["nodes"], report["per_node"], report["position"]) == (2, 2, r)
        assert report["inner"] == [r // 2 * 2, r // 2 * 2 + 1] and report["outer"] == [r % 2, r % 2 + 2]
        assert report["seq_len"] == 4 * 2 * 64
        assert report["ok"] and report["max_rel_error_vs_flat"] <= 1e-4
        assert report["max_rel_error_vs_one_device"] <= 1e-4


@pytest.mark.slow
@pytest.mark.usefixtures("built_ops")
def test_multi_gpu_check_script_launches_fake_nodes_of_several_gpus(tmp_path):
    """scripts/multi_gpu_check.sh's fake nodes, dry run on CPU (ALLOW_CPU=1 GPUS=4: 2 nodes x 2):
    the --include list gives node 0 GPUs 0,1 and node 1 GPUs 2,3, and every rank's hierarchical
    ring is within 1e-4 of the flat ring and of one device (ds_mtraining.tools.ring_check)."""
    import json
    import os
    import subprocess
    from pathlib import Path
    from ds_mtraining_op_builder import extension_root
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, ALLOW_CPU="1", GPUS="4", ONLY="check_2x2", OUT=str(tmp_path),
               TORCH_EXTENSIONS_DIR=extension_root())  # the op the session built (cpu_op)
    done = subprocess.run(["bash", str(root / "scripts" / "multi_gpu_check.sh")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "multi_gpu_summary.txt").read_text()
    assert done.returncode == 0, done.stdout[-3000:]
    assert "check_2x2       PASS" in summary and "overall: PASS" in summary, summary
    reports = [json.loads(line) for line in (tmp_path / "multi_gpu.log").read_text().splitlines()
               if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    for report in reports:
        assert report["cuda_visible_devices"] == ("0,1" if report["rank"] < 2 else "2,3")
        assert report["ok"] and report["max_rel_error_vs_one_device"] <= 1e-4


def test_hierarchical_groups_config_errors_name_the_fix():
    from ds_mtraining.distributed import ParallelConfigError
    from ds_mtraining.distributed.groups import hierarchical_topology
    with pytest.raises(ParallelConfigError, match="not whole nodes of 4 ranks.*mtraining.ring='flat'"):
        hierarchical_topology(6, 4, [list(range(6))])
    with pytest.raises(ParallelConfigError, match="straddle nodes unevenly.*mtraining.ring='flat'"):
        hierarchical_topology(8, 4, [[0, 1, 2, 4], [3, 5, 6, 7]])
    assert hierarchical_topology(8, 4, [[0, 1, 4, 5], [2, 3, 6, 7]]) == Topology(2, 4)
