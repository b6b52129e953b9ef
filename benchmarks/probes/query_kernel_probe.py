"""Probe: the query-side kernels (DS_MTRAINING_CUDA_QUERY = plain, specialized; ping_pong was
compared too until it was removed) on the
kernel benchmark's 128K case with and without documents, in one process: whether each matches
plain bit for bit (out, dq, dk, dv), and the median forward and forward+backward ms of each,
beside FlexAttention with the combined mask (one H200).

    python3 benchmarks/probes/query_kernel_probe.py [--seq 131072] [--densities 0.05]
        [--documents 4096 32768] [--kernels plain specialized] [--out probe.json]
"""
import argparse
import json
import os

import torch

from ds_mtraining import ops
from ds_mtraining.attention import resolve_softmax_scale, sparse_attention
from ds_mtraining.bench import time_ms
from ds_mtraining.bench.kernel import FlexMask, benchmark_doc_start, benchmark_index
from ds_mtraining.record import result_record, write_json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--densities", type=float, nargs="+", default=[0.05])
    parser.add_argument("--documents", type=int, nargs=2, default=[4096, 32768])
    parser.add_argument("--kernels", nargs="+", default=["plain", "specialized"], choices=["plain", "specialized"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-flex", action="store_true")
    parser.add_argument("--out", default="query_kernel_probe.json")
    args = parser.parse_args()
    device, seq, heads, kv_heads, dim = "cuda", args.seq, 16, 2, 128
    module = ops.op_module("cuda")
    scale = resolve_softmax_scale(dim)
    generator = torch.Generator(device=device).manual_seed(seq)
    q, k, v, dout = (torch.randn(1, seq, h, dim, device=device, dtype=torch.bfloat16, generator=generator)
                     for h in (heads, kv_heads, kv_heads, heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    doc_start = benchmark_doc_start(seq, *args.documents).to(device)
    starts = torch.unique(doc_start).tolist()
    flex = None
    if not args.skip_flex:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for target in args.densities:
        index = benchmark_index(1, heads, seq, 128, target, starts).to(device)
        for documents in (None, doc_start):
            def forward():
                return sparse_attention(q, k, v, index, scale, doc_start=documents)

            def fwd_bwd():
                out = forward()
                return (out, *torch.autograd.grad(out, (q, k, v), dout))

            reference = None
            case = dict(density=index.density(), documents=documents is not None)
            for kernel in args.kernels:
                os.environ["DS_MTRAINING_CUDA_QUERY"] = kernel
                module.reload_kernel_options()
                assert dict(module.kernel_paths(torch.cuda.current_device()))["query"] == kernel
                results = fwd_bwd()
                torch.cuda.synchronize()
                if reference is None:
                    reference = results
                same = [bool(torch.equal(a, b)) for a, b in zip(results, reference)]
                worst = [float((a.float() - b.float()).abs().max()) for a, b in zip(results, reference)]
                row = dict(case, kernel=kernel, bit_identical=same, max_abs_diff=worst,
                           fwd_ms=time_ms(forward, repeats=args.repeats),
                           fwd_bwd_ms=time_ms(lambda: torch.autograd.grad(forward(), (q, k, v), dout),
                                              repeats=args.repeats))
                rows.append(row)
                print(json.dumps(row), flush=True)
            if flex is not None and documents is not None:
                block_mask, block_density = FlexMask(1, heads, seq, 128, device, doc_start).for_index(index)
                qf, kf, vf, df = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v, dout))

                def flex_forward():
                    return flex(qf, kf, vf, block_mask=block_mask, scale=scale, enable_gqa=True)

                row = dict(case, kernel="flex", block_density=block_density,
                           fwd_ms=time_ms(flex_forward, repeats=args.repeats),
                           fwd_bwd_ms=time_ms(lambda: torch.autograd.grad(flex_forward(), (qf, kf, vf), df),
                                              repeats=args.repeats))
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.environ.pop("DS_MTRAINING_CUDA_QUERY", None)
    write_json(args.out, result_record("query_kernel", vars(args), rows, seq=seq, documents=args.documents))


if __name__ == "__main__":
    main()
