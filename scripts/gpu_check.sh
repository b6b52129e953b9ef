#!/usr/bin/env bash
# One device call: build the CUDA op through the op builder, run the GPU tests, compute-sanitizer
# (memcheck + racecheck) on a small case, then the kernel benchmark. Logs and JSON go to $OUT
# (default ./gpu_check_out); a short summary table is printed last.
#
#   device run, carry .whl:  bash scripts/gpu_check.sh
#   BENCH_ARGS="--seq-lens 131072" bash scripts/gpu_check.sh      # a shorter benchmark
#   SKIP_TESTS=1 / SKIP_SANITIZER=1 / SKIP_BENCH=1                  # leave a stage out
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext} MAX_JOBS=${MAX_JOBS:-16}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || { echo "wheel install failed"; exit 1; }
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
summary=()
stage() {  # stage NAME TIMEOUT_S LOG COMMAND...: runs, records status and seconds
  local name=$1 limit=$2 log=$3; shift 3
  local start=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  local code=$?
  summary+=("$(printf '%-10s %-6s %4ss  %s' "$name" "$([ $code -eq 0 ] && echo ok || echo FAIL:$code)" $((SECONDS - start)) "$(basename "$log")")")
  return $code
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"

stage build 400 "$OUT/build.log" python3 -c "
import time; t = time.time()
from ds_mtraining import ops
ops.op_module('cuda')
print(f'built and loaded in {time.time() - t:.1f} s')
" || { printf '%s\n' "${summary[@]}"; tail -40 "$OUT/build.log"; exit 1; }

if [ -z "${SKIP_TESTS:-}" ]; then
  per_test_limit=()  # a hung kernel fails its test instead of the whole call
  python3 -c "import pytest_timeout" 2>/dev/null && per_test_limit=(--timeout 150 -o timeout_method=thread)
  stage tests 300 "$OUT/tests.log" python3 -m pytest tests/test_cuda_attention.py -v --tb=short -p no:cacheprovider "${per_test_limit[@]}"
  tail -25 "$OUT/tests.log"
fi

if [ -z "${SKIP_SANITIZER:-}" ]; then
  cat >/tmp/sanitizer_case.py <<'EOF'
# A small case for compute-sanitizer: every kernel (index, forward, delta, vertical and slash
# dK/dV, dQ) for block 64 and 128, a partial last block, GQA, and two striped calls.
import torch
from ds_mtraining import ops
from ds_mtraining.index import SparseIndex, Stripe
g = torch.Generator().manual_seed(0)
for block, seq, dim in ((64, 300, 64), (128, 512, 128)):
    q, dout = (torch.randn(1, seq, 4, dim, generator=g).cuda().bfloat16() for _ in range(2))
    k, v = (torch.randn(1, seq, 2, dim, generator=g).cuda().bfloat16() for _ in range(2))
    blocks = -(-seq // block)
    index = SparseIndex.from_blocks(torch.randint(1, blocks, (1, 4, 2), generator=g),
                                    torch.randint(0, seq, (1, 4, 70), generator=g), seq, block).to("cuda")
    out, lse = ops.attention_forward(q, k, v, index, 0.1)
    ops.attention_backward(dout, q, k, v, out, lse, index, 0.1)
    if seq % (2 * block) == 0:
        half = seq // 2
        for r, s in ((0, 1), (1, 0)):
            stripe = Stripe(2, r, s)
            out, lse = ops.attention_forward(q[:, :half], k[:, :half], v[:, :half], index, 0.1, stripe)
            ops.attention_backward(dout[:, :half], q[:, :half], k[:, :half], v[:, :half], out, lse, index, 0.1, stripe)
torch.cuda.synchronize()
print("sanitizer case done")
EOF
  for tool in memcheck racecheck; do
    stage "$tool" 240 "$OUT/sanitizer_$tool.log" compute-sanitizer --tool "$tool" python3 /tmp/sanitizer_case.py
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitizer case done" "$OUT/sanitizer_$tool.log" | tail -3
  done
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  # shellcheck disable=SC2086
  stage bench 420 "$OUT/bench.log" python3 -m ds_mtraining.bench.kernel --out "$OUT/kernel_h200.json" ${BENCH_ARGS:-}
  tail -30 "$OUT/bench.log"
fi

echo "=== gpu_check summary ($(date -u +%FT%TZ)) ==="
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
