"""One forward+backward of FlexAttention and of our kernels on the kernel benchmark's mask (default
256K, 5%, H=16, HKV=2, D=128, bf16; ``--documents MIN MAX``: the benchmark's packed documents,
both sides masked by them), profiled between cudaProfilerStart/Stop after a warm-up, so that ncu
sees each kernel once (docs/CUDA_NOTES.md, "ncu: FlexAttention against ours"):

    ncu --clock-control none --profile-from-start off -k regex:"flex_attention|query_kernel|key_kernel" \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --print-details all python3 benchmarks/probes/ncu_flex_case.py \\
        [--seq 131072 --density 0.1 --documents 4096 32768]
"""
import argparse

import torch

from ds_mtraining.bench.kernel import fwd_bwd_pair


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=262144)
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--documents", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    args = parser.parse_args()
    sides, described = fwd_bwd_pair(args.seq, args.density, args.documents)
    print(described)

    def run():
        sides["flex"]()
        sides["ours"]()

    run()  # compiles flex and loads our op
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
