// Which kernels a call runs, chosen in code from the device's architecture (and, in launch.cuh,
// the index's block size), as FlashAttention's hopper/ heuristics do. Plain C++: the binding reads
// the device and the environment, this file only decides.
//  * compute capability 9.x: wgmma tensor-core MMAs (the sm_90a kernels), with TMA copying the
//    contiguous key/value tiles, and at block 128 the warp-specialised query-side kernels
//    (specialized_query_kernel.cuh: a producer warpgroup loads, two consumer warpgroups compute);
//  * 8.x: mma.sync, cp.async copies, one warpgroup-sized CTA per query block (query_kernel.cuh);
//  * everywhere: the backward's dQ kernel on a second stream, beside the dK/dV kernels.
// Results are the same on every path (bit for bit between the query kernels and the dQ orders).
#pragma once

#include <string>

namespace mtr {

struct KernelPaths {
    bool warpgroup_mma;
    bool tma;
    bool concurrent_dq;
    std::string query;  // "specialized" or "plain" (block 64 always takes plain)
};

// Test and debug overrides of that choice (docs/DESIGN.md, "Environment variables"), so that the
// tests can run every path on one GPU and compare them: DS_MTRAINING_CUDA_MMA=warp (mma.sync on
// Hopper, what Ampere runs), DS_MTRAINING_CUDA_TMA=0 (cp.async for every tile on the wgmma path),
// DS_MTRAINING_CUDA_CONCURRENT_DQ=0 (dQ after dK/dV on the current stream),
// DS_MTRAINING_CUDA_QUERY=plain (the one-warpgroup query kernels on Hopper). Unset, they change
// nothing.
struct KernelOverrides {
    bool warp_mma;
    bool no_tma;
    bool serial_dq;
    bool plain_query;
};

// The paths of a device of compute capability `major`, after the overrides.
inline KernelPaths choose_kernel_paths(int major, const KernelOverrides& overrides) {
    const bool hopper = major == 9;
    KernelPaths paths{hopper, hopper, true, hopper ? "specialized" : "plain"};
    if (overrides.warp_mma) paths = {false, false, paths.concurrent_dq, "plain"};
    if (overrides.no_tma) paths.tma = false;
    if (overrides.serial_dq) paths.concurrent_dq = false;
    if (overrides.plain_query) paths.query = "plain";
    return paths;
}

}  // namespace mtr
