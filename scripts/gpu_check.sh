#!/usr/bin/env bash
# One GPU run: build the CUDA op through the op builder, run the GPU tests, compute-sanitizer
# (memcheck + racecheck) on a small case, the kernel benchmark, other kernel paths' benchmark at
# 128K (VARIANTS, default: mma.sync and wgmma without TMA; Hopper runs wgmma with TMA by default)
# and an ncu profile of each kernel at 128K. Logs and JSON go to $OUT (default
# ./gpu_check_out, at most 8 files); a short summary is printed last.
#
#   GPU run (offline wheels in .whl/):  bash scripts/gpu_check.sh
#   BENCH_ARGS="--seq-lens 131072" bash scripts/gpu_check.sh      # a shorter benchmark
#   VARIANTS="no_tma:DS_MTRAINING_CUDA_TMA=0" bash scripts/gpu_check.sh   # one other path only
#   SKIP_TESTS=1 / SKIP_SANITIZER=1 / SKIP_BENCH=1 / SKIP_VARIANT=1 / SKIP_PROFILE=1 / SKIP_NCU=1
#   SKIP_MULTI=1: not the two-GPU stage (scripts/multi_gpu_check.sh, run when two GPUs are visible)
#   DIAGNOSE_OSTREAM=1: toolchain, libstdc++ linkage and a number-formatting probe (diagnose.log)
# (each variant and the ncu stage add a file; the device tool returns 8, so trim VARIANTS or skip a stage)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
source scripts/device_env.sh
finish() {
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    echo "=== gpu_check summary ($(date -u +%FT%TZ)) ==="; printf '%s\n' "${summary[@]}"; } | tee "$OUT/summary.txt"
}

# The CPU op compiles alongside the CUDA op; its input-error path is checked below.
python3 -c "from ds_mtraining import ops; ops.op_module('cpu')" >"$OUT/diagnose.log" 2>&1 &
cpu_build=$!

if [ -n "${DIAGNOSE_OSTREAM:-}" ]; then
  # Does a minimal extension (plain C++, then linked like a CUDA one) survive a TORCH_CHECK that
  # streams an int64? Each probe runs in its own process, so a crash is a result.
  cat >/tmp/ostream_probe.py <<'PY'
import subprocess, sys
from torch.utils.cpp_extension import load_inline
SOURCE = '#include <torch/extension.h>\nvoid fail(int64_t n) { TORCH_CHECK_VALUE(false, "n=", n); }\n'
if len(sys.argv) == 2:  # one probe: build (cached) and call
    probe = load_inline(f"ostream_probe_{sys.argv[1]}", SOURCE, functions=["fail"],
                        with_cuda=sys.argv[1] == "cuda", extra_cflags=["-O3", "-g"])
    try:
        probe.fail(4)
    except ValueError as err:
        print(sys.argv[1], "probe: ValueError", str(err).splitlines()[0])
else:
    runs = {kind: subprocess.Popen([sys.executable, __file__, kind]) for kind in ("cpu", "cuda")}
    for kind, run in runs.items():
        print(kind, "probe exit code", run.wait())
PY
  python3 /tmp/ostream_probe.py >/tmp/ostream_probe.log 2>&1 &
  probes=$!
fi

stage build 400 "$OUT/build.log" python3 -c "
import time; t = time.time()
from ds_mtraining import ops
ops.op_module('cuda')
print(f'built and loaded in {time.time() - t:.1f} s')
" || { tail -40 "$OUT/build.log"; finish; exit 1; }

if [ -z "${SKIP_TESTS:-}" ]; then
  per_test_limit=()  # a hung kernel fails its test instead of the whole call
  python3 -c "import pytest_timeout" 2>/dev/null && per_test_limit=(--timeout 150 -o timeout_method=thread)
  stage tests 300 "$OUT/tests.log" python3 -m pytest $(ls tests/test_cuda_*.py | grep -v compile) -v --tb=short -p no:cacheprovider "${per_test_limit[@]}"
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -20
fi

# An input error whose message holds numbers must reach Python as ValueError from both ops
# (docs/CUDA_NOTES.md: such messages once segfaulted in the CUDA module); on a crash, take a
# native backtrace with cuda-gdb (the image has no gdb).
cat >/tmp/value_error.py <<'PY'
import torch
from ds_mtraining import ops
from ds_mtraining.index import SparseIndex
for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
    q = torch.randn(1, 128, 4, 64, device=device, dtype=dtype)
    kv = torch.randn(1, 128, 3, 64, device=device, dtype=dtype)
    index = SparseIndex.from_blocks(torch.zeros(1, 4, 1, dtype=torch.long), torch.zeros(1, 4, 1, dtype=torch.long),
                                    128, 64).to(device)
    try:
        ops.op_module(device).forward(q, kv, kv, ops.op_index(index), 0.125)
        print(f"{device} op: no error raised")
        raise SystemExit(1)
    except ValueError as err:
        print(f"{device} op: ValueError as expected:", str(err).splitlines()[0])
PY
wait "$cpu_build" || echo "CPU op build failed (see diagnose.log)"
stage valueerror 60 "$OUT/diagnose.log" python3 /tmp/value_error.py
if [ $? -gt 128 ]; then  # killed by a signal
  stage cuda-gdb 120 "$OUT/diagnose.log" cuda-gdb -batch -ex run -ex bt --args python3 /tmp/value_error.py
  tail -30 "$OUT/diagnose.log"
fi
grep -h "op: " "$OUT/diagnose.log"

if [ -n "${DIAGNOSE_OSTREAM:-}" ]; then
  # Where libstdc++'s number formatting comes from: the toolchain, what the CUDA op links and
  # defines, which libstdc++ the process maps, and the probes started above.
  diagnose() {
    local so=$TORCH_EXTENSIONS_DIR/mtraining_cuda/mtraining_cuda.so
    echo "CXX=${CXX:-} CC=${CC:-}"; "${CXX:-c++}" --version | head -1; nvcc --version | tail -1
    ls "$(dirname "$(dirname "$(command -v "${CXX:-c++}")")")"/lib*/libstdc++* 2>/dev/null
    grep -E "^(cflags|post_cflags|cuda_cflags|cuda_post_cflags|ldflags) =" "$TORCH_EXTENSIONS_DIR/mtraining_cuda/build.ninja"
    ldd "$so" | grep -E "stdc\+\+|gcc_s"
    echo "libstdc++ stream/locale code defined in the CUDA op:"
    nm -C "$so" | grep -E " [TtWw] std::(basic_ostream|locale|num_put|ios_base|__cxx11::basic_ostringstream)" | head -20
    python3 -c "
import torch
from ds_mtraining import ops
ops.op_module('cuda')
print('libstdc++ mapped:', *sorted({l.split()[-1] for l in open('/proc/self/maps') if 'stdc++' in l}))
try:
    torch.zeros(2, 3).view(7)
except RuntimeError as err:
    print('torch formats numbers:', str(err).splitlines()[0])"
    cat /tmp/ostream_probe.log
  }
  wait "$probes"
  export -f diagnose
  stage ostream 200 "$OUT/diagnose.log" bash -c diagnose
  sed -n '/=== ostream/,$p' "$OUT/diagnose.log" | head -60
fi

if [ -z "${SKIP_SANITIZER:-}" ]; then
  cat >/tmp/sanitizer_case.py <<'PY'
# A small case for compute-sanitizer: every kernel (index, forward, delta, vertical and slash
# dK/dV, dQ; both query-side kernels at block 128) for block 64 and 128, a partial last block,
# GQA, documents, two striped calls, on both tensor-core paths (wgmma by default on Hopper,
# mma.sync with the test/debug override DS_MTRAINING_CUDA_MMA=warp).
import os
import torch
from ds_mtraining import ops
from ds_mtraining.documents import doc_start_from_cu_seqlens
from ds_mtraining.index import SparseIndex, Stripe
g = torch.Generator().manual_seed(0)
for mma, block, seq, dim in ((m, *shape) for m in ("auto", "warp") for shape in ((64, 300, 64), (128, 512, 128))):
    os.environ["DS_MTRAINING_CUDA_MMA"] = mma
    os.environ.pop("DS_MTRAINING_CUDA_QUERY", None)
    ops.op_module("cuda").reload_kernel_options()  # read once otherwise
    q, dout = (torch.randn(1, seq, 4, dim, generator=g).cuda().bfloat16() for _ in range(2))
    k, v = (torch.randn(1, seq, 2, dim, generator=g).cuda().bfloat16() for _ in range(2))
    blocks = -(-seq // block)
    index = SparseIndex.from_blocks(torch.randint(1, blocks, (1, 4, 2), generator=g),
                                    torch.randint(0, seq, (1, 4, 70), generator=g), seq, block).to("cuda")
    out, lse = ops.attention_forward(q, k, v, index, 0.1)
    ops.attention_backward(dout, q, k, v, out, lse, index, 0.1)
    # document masking, on each query-side kernel (DS_MTRAINING_CUDA_QUERY; the last is the default)
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 5, 90, 200, seq]), seq).cuda()
    for query in ("plain", "specialized"):
        os.environ["DS_MTRAINING_CUDA_QUERY"] = query
        ops.op_module("cuda").reload_kernel_options()
        out, lse = ops.attention_forward(q, k, v, index, 0.1, doc_start=doc_start)
        ops.attention_backward(dout, q, k, v, out, lse, index, 0.1, doc_start=doc_start)
    if seq % (2 * block) == 0:
        half = seq // 2
        for r, s in ((0, 1), (1, 0)):
            stripe = Stripe(2, r, s)
            out, lse = ops.attention_forward(q[:, :half], k[:, :half], v[:, :half], index, 0.1, stripe)
            ops.attention_backward(dout[:, :half], q[:, :half], k[:, :half], v[:, :half], out, lse, index, 0.1, stripe)
torch.cuda.synchronize()
print("sanitizer case done")
PY
  for tool in memcheck racecheck; do
    stage "$tool" 240 "$OUT/sanitizer.log" compute-sanitizer --tool "$tool" --error-exitcode 1 python3 /tmp/sanitizer_case.py
  done
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitizer case done" "$OUT/sanitizer.log"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  # shellcheck disable=SC2086
  stage bench 420 "$OUT/bench.log" python3 -m ds_mtraining.bench.kernel --out "$OUT/kernel_h200.json" ${BENCH_ARGS:-}
  tail -27 "$OUT/bench.log"
  # the estimator (torch rule vs fused CUDA) next to sparse fwd+bwd with its index
  stage estimate 240 "$OUT/bench.log" python3 -m ds_mtraining.bench.estimate --out "$OUT"
  tail -12 "$OUT/bench.log"
fi

if [ -z "${SKIP_VARIANT:-}" ]; then
  # Other kernel paths at 128K, each NAME:ENV_ASSIGNMENT writing kernel_h200_NAME.json.
  for variant in ${VARIANTS:-mma_sync:DS_MTRAINING_CUDA_MMA=warp no_tma:DS_MTRAINING_CUDA_TMA=0}; do
    name=${variant%%:*}
    stage "$name" 120 "$OUT/bench.log" env "${variant#*:}" python3 -m ds_mtraining.bench.kernel \
      --seq-lens 131072 --skip-flex --skip-dense --repeats 5 --out "$OUT/kernel_h200_$name.json"
    tail -8 "$OUT/bench.log"
  done
fi

# One forward and one backward at 128K, 5% density (each kernel launches once): the case of the
# per-kernel time split (torch.profiler, into bench.log) and of the ncu stage.
cat >/tmp/case_128k.py <<'PY'
# One forward and one backward at 128K, 5% density (the kernel benchmark's mask): each kernel launches once.
import torch
from ds_mtraining import ops
from ds_mtraining.bench.kernel import benchmark_index
index = benchmark_index(1, 16, 131072, 128, 0.05).to("cuda")
q, dout = (torch.randn(1, 131072, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
k, v = (torch.randn(1, 131072, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
out, lse = ops.attention_forward(q, k, v, index, 0.088)
ops.attention_backward(dout, q, k, v, out, lse, index, 0.088)
torch.cuda.synchronize()
PY
if [ -z "${SKIP_PROFILE:-}" ]; then
  stage profile 120 "$OUT/bench.log" python3 -c "
import runpy, torch
from torch.profiler import profile, ProfilerActivity
runpy.run_path('/tmp/case_128k.py')  # warm-up (and JIT load)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    runpy.run_path('/tmp/case_128k.py')
print(prof.key_averages().table(sort_by='cuda_time_total', row_limit=8, max_name_column_width=90))"
  tail -14 "$OUT/bench.log"
fi

if [ -z "${SKIP_NCU:-}" ]; then
  stage ncu 200 "$OUT/ncu.txt" ncu --clock-control none -k regex:"query_kernel|key_kernel|delta_kernel" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --print-details all python3 /tmp/case_128k.py
  grep -E "query_kernel|key_kernel|Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|[Ss]tall" "$OUT/ncu.txt" | head -90
fi
# Two GPUs visible: the two-GPU checks and the ring scaling benchmark (scripts/multi_gpu_check.sh,
# its own PASS/FAIL table; 3 more files in $OUT). Alone it fits one 600 s call; SKIP_MULTI=1 skips it.
if [ -z "${SKIP_MULTI:-}" ] && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" -ge 2 ]; then
  stage multi_gpu 600 /dev/null env SKIP_BUILD=1 OUT="$OUT" BUDGET_S=590 bash scripts/multi_gpu_check.sh
  cat "$OUT/multi_gpu_summary.txt"
fi
finish
