"""Cost model of flat vs hierarchical sparse ring attention (after the paper's Appendix C).

Per ring step a rank computes its share of the attention while the K/V of the next step move.
With W = N x G ranks over N nodes:

* flat ring: W steps; every step has N ranks sending across nodes, so a step lasts
  ``max(compute, inter-node transfer)``;
* hierarchical ring: N outer steps, each a whole inner ring of G steps
  (``max(compute, intra-node transfer)`` each) with the outer (inter-node) transfer of the next
  node's K/V hidden behind it: ``max(G * inner step, inter-node transfer)``.

Compute per step = the measured kernel time at ``--ref-len`` scaled by the entries a step holds
(striping makes every step ~1/W^2 of the total). Writes JSON and prints a table.

    python -m ds_mtraining.bench.comm [--kernel-json benchmarks/results/kernel_h200.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import fresh_output_dir

# FlexAttention fwd+bwd at 128K on one H200 (DESIGN.md section 4), used when no kernel JSON is given.
FLEX_ANCHORS_128K_MS = {0.034: 46.6, 0.055: 54.9, 0.096: 72.5}
FWD_SHARE = 1 / 3.5  # forward = fwd+bwd / 3.5 under the FLOP convention
PAPER_MS = {"flat": 34.10, "hierarchical": 19.53}


def ring_times(step_compute_ms, step_bytes, nodes, per_node, intra_gbps, inter_gbps):
    """(flat_ms, hierarchical_ms) of one attention pass."""
    intra_ms = step_bytes / (intra_gbps * 1e9) * 1e3
    inter_ms = step_bytes / (inter_gbps * 1e9) * 1e3
    world = nodes * per_node
    flat = world * max(step_compute_ms, inter_ms if nodes > 1 else intra_ms)
    inner_ring = per_node * max(step_compute_ms, intra_ms if per_node > 1 else 0.0)
    hierarchical = nodes * max(inner_ring, inter_ms if nodes > 1 else 0.0)
    return flat, hierarchical, intra_ms, inter_ms


def kernel_times(path: str | None, ref_len: int) -> tuple[dict, str]:
    """{density: (fwd ms, fwd+bwd ms)} at ``ref_len`` from a kernel benchmark JSON, else Flex anchors."""
    if path:
        data = json.loads(Path(path).read_text())
        rows = [r for r in data["rows"] if r["seq_len"] == ref_len and r["impl"] == "mtraining"]
        if not rows:
            raise SystemExit(f"{path} has no 'mtraining' rows at seq_len={ref_len}")
        return {r["density"]: (r["fwd_ms"], r["fwd_bwd_ms"]) for r in rows}, f"measured ({path})"
    return ({d: (ms * FWD_SHARE, ms) for d, ms in FLEX_ANCHORS_128K_MS.items()},
            "FlexAttention anchors at 128K, DESIGN.md section 4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="flat vs hierarchical ring cost model",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=512 * 1024)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intra-gbps", type=float, default=300.0, help="NVLink GB/s per GPU")
    parser.add_argument("--inter-gbps", type=float, default=25.0, help="InfiniBand HDR GB/s per GPU")
    parser.add_argument("--kernel-json", default=None)
    parser.add_argument("--ref-len", type=int, default=128 * 1024)
    parser.add_argument("--out", default="bench_results/comm-<time>/comm_model.json",
                        help="JSON file; by default in a new directory")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.out == build_parser().get_default("out"):
        args.out = str(fresh_output_dir("comm") / "comm_model.json")

    world = args.nodes * args.per_node
    shard = args.seq_len // world
    kv_bytes = 2 * shard * args.kv_heads * args.head_dim * 2  # K and V in bf16
    # backward moves K, V (bf16) and the travelling dK, dV (fp32)
    bytes_per_pass = {"forward": kv_bytes, "backward": kv_bytes * 3}
    times, source = kernel_times(args.kernel_json, args.ref_len)
    scale = (args.seq_len / args.ref_len) ** 2 / world ** 2

    rows = []
    for density, (fwd_ms, fwd_bwd_ms) in sorted(times.items()):
        for name, total_ms in (("forward", fwd_ms), ("backward", fwd_bwd_ms - fwd_ms)):
            step_ms = total_ms * scale
            flat, hier, intra, inter = ring_times(step_ms, bytes_per_pass[name], args.nodes,
                                                  args.per_node, args.intra_gbps, args.inter_gbps)
            rows.append(dict(density=density, direction=name, step_compute_ms=step_ms, step_mb=bytes_per_pass[name] / 2**20,
                             intra_ms=intra, inter_ms=inter, flat_ms=flat, hierarchical_ms=hier,
                             speedup=flat / hier))
    table = Table(title=f"attention per layer, {args.seq_len // 1024}K tokens on {args.nodes} x "
                        f"{args.per_node} GPUs ({source})")
    for col in ("density", "pass", "step compute ms", "step MB", "intra ms", "inter ms",
                "flat ms", "hier. ms", "flat/hier"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['density']:.1%}", r["direction"], f"{r['step_compute_ms']:.3f}", f"{r['step_mb']:.1f}",
                      f"{r['intra_ms']:.3f}", f"{r['inter_ms']:.3f}", f"{r['flat_ms']:.2f}",
                      f"{r['hierarchical_ms']:.2f}", f"{r['speedup']:.2f}x")
    console = Console(width=max(Console().width, 120))
    console.print(table)
    console.print(f"paper (A100s, forward): flat {PAPER_MS['flat']} ms, hierarchical {PAPER_MS['hierarchical']} ms")
    result = dict(date=datetime.date.today().isoformat(), command="python -m ds_mtraining.bench.comm " + " ".join(
        argv if argv is not None else sys.argv[1:]), compute_source=source, args=vars(args), rows=rows, paper_ms=PAPER_MS)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
