"""One forward+backward of FlexAttention and of our kernels on the kernel benchmark's mask (default
256K, 5%, H=16, HKV=2, D=128, bf16; ``--documents MIN MAX``: the benchmark's packed documents,
both sides masked by them), profiled between cudaProfilerStart/Stop after a warm-up, so that ncu
sees each kernel once (docs/CUDA_NOTES.md, "ncu: FlexAttention against ours"):

    ncu --clock-control none --profile-from-start off -k regex:"flex_attention|query_kernel|key_kernel" \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --print-details all python3 scripts/ncu_flex_case.py \\
        [--seq 131072 --density 0.1 --documents 4096 32768]
"""
import argparse

import torch
from torch.nn.attention.flex_attention import flex_attention

from ds_mtraining.attention import resolve_softmax_scale, sparse_attention
from ds_mtraining.bench.kernel import FlexMask, benchmark_doc_start, benchmark_index

HEADS, KV_HEADS, DIM, BLOCK = 16, 2, 128, 128


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=262144)
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--documents", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    args = parser.parse_args()
    doc_start, starts = None, (0,)
    if args.documents:
        doc_start = benchmark_doc_start(args.seq, *args.documents).to("cuda")
        starts = torch.unique(doc_start).tolist()
    index = benchmark_index(1, HEADS, args.seq, BLOCK, args.density, starts).to("cuda")
    q, dout = (torch.randn(1, args.seq, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, args.seq, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    q.requires_grad_()
    scale = resolve_softmax_scale(DIM)
    block_mask, block_density = FlexMask(1, HEADS, args.seq, BLOCK, "cuda", doc_start).for_index(index)
    print(f"density: ours {index.density():.4f}, flex's blocks {block_density:.4f}"
          + (f"; {len(starts)} documents" if doc_start is not None else ""))
    flex = torch.compile(flex_attention, dynamic=False)
    qf, kf, vf, df = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v, dout))

    def run():
        torch.autograd.grad(flex(qf, kf, vf, block_mask=block_mask, scale=scale, enable_gqa=True), (qf, kf, vf), df)
        torch.autograd.grad(sparse_attention(q, k, v, index, scale, doc_start=doc_start), (q, k, v), dout)

    run()  # compiles flex and loads our op
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
