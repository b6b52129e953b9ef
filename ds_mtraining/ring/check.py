"""Checks the hierarchical ring on the ranks a launcher started: the inner/outer groups built
from the launcher's topology, and hierarchical vs flat ring outputs and gradients.

    deepspeed --hostfile HOSTFILE -m ds_mtraining.ring.check --out DIR
    # two fake nodes on one machine: the same with --no_ssh --node_rank 0 (and 1) --master_addr 127.0.0.1

Each rank writes DIR/rank<R>.json and prints one line; the exit status is 0 when they agree.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import SparseConfig
from ..index import SparseIndex
from ..reference import outputs_and_grads
from .layout import StripedLayout
from .ring_attention import ring_sparse_attention
from .topology import Topology, create_hierarchical_groups

TOLERANCE = 1e-4  # fp32 kernels; only the order of merges and accumulations differs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the per-rank JSON reports")
    parser.add_argument("--hostfile", default=None, help="read nodes x slots from it instead of the env")
    parser.add_argument("--local_rank", type=int, default=None, help="(set by the launcher)")
    args = parser.parse_args(argv)

    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = Topology.from_env(world, args.hostfile)
    hierarchy = create_hierarchical_groups(topology, [list(range(world))])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None

    config = SparseConfig(block_size=64)
    seq_len = world * 2 * config.block_size
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, seq_len, h, 32, generator=g) for h in (4, 2, 2, 4)]
    nb = seq_len // config.block_size
    index = SparseIndex.from_blocks(torch.randint(-1, nb, (1, 4, 4), generator=g),
                                    torch.randint(-1, seq_len, (1, 4, 6), generator=g), seq_len, 64)
    if device is not None:
        tensors, index = [t.to(device) for t in tensors], index.to(device)
    layout = StripedLayout(world, config.block_size)
    shards = [layout.shard(t, rank) for t in tensors]
    flat = outputs_and_grads(lambda q, k, v: ring_sparse_attention(q, k, v, config, index=index), *shards)
    hier = outputs_and_grads(lambda q, k, v: ring_sparse_attention(q, k, v, config, index=index,
                                                                   hierarchy=hierarchy), *shards)
    error = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(hier, flat))
    report = dict(rank=rank, world=world, nodes=topology.nodes, per_node=topology.per_node,
                  position=hierarchy.position, inner=dist.get_process_group_ranks(hierarchy.inner),
                  outer=dist.get_process_group_ranks(hierarchy.outer), max_rel_error_vs_flat=error,
                  ok=error <= TOLERANCE)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    print(f"rank {rank}: {topology.nodes}x{topology.per_node} inner={report['inner']} "
          f"outer={report['outer']} hierarchical vs flat rel. error {error:.1e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
