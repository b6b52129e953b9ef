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

``--against-scaling FILE`` sets the model against measured rings instead: for every case of a
``bench.scaling`` JSON, the model's fwd+bwd ring time from that run's own one-device kernel time
(each step 1/W^2 of it) and the K/V bytes of its shape, next to the measured ring time (fake nodes
on one machine share its links: give ``--inter-gbps`` as the intra-node rate there).

    python -m ds_mtraining.bench.comm [--kernel-json benchmarks/results/kernel_h200_2026-11-29.json]
    python -m ds_mtraining.bench.comm --against-scaling benchmarks/results/ring_scaling_h200x2_2026-11-30.json \
        --intra-gbps 300 --inter-gbps 300
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..record import result_record, write_json
from . import command_of, fresh_output_dir, params_of

# FlexAttention fwd+bwd at 128K on one H200 (DESIGN.md section 4), used when no kernel JSON is given.
FLEX_ANCHORS_128K_MS = {0.034: 46.6, 0.055: 54.9, 0.096: 72.5}
FWD_SHARE = 1 / 3.5  # forward = fwd+bwd / 3.5 under the FLOP convention
MODULE = "ds_mtraining.bench.comm"
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


def pass_bytes(seq_len: int, world: int, kv_heads: int, head_dim: int, batch: int = 1) -> dict:
    """Bytes one rank sends per ring step: K and V (bf16) forward; backward also the travelling
    dK and dV accumulators (fp32)."""
    kv_bytes = 2 * batch * (seq_len // world) * kv_heads * head_dim * 2
    return {"forward": kv_bytes, "backward": kv_bytes * 3}


def modelled_ring_ms(one_device_ms: float, seq_len: int, nodes: int, per_node: int, ring: str, kv_heads: int,
                     head_dim: int, intra_gbps: float, inter_gbps: float) -> dict:
    """The model's fwd+bwd time of one ring call per rank, from the one-device kernel time on the
    whole sequence (forward FWD_SHARE of it): per pass, W steps of max(compute, transfer)."""
    world = nodes * per_node
    sent = pass_bytes(seq_len, world, kv_heads, head_dim)
    total, bound = 0.0, []
    for name, share in (("forward", FWD_SHARE), ("backward", 1 - FWD_SHARE)):
        step_ms = one_device_ms * share / world ** 2
        flat, hier, intra, inter = ring_times(step_ms, sent[name], nodes, per_node, intra_gbps, inter_gbps)
        total += flat if ring == "flat" else hier
        bound.append("transfer" if max(intra, inter if nodes > 1 else 0.0) > step_ms else "compute")
    return {"ring_ms": total, "bound": bound[0] if bound[0] == bound[1] else f"fwd {bound[0]}, bwd {bound[1]}"}


def against_scaling(path: str, intra_gbps: float, inter_gbps: float) -> list[dict]:
    """Model vs measurement for every case of a ``bench.scaling`` JSON (its ``rows``; ``cases`` in
    files written before ``ds_mtraining.record``)."""
    record = json.loads(Path(path).read_text())
    shape, rows = record["shape"], []
    for case in record["rows"] if "rows" in record else record["cases"]:
        found = re.match(r"(\d+) nodes? x (\d+)", case["launch"])
        if found is None:
            raise SystemExit(f"{path}: launch {case['launch']!r} does not say 'N node(s) x P'")
        nodes, per_node = int(found[1]), int(found[2])
        times = case["times"]
        model = modelled_ring_ms(times["one_gpu_kernel_ms"], case["seq_len"], nodes, per_node, case["ring"],
                                 shape["kv_heads"], shape["head_dim"], intra_gbps, inter_gbps)
        rows.append(dict(seq_len=case["seq_len"], mode=case["mode"], ring=case["ring"], launch=case["launch"],
                         measured_ring_ms=times["ring_ms"], model_ring_ms=model["ring_ms"], bound=model["bound"],
                         model_over_measured=model["ring_ms"] / times["ring_ms"],
                         measured_comm_wait_ms=case.get("breakdown", {}).get("mean_ms", {}).get("comm_wait")))
    return rows


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
    parser.add_argument("--against-scaling", default=None, metavar="FILE",
                        help="a bench.scaling JSON: set the model against its measured rings")
    parser.add_argument("--out", default="bench_results/comm-<time>/comm_model.json",
                        help="JSON file; by default in a new directory")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.out == build_parser().get_default("out"):
        args.out = str(fresh_output_dir("comm") / "comm_model.json")

    if args.against_scaling:
        return main_against_scaling(args, argv)
    world = args.nodes * args.per_node
    bytes_per_pass = pass_bytes(args.seq_len, world, args.kv_heads, args.head_dim)
    times, source = kernel_times(args.kernel_json, args.ref_len)
    scale = (args.seq_len / args.ref_len) ** 2 / world ** 2

    rows = []
    for density, (fwd_ms, fwd_bwd_ms) in sorted(times.items()):
        for name, total_ms in (("forward", fwd_ms), ("backward", fwd_bwd_ms - fwd_ms)):
            step_ms = total_ms * scale
            flat, hier, intra, inter = ring_times(step_ms, bytes_per_pass[name], args.nodes,
                                                  args.per_node, args.intra_gbps, args.inter_gbps)
            rows.append(dict(density=density, direction=name, step_compute_ms=step_ms,
                             step_mb=bytes_per_pass[name] / 2**20,
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
    save(args, argv, console, "comm_model", rows, compute_source=source, paper_ms=PAPER_MS)


def main_against_scaling(args, argv):
    rows = against_scaling(args.against_scaling, args.intra_gbps, args.inter_gbps)
    table = Table(title=f"model vs measured ring fwd+bwd ({args.against_scaling}; intra {args.intra_gbps:g}, "
                        f"inter {args.inter_gbps:g} GB/s)")
    for col in ("S", "mode", "ring", "launch", "measured ms", "model ms", "model/measured", "bound",
                "measured comm wait ms"):
        table.add_column(col, justify="right")
    for r in rows:
        wait = r["measured_comm_wait_ms"]
        table.add_row(f"{r['seq_len'] // 1024}K", r["mode"], r["ring"], r["launch"], f"{r['measured_ring_ms']:.2f}",
                      f"{r['model_ring_ms']:.2f}", f"{r['model_over_measured']:.3f}", r["bound"],
                      "-" if wait is None else f"{wait:.3f}")
    console = Console(width=max(Console().width, 120))
    console.print(table)
    return save(args, argv, console, "comm_vs_ring", rows)


def save(args, argv, console, name: str, rows: list, **fields) -> dict:
    """``args.out``: the result record (:func:`ds_mtraining.record.result_record`) of ``rows``, with
    ``fields``."""
    result = result_record(name, params_of(args), rows, command=command_of(MODULE, argv), **fields)
    write_json(args.out, result)
    console.print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
