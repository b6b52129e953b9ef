"""CPU kernel benchmark: the C++/OpenMP sparse attention op against torch's dense causal SDPA.

For each sequence length, head configuration and head dim, builds a vertical-slash index with
``SparseIndex.from_vertical_slash`` (sink columns plus random key columns, local plus random token
diagonals; the diagonal count is bisected to the target density), then times on the same fp32
inputs, median of ``--repeats`` runs after one warm-up run, forward and forward+backward of

* ``mtraining``: ``ds_mtraining.sparse_attention`` (the CPU op, via autograd);
* ``dense``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``.

Effective GFLOP/s = computed entries (``index.num_entries()``) x 4 x D per forward, x 3.5 for
forward+backward; dense counts its causal entries S (S + 1) / 2 the same way, so the ratio of
GFLOP/s is the per-FLOP efficiency of the sparse kernel relative to torch's dense path. Prints a
table and writes JSON (date, CPU model, command, torch version, threads).

    python -m ds_mtraining.bench.cpu_kernel [--seq-lens 4096 8192] [--threads N]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..record import result_record, write_json
from . import fresh_output_dir, index_for_density, params_of, wall_time_ms

FWD_BWD_FLOP_FACTOR = 3.5
SINK_TOKENS = 64
LOCAL_DIAGONALS = 128  # token diagonals 0..127: the local window


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"


def build_index(heads: int, seq: int, block: int, n_columns: int, n_diagonals: int, seed: int):
    """Index from token lists: sinks + random columns; local window + random token diagonals."""
    from ds_mtraining.index import SparseIndex
    generator = torch.Generator().manual_seed(seed)
    columns = torch.randint(SINK_TOKENS, seq, (1, heads, n_columns), generator=generator)
    vertical = torch.cat([torch.arange(SINK_TOKENS).expand(1, heads, SINK_TOKENS), columns], -1)
    far = torch.randint(LOCAL_DIAGONALS, seq, (1, heads, n_diagonals), generator=generator)
    slash = torch.cat([torch.arange(LOCAL_DIAGONALS).expand(1, heads, LOCAL_DIAGONALS), far], -1)
    return SparseIndex.from_vertical_slash(vertical, slash, seq, block)


def measure(seq, heads, kv_heads, dim, block, target, repeats):
    """Timings of one configuration: (dense row, sparse row)."""
    from ds_mtraining.attention import resolve_softmax_scale, sparse_attention
    generator = torch.Generator().manual_seed(seq * 1000 + heads * 10 + dim)
    q, k, v, dout = (torch.randn(1, seq, h, dim, generator=generator)
                     for h in (heads, kv_heads, kv_heads, heads))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    scale = resolve_softmax_scale(dim)
    shape = dict(seq_len=seq, heads=heads, kv_heads=kv_heads, head_dim=dim, block_size=block)

    qt, kt, vt, dt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v, dout))

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                                                enable_gqa=True)

    dense_fwd = wall_time_ms(lambda: dense().detach(), repeats)
    dense_fwd_bwd = wall_time_ms(lambda: torch.autograd.grad(dense(), (qt, kt, vt), dt), repeats)
    causal_flops = 4.0 * heads * dim * seq * (seq + 1) / 2
    dense_row = dict(impl="dense", **shape, density=1.0, fwd_ms=dense_fwd, fwd_bwd_ms=dense_fwd_bwd,
                     fwd_gflops=causal_flops / dense_fwd / 1e6,
                     fwd_bwd_gflops=FWD_BWD_FLOP_FACTOR * causal_flops / dense_fwd_bwd / 1e6)

    index = index_for_density(lambda n: build_index(heads, seq, block, seq // 64, n, seq + heads),
                              seq // block, target)
    flops = 4.0 * dim * float(index.num_entries().sum())
    sparse_fwd = wall_time_ms(lambda: sparse_attention(q, k, v, index, scale).detach(), repeats)
    sparse_fwd_bwd = wall_time_ms(
        lambda: torch.autograd.grad(sparse_attention(q, k, v, index, scale), (q, k, v), dout), repeats)
    sparse_row = dict(impl="mtraining", **shape, density=index.density(), target_density=target,
                      fwd_ms=sparse_fwd, fwd_bwd_ms=sparse_fwd_bwd,
                      fwd_gflops=flops / sparse_fwd / 1e6,
                      fwd_bwd_gflops=FWD_BWD_FLOP_FACTOR * flops / sparse_fwd_bwd / 1e6)
    # per-FLOP efficiency relative to dense, and wall-clock speedup over dense
    sparse_row["gflops_ratio_vs_dense_fwd"] = sparse_row["fwd_gflops"] / dense_row["fwd_gflops"]
    sparse_row["gflops_ratio_vs_dense_fwd_bwd"] = sparse_row["fwd_bwd_gflops"] / dense_row["fwd_bwd_gflops"]
    sparse_row["speedup_vs_dense_fwd"] = dense_fwd / sparse_fwd
    sparse_row["speedup_vs_dense_fwd_bwd"] = dense_fwd_bwd / sparse_fwd_bwd
    return dense_row, sparse_row


def run(args):
    from rich.console import Console
    from rich.table import Table

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    result = result_record("cpu_kernel", params_of(args), rows, device=cpu_model(), threads=threads,
                           torch=torch.__version__, dtype="fp32", repeats=args.repeats,
                           flop_convention="effective = computed entries x 4 x D per forward, x3.5 for fwd+bwd")
    for seq in args.seq_lens:
        for heads, kv_heads in args.head_configs:
            for dim in args.head_dims:
                for row in measure(seq, heads, kv_heads, dim, args.block_size, args.density, args.repeats):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                write_json(args.out, result)  # a cut-off run keeps its rows

    table = Table(title=f"CPU sparse attention vs dense SDPA, fp32, {threads} threads, {result['device']}")
    for column in ("S", "H/Hkv", "D", "impl", "density", "fwd ms", "fwd GF/s", "fwd+bwd ms", "fwd+bwd GF/s",
                   "GF/s vs dense", "time vs dense"):
        table.add_column(column, justify="right")
    for r in rows:
        sparse = r["impl"] == "mtraining"
        table.add_row(str(r["seq_len"]), f"{r['heads']}/{r['kv_heads']}", str(r["head_dim"]), r["impl"],
                      f"{r['density']:.3f}", f"{r['fwd_ms']:.1f}", f"{r['fwd_gflops']:.1f}",
                      f"{r['fwd_bwd_ms']:.1f}", f"{r['fwd_bwd_gflops']:.1f}",
                      f"{r['gflops_ratio_vs_dense_fwd']:.2f} / {r['gflops_ratio_vs_dense_fwd_bwd']:.2f}"
                      if sparse else "",
                      f"{r['speedup_vs_dense_fwd']:.1f}x / {r['speedup_vs_dense_fwd_bwd']:.1f}x" if sparse else "")
    Console(width=160).print(table)
    return result


def head_config(text: str) -> tuple[int, int]:
    """'8/2' -> (8, 2): query heads / kv heads."""
    heads, _, kv_heads = text.partition("/")
    try:
        pair = int(heads), int(kv_heads)
    except ValueError:
        raise argparse.ArgumentTypeError(f"head config {text!r} must read H/HKV, e.g. 8/2") from None
    if pair[1] <= 0 or pair[0] % pair[1]:
        raise argparse.ArgumentTypeError(f"head config {text!r}: H must be a positive multiple of HKV")
    return pair


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="CPU sparse attention op vs dense causal SDPA (fp32)",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--head-configs", type=head_config, nargs="+", default=[(4, 1), (8, 2)],
                        help="query heads / kv heads pairs, e.g. 4/1 8/2")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.08, help="target fraction of the causal entries")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--out", default="bench_results/cpu_kernel-<time>/cpu_kernel.json",
                        help="JSON file; by default in a new directory")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.out == build_parser().get_default("out"):
        args.out = str(fresh_output_dir("cpu_kernel") / "cpu_kernel.json")
    run(args)


if __name__ == "__main__":
    main()
