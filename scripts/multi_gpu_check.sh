#!/usr/bin/env bash
# Multi-GPU checks and the ring scaling benchmark in one run (2, 4 or 8 GPUs of one host, NCCL):
# build the CUDA op, then each check under `timeout`, in this order:
#   check_<N>x<P>   ds_mtraining.tools.ring_check as N fake nodes x P GPUs, for each shape of
#                   NODE_SHAPES (hostfile node0..node<N-1>, --include node0:0,..@node1:P,.., one
#                   --no_ssh launcher per node): hierarchical vs flat vs one GPU, bf16 rel. error <= 1e-2
#   ring_vs_1gpu    striped ring (NCCL) vs one GPU, bf16 rel. error <= 1e-2 (tests/test_multi_gpu.py)
#   scaling_<N>x<P> python -m ds_mtraining.bench.scaling as those fake nodes (flat + hierarchical ring)
#   estimation      distributed estimation == single-device estimation
#   sync_free       no host sync in an attention call (one GPU, and the ring on two)
#   drop_in         the Ulysses drop-in ds_mtraining.layer.DistributedAttention vs one GPU
#   train_2ranks    deepspeed --num_gpus 2 --module ds_mtraining.train, 2 steps, sequence_parallel_size 2
#   scaling_flat    the benchmark under deepspeed --num_gpus GPUS (flat ring, given index only)
#   check_1node     ds_mtraining.tools.ring_check under deepspeed --num_gpus 2
# (the tests/test_multi_gpu.py stages use two of the GPUs). NODE_SHAPES defaults by GPU count:
# 2 -> "2x1", 4 -> "2x2", 8 -> "2x4 4x2". A stage that no longer fits in BUDGET_S (default 560 s,
# under a 600 s limit) is skipped. $OUT (default ./multi_gpu_out) gets multi_gpu.log (every
# stage's output), the benchmark's multi_gpu_<gpu>x<W>.json and multi_gpu_summary.txt (the
# PASS/FAIL table, printed last).
#
#   GPU run:     bash scripts/multi_gpu_check.sh        (scripts/gpu_check.sh calls it on 2+ GPUs)
#   SCALING_ARGS="--seq-lens 131072 262144" / SKIP_SCALING=1 / SKIP_BUILD=1 (op built already)
#   ONLY="check_2x1 scaling_2x1": run only these stages (and the build)
#   GPUS=4: use the first 4 GPUs (default: all visible); NODE_SHAPES="4x1": other fake-node shapes
#   ALLOW_CPU=1 [GPUS=4]: a dry run on a machine without GPUs (gloo, --smoke benchmark; GPU tests skip)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/multi_gpu_out}
mkdir -p "$OUT"
LOG=$OUT/multi_gpu.log
WORK=$(mktemp -d /tmp/multi_gpu.XXXXXX)
BUDGET_S=${BUDGET_S:-560}
source scripts/device_env.sh

visible=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ -n "${ALLOW_CPU:-}" ]; then  # a dry run of this script's stages on CPU (gloo; GPU tests skip)
  ranks=${GPUS:-2} SKIP_BUILD=1 SCALING_ARGS="--smoke ${SCALING_ARGS:-}" LIMIT_SCALE=${LIMIT_SCALE:-3}
  export OMP_NUM_THREADS=1
elif [ "${visible:-0}" -lt 2 ]; then
  echo "multi_gpu_check: $visible CUDA device(s) visible, two needed: nothing run" | tee "$OUT/multi_gpu_summary.txt"
  exit 0
else
  ranks=${GPUS:-$visible}
  if [ "$ranks" -gt "$visible" ] || [ "$ranks" -lt 2 ]; then
    echo "multi_gpu_check: GPUS=$ranks, but $visible GPU(s) are visible (2 or more needed)" \
      | tee "$OUT/multi_gpu_summary.txt"
    exit 1
  fi
fi
case $ranks in
  2) default_shapes="2x1" ;;
  4) default_shapes="2x2" ;;
  8) default_shapes="2x4 4x2" ;;
  *) default_shapes="" ;;
esac
NODE_SHAPES=${NODE_SHAPES:-$default_shapes}
for shape in $NODE_SHAPES; do
  if ! [[ $shape =~ ^[0-9]+x[0-9]+$ ]] || [ $(( ${shape%x*} * ${shape#*x} )) -ne "$ranks" ]; then
    echo "multi_gpu_check: NODE_SHAPES entry '$shape' is not NODESxGPUS_PER_NODE with $ranks GPUs in all" \
      | tee "$OUT/multi_gpu_summary.txt"
    exit 1
  fi
done

summary=()
failed=0
# stage NAME LIMIT_S COMMAND...: runs COMMAND under `timeout` (cut to what is left of BUDGET_S),
# appending to $LOG, and records PASS / FAIL:<code> / TIMEOUT / SKIP with the seconds taken.
stage() {
  local name=$1 limit=$2; shift 2
  stage_wanted "$name" || return 0
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
    for log in "$WORK"/node*.log; do
      echo "--- $(basename "$log" .log) (after exit code $code)"; cat "$log"
    done >>"$LOG" 2>&1
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
fake_nodes() {  # fake_nodes NxP MODULE ARGS...: N fake nodes x P GPUs, one `deepspeed --no_ssh` per node
  local shape=$1; shift
  local nodes=${shape%x*} per_node=${shape#*x} port hostfile=$WORK/hostfile pids=() code=0 include="" node
  port=$(python3 -c "from ds_mtraining.distributed import free_port; print(free_port())")
  : >"$hostfile"
  for ((node = 0; node < nodes; node++)); do  # node n: GPUs n*P .. n*P+P-1 of this machine
    echo "node$node slots=$((nodes * per_node))" >>"$hostfile"
    include+="${include:+@}node$node:$(seq -s, $((node * per_node)) $((node * per_node + per_node - 1)))"
  done
  for ((node = 0; node < nodes; node++)); do  # each under its own timeout, so that its log survives
    timeout -k 5 $((STAGE_LIMIT - 10)) python3 -m deepspeed.launcher.runner --hostfile "$hostfile" \
      --include "$include" --no_ssh --node_rank $node --master_addr 127.0.0.1 --master_port "$port" \
      --module "$@" >"$WORK/node$node.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
  for ((node = 0; node < nodes; node++)); do echo "--- node $node"; cat "$WORK/node$node.log"; done
  return $code
}
one_node() {  # one_node MODULE ARGS...: deepspeed --num_gpus GPUS
  local port
  port=$(python3 -c "from ds_mtraining.distributed import free_port; print(free_port())")
  python3 -m deepspeed.launcher.runner --num_gpus "$ranks" --master_port "$port" --module "$@"
}
export -f pytest_case fake_nodes one_node
export WORK ranks

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

for shape in $NODE_SHAPES; do
  stage "check_$shape" 120 bash -c "fake_nodes $shape ds_mtraining.tools.ring_check --out '$WORK/check_$shape'"
  for json in "$WORK/check_$shape"/rank*.json; do  # each report on one line of the log
    [ -f "$json" ] && python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$json"
  done >>"$LOG"
  grep -h "^rank .*tolerance" "$WORK"/node*.log 2>/dev/null
done
stage ring_vs_1gpu    90 bash -c 'pytest_case test_striped_ring_matches_one_gpu 80'
for shape in $NODE_SHAPES; do
  # shellcheck disable=SC2086
  [ -z "${SKIP_SCALING:-}" ] &&
    stage "scaling_$shape" 200 bash -c "fake_nodes $shape ds_mtraining.bench.scaling --out '$OUT' ${SCALING_ARGS:-}"
done
stage estimation      60 bash -c 'pytest_case test_distributed_estimation_equals_single_device 50'
stage sync_free      120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_sync_free.py
stage drop_in         60 bash -c 'pytest_case test_drop_in_distributed_attention_matches_one_gpu 50'
stage train_2ranks   150 bash -c 'pytest_case test_two_rank_training_step 140'
# shellcheck disable=SC2086
[ -z "${SKIP_SCALING:-}" ] &&
  stage scaling_flat   120 bash -c "one_node ds_mtraining.bench.scaling --out '$OUT' --modes given_index ${SCALING_ARGS:-}"
stage check_1node     80 bash -c 'pytest_case test_ring_check_one_node_two_gpus 70'

{ echo "=== multi_gpu_check summary ($(date -u +%FT%TZ), $ranks ranks, ${SECONDS}s) ==="
  printf '%s\n' "${summary[@]}"
  for json in "$OUT"/multi_gpu_*x"$ranks".json; do
    [ -f "$json" ] && python3 - "$json" <<'PY'
import json, sys
record = json.load(open(sys.argv[1]))
print(f"scaling ({record['device']}): efficiency = T_1gpu / (W x T_ring)")
for c in record["rows"]:
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
