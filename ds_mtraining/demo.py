"""Estimate a vertical-slash pattern on RoPE'd synthetic q/k and run sparse attention, with a summary.

    python -m ds_mtraining.demo [--seq-len 8192] [--heads 8] [--kv-heads 2] [--head-dim 64]
"""
from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from . import SparseConfig, estimate_vertical_slash, sparse_attention_with_lse, synthetic
from .reference import dense_attention_with_lse, mask_between


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--p", type=float, default=0.9, help="top-p for vertical and slash")
    parser.add_argument("--check-rows", type=int, default=256,
                        help="last rows checked against float64 dense attention")
    args = parser.parse_args(argv)
    console = Console()
    s, hkv = args.seq_len, args.kv_heads
    offsets = [(kv + 1) * s // (2 * hkv + 1) for kv in range(hkv)]
    columns = [(0, 17 + kv, s // 3 + kv) for kv in range(hkv)]
    q, k = synthetic.planted_qk(s, args.heads, hkv, args.head_dim, offsets, columns)
    v = torch.randn(1, s, hkv, args.head_dim)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    config = SparseConfig(block_size=args.block_size, p_vertical=args.p, p_slash=args.p)

    with console.status("estimating the pattern ..."):
        start = time.perf_counter()
        index = estimate_vertical_slash(q, k, config)
        estimate_s = time.perf_counter() - start
    with console.status("sparse attention forward + backward (compiles the CPU op on first use) ..."):
        out, lse = sparse_attention_with_lse(q, k, v, index)  # warm-up / JIT build
        start = time.perf_counter()
        out, lse = sparse_attention_with_lse(q, k, v, index)
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        out.square().sum().backward()
        backward_s = time.perf_counter() - start

    rows = slice(s - args.check_rows, s)
    mask = mask_between(index, torch.arange(s)[rows], torch.arange(s))
    ref, _ = dense_attention_with_lse(q[:, rows].detach(), k.detach(), v.detach(), mask)
    error = float((out[:, rows].detach().double() - ref).norm() / ref.norm())

    table = Table(title=f"vertical-slash sparse attention, S={s}, H={args.heads}/{hkv}, D={args.head_dim}")
    for col in ("head", "planted slash", "vertical", "slash blocks", "density"):
        table.add_column(col, justify="right")
    density = index.head_density()[0]
    group = args.heads // hkv
    for h in range(args.heads):
        table.add_row(str(h), str(offsets[h // group]), str(int(index.vertical_count[0, h])),
                      str(int(index.slash_count[0, h])), f"{float(density[h]):.2%}")
    console.print(table)
    console.print(f"estimate {estimate_s * 1e3:.0f} ms, forward {forward_s * 1e3:.0f} ms, "
                  f"backward {backward_s * 1e3:.0f} ms, mean density {index.density():.2%}; "
                  f"last {args.check_rows} rows vs float64 dense masked attention: rel. error {error:.1e}")


if __name__ == "__main__":
    main()
