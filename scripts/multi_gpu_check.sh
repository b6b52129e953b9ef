#!/usr/bin/env bash
# Two-GPU checks and the ring scaling benchmark in one device call (kind nvidia-h200-x2, NCCL):
# build the CUDA op, then each check under `timeout`, in this order:
#   check_2nodes   ds_mtraining.ring.check as 2 fake nodes x 1 GPU (hostfile node0/node1 slots=2,
#                  --include node0:0@node1:1, one --no_ssh launcher per node): hierarchical vs flat
#                  vs one GPU, bf16 rel. error <= 1e-2
#   ring_vs_1gpu   striped ring (NCCL) vs one GPU, bf16 rel. error <= 1e-2 (tests/test_multi_gpu.py)
#   scaling_2nodes python -m ds_mtraining.bench.scaling as 2 fake nodes (flat + hierarchical ring)
#   estimation     distributed estimation == single-device estimation
#   sync_free      no host sync in an attention call (one GPU, and the ring on two)
#   drop_in        the Ulysses drop-in ds_mtraining.layer.DistributedAttention vs one GPU
#   train_2ranks   deepspeed --num_gpus 2 --module ds_mtraining.train, 2 steps, sequence_parallel_size 2
#   scaling_flat   the benchmark under deepspeed --num_gpus 2 (flat ring, given index only)
#   check_1node    ds_mtraining.ring.check under deepspeed --num_gpus 2
# A stage that no longer fits in BUDGET_S (default 560 s, for a 600 s device call) is skipped.
# $OUT (default ./multi_gpu_out) gets multi_gpu.log (every stage's output), the benchmark's
# multi_gpu_<gpu>x2.json and multi_gpu_summary.txt (the PASS/FAIL table, printed last).
#
#   device run:  bash scripts/multi_gpu_check.sh        (scripts/gpu_check.sh calls it on 2+ GPUs)
#   SCALING_ARGS="--seq-lens 131072 262144" / SKIP_SCALING=1 / SKIP_BUILD=1 (op built already)
#   ONLY="check_2nodes scaling_2nodes": run only these stages (and the build)
#   ALLOW_CPU=1: a dry run on a machine without GPUs (gloo, --smoke benchmark; the GPU tests skip)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/multi_gpu_out}
mkdir -p "$OUT"
LOG=$OUT/multi_gpu.log
WORK=$(mktemp -d /tmp/multi_gpu.XXXXXX)
BUDGET_S=${BUDGET_S:-560}
source scripts/device_env.sh

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ -n "${ALLOW_CPU:-}" ]; then  # a dry run of this script's stages on CPU (gloo; GPU tests skip)
  gpus=0 SKIP_BUILD=1 SCALING_ARGS="--smoke ${SCALING_ARGS:-}" LIMIT_SCALE=${LIMIT_SCALE:-3}
elif [ "${gpus:-0}" -lt 2 ]; then
  echo "multi_gpu_check: $gpus CUDA device(s) visible, two needed: nothing run" | tee "$OUT/multi_gpu_summary.txt"
  exit 0
fi

summary=()
failed=0
# stage NAME LIMIT_S COMMAND...: runs COMMAND under `timeout` (cut to what is left of BUDGET_S),
# appending to $LOG, and records PASS / FAIL:<code> / TIMEOUT / SKIP with the seconds taken.
stage() {
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [ "$name" != build ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  local left=$((BUDGET_S - SECONDS - 10))
  if [ "$left" -lt 30 ]; then
    summary+=("$(printf '%-15s %-8s %4s   %s' "$name" SKIP - "(no time left in BUDGET_S=$BUDGET_S)")")
    failed=1
    return 1
  fi
  limit=$((limit * ${LIMIT_SCALE:-1}))
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  echo "=== $name ($(date -u +%T), limit ${limit}s): $*" >>"$LOG"
  rm -f "$WORK"/node*.log
  STAGE_LIMIT=$limit timeout -k 15 "$limit" "$@" >>"$LOG" 2>&1
  local code=$?
  if [ $code -ne 0 ] && ls "$WORK"/node*.log >/dev/null 2>&1 && ! grep -q "^--- node 0" <(tail -c 200000 "$LOG"); then
    for node in 0 1; do echo "--- node $node (after exit code $code)"; cat "$WORK/node$node.log"; done >>"$LOG" 2>&1
  fi
  local status=PASS
  if [ $code -eq 124 ] || [ $code -eq 137 ]; then status=TIMEOUT; elif [ $code -ne 0 ]; then status=FAIL:$code; fi
  [ $code -ne 0 ] && failed=1
  summary+=("$(printf '%-15s %-8s %4ss' "$name" "$status" $((SECONDS - start)))")
  echo "=== $name: $status after $((SECONDS - start)) s" | tee -a "$LOG"
  return $code
}
pytest_case() {  # one test of tests/test_multi_gpu.py (pytest-timeout, where installed, as a second guard)
  local per_test=()
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$2" -o timeout_method=thread)
  python3 -m pytest "tests/test_multi_gpu.py::$1" -v -s --tb=short -p no:cacheprovider "${per_test[@]}"
}
two_nodes() {  # two_nodes MODULE ARGS...: 2 fake nodes x 1 GPU, one `deepspeed --no_ssh` per node
  local port hostfile=$WORK/hostfile pids=() code=0
  port=$(python3 -c "from ds_mtraining.distributed import free_port; print(free_port())")
  printf 'node0 slots=2\nnode1 slots=2\n' >"$hostfile"
  for node in 0 1; do  # each under its own timeout, inside the stage's, so that its log survives
    timeout -k 5 $((STAGE_LIMIT - 10)) python3 -m deepspeed.launcher.runner --hostfile "$hostfile" \
      --include node0:0@node1:1 --no_ssh --node_rank $node --master_addr 127.0.0.1 --master_port "$port" \
      --module "$@" >"$WORK/node$node.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
  for node in 0 1; do echo "--- node $node"; cat "$WORK/node$node.log"; done
  return $code
}
one_node() {  # one_node MODULE ARGS...: deepspeed --num_gpus 2
  local port
  port=$(python3 -c "from ds_mtraining.distributed import free_port; print(free_port())")
  python3 -m deepspeed.launcher.runner --num_gpus 2 --master_port "$port" --module "$@"
}
export -f pytest_case two_nodes one_node
export WORK

if command -v nvidia-smi >/dev/null; then
  { nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nvidia-smi topo -m; } >>"$LOG" 2>&1
fi
# the CPU op is loaded by the tests' conftest: build it while the CUDA op builds
python3 -c "from ds_mtraining import ops; ops.op_module('cpu')" >"$WORK/cpu_build.log" 2>&1 &
cpu_build=$!
if [ -z "${SKIP_BUILD:-}" ]; then
  stage build 300 python3 -c "
import time; t = time.time()
from ds_mtraining import ops
ops.op_module('cuda')
print(f'CUDA op built and loaded in {time.time() - t:.1f} s')" || {
    tail -40 "$LOG"; printf '%s\n' "${summary[@]}" | tee "$OUT/multi_gpu_summary.txt"; exit 1; }
fi
wait "$cpu_build" || { echo "CPU op build failed:"; tail -20 "$WORK/cpu_build.log"; } | tee -a "$LOG"

stage check_2nodes   120 bash -c 'two_nodes ds_mtraining.ring.check --out "$WORK/check_2nodes"'
for r in 0 1; do cat "$WORK/check_2nodes/rank$r.json" 2>/dev/null && echo; done >>"$LOG"
grep -h "^rank .*tolerance" "$WORK"/node*.log 2>/dev/null
stage ring_vs_1gpu    90 bash -c 'pytest_case test_striped_ring_matches_one_gpu 80'
# shellcheck disable=SC2086
[ -z "${SKIP_SCALING:-}" ] &&
  stage scaling_2nodes 200 bash -c "two_nodes ds_mtraining.bench.scaling --out '$OUT' ${SCALING_ARGS:-}"
stage estimation      60 bash -c 'pytest_case test_distributed_estimation_equals_single_device 50'
stage sync_free      120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_sync_free.py
stage drop_in         60 bash -c 'pytest_case test_drop_in_distributed_attention_matches_one_gpu 50'
stage train_2ranks   150 bash -c 'pytest_case test_two_rank_training_step 140'
# shellcheck disable=SC2086
[ -z "${SKIP_SCALING:-}" ] &&
  stage scaling_flat   120 bash -c "one_node ds_mtraining.bench.scaling --out '$OUT' --modes given_index ${SCALING_ARGS:-}"
stage check_1node     80 bash -c 'pytest_case test_ring_check_one_node_two_gpus 70'

{ echo "=== multi_gpu_check summary ($(date -u +%FT%TZ), $gpus GPUs, ${SECONDS}s) ==="
  printf '%s\n' "${summary[@]}"
  for json in "$OUT"/multi_gpu_*x2.json; do
    [ -f "$json" ] && python3 - "$json" <<'PY'
import json, sys
record = json.load(open(sys.argv[1]))
print(f"scaling ({record['device']}): efficiency = T_1gpu / (W x T_ring)")
for c in record["cases"]:
    m = c["imbalance"].get("measured", {})
    print(f"  {c['seq_len'] // 1024:>4}K {c['mode']:<26} {c['ring']:<12} {c['launch']:<22} "
          f"eff {c['efficiency']:.3f}  T1 {c['times']['one_gpu_ms']:8.2f} ms  ring {c['times']['ring_ms']:8.2f} ms  "
          f"worker imb {m.get('worker_level', float('nan')):.3f}")
PY
  done
  echo "overall: $([ $failed -eq 0 ] && echo PASS || echo FAIL)"
} | tee "$OUT/multi_gpu_summary.txt"
rm -rf "$WORK"
exit $failed
