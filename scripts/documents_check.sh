#!/usr/bin/env bash
# Document masking on GPUs in one run (two GPUs; on one GPU the two-GPU stage and
# the second training lane are skipped): build the CUDA op, then each stage under `timeout`:
#   cuda_tests     tests/test_cuda_*.py: both kernels against float64 dense attention, with and
#                  without documents (a document shorter than a block, boundaries in stripes)
#   two_gpu        tests/test_multi_gpu.py -k documents: flat and hierarchical (2 x 1) ring with
#                  documents vs one GPU, bf16 rel. error <= 6e-3
#   kernel         python -m ds_mtraining.bench.kernel --documents 4096 32768 at 128K: the same
#                  index without / with documents, and FlexAttention with the combined mask
#   training       python -m ds_mtraining.bench.documents_training: ds_configs/documents_32k.json
#                  with and without document masking, one GPU each, same seed and data
# $OUT (default ./documents_out) gets documents_check.log (every stage's output), the benchmarks'
# JSON/PNG and summary.txt (printed last).
#
#   GPU run (offline wheels in .whl/):  bash scripts/documents_check.sh
#   STEPS (300): training steps; KERNEL_ARGS (--seq-lens 131072 --densities 0.05 0.1);
#   ONLY="kernel training": run only these stages (and the build)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/documents_out}
mkdir -p "$OUT"
LOG=$OUT/documents_check.log
source scripts/device_env.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
[ "$gpus" -ge 1 ] || { echo "documents_check: no CUDA device visible" | tee "$OUT/summary.txt"; exit 1; }
device=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower())")

summary=()
stage() {  # stage NAME LIMIT_S COMMAND...: runs under timeout, appends to $LOG, records the outcome
  local name=$1 limit=$2; shift 2
  stage_wanted "$name" || return 0
  local start=$SECONDS
  echo "=== $name ($(date -u +%T), limit ${limit}s): $*" >>"$LOG"
  timeout -k 15 "$limit" "$@" >>"$LOG" 2>&1
  local code=$?
  summary+=("$(printf '%-11s %-8s %4ss' "$name" "$([ $code -eq 0 ] && echo PASS || echo FAIL:$code)" $((SECONDS - start)))")
  return $code
}
finish() {
  { echo "=== documents_check ($(date -u +%FT%TZ), $gpus GPU(s)) ==="; printf '%s\n' "${summary[@]}"; } | tee "$OUT/summary.txt"
}

stage build 300 python3 -c "from ds_mtraining import ops; ops.op_module('cuda')" || { tail -30 "$LOG"; finish; exit 1; }
timeouts=()
python3 -c "import pytest_timeout" 2>/dev/null && timeouts=(--timeout 120 -o timeout_method=thread)
stage cuda_tests 200 python3 -m pytest $(ls tests/test_cuda_*.py | grep -v compile) -q -rA --tb=short \
  -p no:cacheprovider "${timeouts[@]}"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOG" | tail -8
if [ "$gpus" -ge 2 ]; then
  stage two_gpu 150 python3 -m pytest tests/test_multi_gpu.py -k documents -q -rA -s --tb=short -p no:cacheprovider
  lanes=(cuda:0 cuda:1)
else
  summary+=("two_gpu     SKIP        (one GPU)")
  lanes=(cuda:0)
fi
stage kernel 180 env CUDA_VISIBLE_DEVICES=0 python3 -m ds_mtraining.bench.kernel --skip-dense --documents 4096 32768 \
  ${KERNEL_ARGS:---seq-lens 131072 --densities 0.05 0.1} --out "$OUT/kernel_documents_$device.json"
stage training 240 python3 -m ds_mtraining.bench.documents_training --config ds_configs/documents_32k.json \
  --steps "${STEPS:-300}" --lanes "${lanes[@]}" --log_interval 5 --out "$(mktemp -d)/runs" \
  --results "$OUT" --tag "32k_$device"
grep -A20 "sparse attention, H=" "$LOG" | tail -12
finish
