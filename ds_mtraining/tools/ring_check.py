"""Checks the ring on the ranks a launcher started: the inner/outer groups built from the
launcher's topology, and the hierarchical ring's outputs and gradients against the flat ring's
and against one-device sparse attention on the whole sequence.

    deepspeed --hostfile HOSTFILE --module ds_mtraining.tools.ring_check --out DIR
    # two fake nodes on one machine, one command per node (N = 0, 1):
    deepspeed --hostfile H --include node0:0@node1:1 --no_ssh --node_rank N \\
        --master_addr 127.0.0.1 --master_port P --module ds_mtraining.tools.ring_check --out DIR

On GPUs q/k/v are bfloat16 (the CUDA kernels take bf16/fp16) and the tolerance is a relative
error (max |a - b| / max |b| per tensor) of 1e-2; on CPU (gloo) they are float32 and the
tolerance is 1e-4, since only the order of merges and accumulations differs. Every rank computes
the one-device reference on its own device. Each rank writes DIR/rank<R>.json and prints one
line; the exit status is 0 when every rank is within tolerance.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..attention import sparse_attention
from ..config import SparseConfig
from ..distributed import shutdown
from ..distributed.topology import Topology, create_hierarchical_groups
from ..index import SparseIndex
from ..layout import StripedLayout
from ..record import provenance, write_json
from ..reference import outputs_and_grads
from ..ring import ring_sparse_attention

# max |a - b| / max |b| of out, dq, dk, dv
TOLERANCE = {torch.float32: 1e-4,   # fp32 kernels: only the order of merges and accumulations differs
             torch.bfloat16: 1e-2}  # bf16 inputs and outputs (fp32 accumulation inside)
HEAD_DIM = {"cpu": 32, "cuda": 64}  # a head_dim the CUDA kernels take (ops.CUDA_HEAD_DIMS)


def relative_error(got, want) -> float:
    """max |got - want| / max |want| over a tensor, in float64 (0-safe)."""
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def check_inputs(world: int, block: int, blocks_per_rank: int, head_dim: int, device, dtype):
    """Global q, k, v, dout [1, S, H, D] and a random index for S = world x blocks_per_rank x block."""
    seq_len = world * blocks_per_rank * block
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, seq_len, h, head_dim, generator=g) for h in (4, 2, 2, 4)]
    nb = seq_len // block
    index = SparseIndex.from_blocks(torch.randint(-1, nb, (1, 4, 4), generator=g),
                                    torch.randint(-1, seq_len, (1, 4, 6), generator=g), seq_len, block)
    return [t.to(device=device, dtype=dtype) for t in tensors], index.to(device)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the per-rank JSON reports")
    parser.add_argument("--hostfile", default=None, help="read nodes x slots from it instead of the env")
    parser.add_argument("--blocks-per-rank", type=int, default=8, help="sequence blocks (of 64 tokens) per rank")
    parser.add_argument("--local_rank", type=int, default=None, help="(set by the launcher)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    tolerance = TOLERANCE[dtype]

    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = Topology.from_env(world, args.hostfile)
    hierarchy = create_hierarchical_groups(topology, [list(range(world))])

    config = SparseConfig(block_size=64)
    tensors, index = check_inputs(world, config.block_size, args.blocks_per_rank, HEAD_DIM[device.type],
                                  device, dtype)
    layout = StripedLayout(world, config.block_size)
    shards = [layout.shard(t, rank) for t in tensors]
    flat = outputs_and_grads(lambda q, k, v: ring_sparse_attention(q, k, v, config, index=index), *shards)
    hier = outputs_and_grads(lambda q, k, v: ring_sparse_attention(q, k, v, config, index=index,
                                                                   hierarchy=hierarchy), *shards)
    # the one-device reference on the whole sequence, this rank's shard of it
    single = [layout.shard(t, rank) for t in
              outputs_and_grads(lambda q, k, v: sparse_attention(q, k, v, index), *tensors)]
    names = ("out", "dq", "dk", "dv")
    vs_flat = {n: relative_error(a, b) for n, a, b in zip(names, hier, flat)}
    vs_single = {n: relative_error(a, b) for n, a, b in zip(names, hier, single)}
    flat_vs_single = {n: relative_error(a, b) for n, a, b in zip(names, flat, single)}
    error = max(vs_flat.values())
    error_single = max(max(vs_single.values()), max(flat_vs_single.values()))
    report = dict(rank=rank, world=world, **provenance(), nodes=topology.nodes, per_node=topology.per_node,
                  position=hierarchy.position, inner=dist.get_process_group_ranks(hierarchy.inner),
                  outer=dist.get_process_group_ranks(hierarchy.outer), device=str(device),
                  gpu=torch.cuda.get_device_name(device) if cuda else None,
                  cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), dtype=str(dtype),
                  seq_len=tensors[0].shape[1], tolerance=tolerance,
                  max_rel_error_vs_flat=error, max_rel_error_vs_one_device=error_single,
                  rel_error_hierarchical_vs_flat=vs_flat, rel_error_hierarchical_vs_one_device=vs_single,
                  rel_error_flat_vs_one_device=flat_vs_single,
                  bit_identical_to_flat=all(torch.equal(a, b) for a, b in zip(hier, flat)),
                  ok=error <= tolerance and error_single <= tolerance)
    write_json(Path(args.out, f"rank{rank}.json"), report)
    print(f"rank {rank}: {topology.nodes}x{topology.per_node} inner={report['inner']} "
          f"outer={report['outer']} {device.type} {str(dtype).removeprefix('torch.')}: hierarchical vs flat "
          f"rel. error {error:.1e}{' (bit-identical)' if report['bit_identical_to_flat'] else ''}, "
          f"vs one device {error_single:.1e} (tolerance {tolerance:.0e}): "
          f"{'ok' if report['ok'] else 'FAILED'}", flush=True)
    dist.barrier()
    shutdown()
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
