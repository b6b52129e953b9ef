"""What the one-kernel backward's dQ reduction would cost (docs/CUDA_NOTES.md, "What would go
further"): the reduction traffic alone, on the documents case's real step list.

A one-kernel backward adds each step's dQ partial (64 queries x D fp32, 32 KB at D = 128) into
a float32 dQ from the dK/dV slash pass, whose CTAs walk (kv head, key block) x (query head of
the group, slash offset) in the kernel's order. This probe replays that walk with no arithmetic:
the kernel benchmark's index and documents at 128K, every slash step that the documents leave
(causal-empty and wholly masked steps skipped, as the kernels skip them), and times four ways of
adding a 64 x D tile of ones per step into dQ [H][S][D] fp32:

* ``red_v4``: every thread adds 64 values with 16 ``red.global.add.v4.f32``, each instruction
  covering 2 KB contiguous (better coalescing than registers could give: the wgmma accumulator
  holds column pairs of scattered rows);
* ``bulk``: the tile staged in shared memory, one ``cp.reduce.async.bulk`` (add.f32) per step;
* ``bulk_128_keys``: as ``bulk``, with CTAs of 128 keys (one reduction per query step of a
  128-key block, FlashAttention-3's shape), half the traffic;
* ``bulk_128_keys_in_l2``: as ``bulk_128_keys`` with every step's rows taken modulo 2048 (a
  16 MB dQ that stays in L2): what the reductions cost when they hit L2, the ceiling of any
  reordering of the walk;
* ``store_v4``: plain 16-byte stores instead of reductions (the write bandwidth, for scale).

Then checks dQ against the step count per row (every way must add exactly its steps) and prints
milliseconds and TB/s, to set beside the dQ kernel's time (``bench.kernel --kernel-split``) that
fusing would remove:

    python3 benchmarks/probes/dq_reduction_probe.py [--density 0.05] [--out OUT.json]
"""
import argparse

import torch
from torch.utils.cpp_extension import load_inline

from ds_mtraining.bench import time_ms
from ds_mtraining.bench.kernel import benchmark_doc_start, benchmark_index
from ds_mtraining.index import PAD
from ds_mtraining.record import result_record, write_json

SEQ, DOCUMENTS, HEADS, KV_HEADS, DIM, BLOCK, TILE = 131072, (4096, 32768), 16, 2, 128, 128, 64
L2_ROWS = 2048  # bulk_128_keys_in_l2: dQ rows modulo this, 16 MB at H = 16, D = 128

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

constexpr int kTile = 64, kDim = 128, kThreads = 128;

// One CTA per slash-pass CTA: its steps are (head, first query row) pairs, steps[first[c]..first[c + 1]).
template <int kMode>  // 0: red.v4, 1: bulk reduce from shared memory, 2: st.v4
__global__ void __launch_bounds__(kThreads) replay(const int* first, const int2* steps, float* dq, int seq) {
    extern __shared__ __align__(128) float tile[];
    const int t = threadIdx.x;
    if constexpr (kMode == 1) {
        for (int i = t; i < kTile * kDim; i += kThreads) tile[i] = 1.f;
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    }
    for (int s = first[blockIdx.x]; s < first[blockIdx.x + 1]; ++s) {
        const int2 step = steps[s];
        float* rows = dq + (static_cast<size_t>(step.x) * seq + step.y) * kDim;
        if constexpr (kMode == 1) {
            if (t == 0) {  // the source tile never changes, so no wait between steps
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                             :: "l"(rows), "r"(static_cast<unsigned>(__cvta_generic_to_shared(tile))),
                                "r"(kTile * kDim * 4) : "memory");
                asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            }
        } else {
            float* mine = rows + 4 * t;  // chunk c: 16 bytes per thread, the CTA's 2 KB contiguous
#pragma unroll
            for (int c = 0; c < 16; ++c) {
                float* cell = mine + 4 * kThreads * c;
                if constexpr (kMode == 0)
                    asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};\n" :: "l"(cell), "f"(1.f) : "memory");
                else
                    asm volatile("st.global.v4.f32 [%0], {%1, %1, %1, %1};\n" :: "l"(cell), "f"(1.f) : "memory");
            }
        }
    }
    if constexpr (kMode == 1)
        if (t == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

void run(torch::Tensor first, torch::Tensor steps, torch::Tensor dq, int64_t mode) {
    const int ctas = first.numel() - 1, seq = dq.size(1);
    auto stream = at::cuda::getCurrentCUDAStream();
    const int* f = first.data_ptr<int>();
    const int2* s = reinterpret_cast<const int2*>(steps.data_ptr<int>());
    float* d = dq.data_ptr<float>();
    const int smem = kTile * kDim * 4;
    if (mode == 0) replay<0><<<ctas, kThreads, 0, stream>>>(f, s, d, seq);
    if (mode == 1) {
        cudaFuncSetAttribute(replay<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        replay<1><<<ctas, kThreads, smem, stream>>>(f, s, d, seq);
    }
    if (mode == 2) replay<2><<<ctas, kThreads, 0, stream>>>(f, s, d, seq);
    TORCH_CHECK(cudaGetLastError() == cudaSuccess, "launch failed");
}
"""
CPP_SOURCE = "void run(torch::Tensor first, torch::Tensor steps, torch::Tensor dq, int64_t mode);"
MODES = {"red_v4": 0, "bulk": 1, "store_v4": 2}


def slash_steps(slash, doc_start, keys_per_cta):
    """The slash pass's walk as CSR: per CTA (kv head, key block of keys_per_cta), in launch
    order, its (query head, first query row) steps of TILE queries, in the kernel's order (heads
    of the group, then ascending offsets). A step is dropped when it is causal-empty (its queries
    all before the CTA's first key) or wholly masked by the documents (its first query's document
    starts after the CTA's last key); with 128-key CTAs a step covers both key halves."""
    heads_per_group = HEADS // KV_HEADS
    blocks = SEQ // BLOCK
    first_query_doc = doc_start[0, ::TILE].tolist()  # doc start of each TILE-query step's first row
    offsets = [[o for o in slash[0, h].tolist() if o != PAD] for h in range(HEADS)]
    first, steps = [0], []
    for group in range(KV_HEADS):
        for key_first in range(0, SEQ, keys_per_cta):
            key_last = key_first + keys_per_cta - 1
            key_block = key_first // BLOCK
            for head in range(group * heads_per_group, (group + 1) * heads_per_group):
                for o in offsets[head]:
                    block = key_block + o
                    if block >= blocks:
                        break
                    for row in range(block * BLOCK, (block + 1) * BLOCK, TILE):
                        if row + TILE - 1 < key_first or first_query_doc[row // TILE] > key_last:
                            continue
                        steps.append((head, row))
            first.append(len(steps))
    return torch.tensor(first, dtype=torch.int32), torch.tensor(steps, dtype=torch.int32).reshape(-1, 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    module = load_inline("dq_reduction_probe", CPP_SOURCE, cuda_sources=CUDA_SOURCE, functions=["run"],
                         extra_cuda_cflags=["-arch=sm_90a", "-O3"])
    doc_start = benchmark_doc_start(SEQ, *DOCUMENTS)
    index = benchmark_index(1, HEADS, SEQ, BLOCK, args.density, torch.unique(doc_start).tolist())
    dq = torch.zeros(HEADS, SEQ, DIM, device="cuda")
    cases = {"red_v4": (TILE, "red_v4", None), "bulk": (TILE, "bulk", None), "bulk_128_keys": (BLOCK, "bulk", None),
             "bulk_128_keys_in_l2": (BLOCK, "bulk", L2_ROWS), "store_v4": (TILE, "store_v4", None)}
    result = result_record("dq_reduction", vars(args), [], density=index.density(), seq=SEQ, heads=HEADS, dim=DIM,
                           cases={})
    walks = {keys: slash_steps(index.slash, doc_start, keys) for keys in {keys for keys, _, _ in cases.values()}}
    for name, (keys_per_cta, mode, rows) in cases.items():
        first, steps = (t.clone() for t in walks[keys_per_cta])
        if rows:
            steps[:, 1] %= rows
        first, steps = first.cuda(), steps.cuda()
        count = torch.zeros(HEADS, SEQ // TILE, dtype=torch.float32)
        count.index_put_((steps[:, 0].long().cpu(), (steps[:, 1] // TILE).long().cpu()),
                         torch.ones(len(steps)), accumulate=True)
        dq.zero_()
        module.run(first, steps, dq, MODES[mode])
        torch.cuda.synchronize()
        if mode != "store_v4":  # every row of a step's tile got exactly one add per step
            expected = count.repeat_interleave(TILE, dim=1)[..., None].cuda()
            assert torch.equal(dq, expected.expand_as(dq)), f"{name}: dQ does not hold one add per step"
        ms = time_ms(lambda: module.run(first, steps, dq, MODES[mode]), repeats=10)
        gigabytes = len(steps) * TILE * DIM * 4 / 1e9
        result["cases"][name] = dict(ctas=len(first) - 1, steps=len(steps), gigabytes=gigabytes, ms=ms,
                                     tb_per_s=gigabytes / ms)
        result["rows"].append({"case": name, **result["cases"][name]})
        print(f"{name:14s} {len(first) - 1:6d} CTAs {len(steps):8d} steps {gigabytes:6.1f} GB {ms:7.2f} ms "
              f"{gigabytes / ms:5.2f} TB/s", flush=True)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
