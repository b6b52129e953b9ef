#!/usr/bin/env bash
# The longest sequence on one GPU (bench.capacity; docs/RESULTS.md, "Capacity on one H200"):
#   build     the ops a run JIT-compiles (ours for CUDA, DeepSpeed's CPU Adam and pin_memory),
#             and how pinned blocks get their size here (ds_mtraining.training.memory.exact_pinning)
#   capacity  python -m ds_mtraining.bench.capacity for the 3B shape at SEQ_LEN, WARMUP + STEPS steps,
#             5% density, the mtraining.memory defaults (or MEMORY, JSON): peaks against the plan's
#             predicted ones, tokens/s
# On a fresh machine the builds take as long as the CUDA op's (the host-side ops build beside it),
# the 3B start-up about two minutes and a 1M step two or more, so the run outlasts one device
# call: it runs in a process session of its own (setsid: it outlives the call while the machine
# is warm), each call waits for it until BUDGET_S, and the same command, called again at once,
# waits on it (or collects what it left):
#   run(command="bash scripts/capacity_check.sh", carry=[".whl"], needs_h200=true)   # until it prints the result
# $OUT (default ./capacity_out) gets capacity_check.log, the run's log (capacity.log), and once it
# has ended the result capacity_<TAG>.json and its PNG, its train.log and summary.txt (printed last);
# the launch's folders stay in SCRATCH.
#
#   SEQ_LEN (1048576), STEPS (3), WARMUP (1), TAG (h200), MEMORY (unset),
#   BUDGET_S (590: this call's seconds), RUN_S (1500: the run's limit, over calls)
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
OUT=${OUT:-$PWD/capacity_out}
SEQ_LEN=${SEQ_LEN:-1048576} STEPS=${STEPS:-3} WARMUP=${WARMUP:-1} TAG=${TAG:-h200}
SCRATCH=${SCRATCH:-${TMPDIR:-/tmp}/capacity_check_$SEQ_LEN}  # one run per length on a warm machine
mkdir -p "$OUT" "$SCRATCH"
LOG=$OUT/capacity_check.log
source scripts/device_env.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
[ "$gpus" -ge 1 ] || { echo "capacity_check: no CUDA device visible" | tee "$OUT/summary.txt"; exit 1; }

build() {  # the host-side ops build beside the CUDA op (the longest), each in its own process
  python3 -c "
import time
from deepspeed.ops.op_builder import CPUAdamBuilder, PinMemoryBuilder
t = time.time(); CPUAdamBuilder().load(); PinMemoryBuilder().load()
print(f'host ops (CPU Adam, pin_memory) built and loaded in {time.time() - t:.1f} s')" &
  local host=$!
  python3 -c "
import time, torch
from ds_mtraining import ops
from ds_mtraining.training.memory import exact_pinning
t = time.time(); ops.op_module('cuda')
print(f'CUDA op built and loaded in {time.time() - t:.1f} s; torch {torch.__version__}: {exact_pinning(True)[0]}')"
  local cuda=$?
  wait "$host" && [ "$cuda" -eq 0 ]
}
export -f build  # `stage` runs its command under timeout: a new bash

run_capacity() {  # the detached run: its exit status in $SCRATCH/capacity.status when it ends
  timeout "${RUN_S:-1500}" python3 -m ds_mtraining.bench.capacity --models qwen2.5-3b --modes mtraining \
    --density 0.05 --starting_len "$SEQ_LEN" --max_len "$SEQ_LEN" --steps "$STEPS" --warmup "$WARMUP" \
    --timeout $(( ${RUN_S:-1500} - 30 )) --out "$SCRATCH" --tag "$TAG" ${MEMORY:+--memory "$MEMORY"}
  echo $? > "$SCRATCH/capacity.status"
}
export -f run_capacity
export OUT SEQ_LEN STEPS WARMUP TAG SCRATCH ${MEMORY:+MEMORY}

wait_capacity() {  # wait_capacity SECONDS: starts the run unless a call before this one did, waits until it ends
  local until=$((SECONDS + $1))
  if [ ! -f "$SCRATCH/capacity.started" ]; then
    date -u +%FT%TZ > "$SCRATCH/capacity.started"
    setsid bash -c run_capacity >"$SCRATCH/capacity.log" 2>&1 < /dev/null &
  fi
  while [ ! -f "$SCRATCH/capacity.status" ] && [ $SECONDS -lt $until ]; do
    sleep 5
  done
  cp "$SCRATCH/capacity.log" "$OUT/" 2>/dev/null
  [ -f "$SCRATCH/capacity.status" ] || return 75
  cp "$SCRATCH/capacity_$TAG.json" "$SCRATCH/capacity_$TAG.png" "$OUT/" 2>/dev/null
  cp "$SCRATCH/capacity_$TAG/qwen2.5-3b_mtraining_w1_s$SEQ_LEN/train.log" "$OUT/" 2>/dev/null
  return "$(cat "$SCRATCH/capacity.status")"
}
export -f wait_capacity

stage build 300 "$LOG" bash -c build
if stage_wanted capacity; then
  stage capacity 600 "$LOG" bash -c "wait_capacity $(( ${BUDGET_S:-590} - (SECONDS - start) - 15 ))"
  [ -f "$SCRATCH/capacity.status" ] \
    || summary+=("the run (started $(cat "$SCRATCH/capacity.started")) goes on: call again at once (75: still running)")
fi
{ echo "=== capacity_check ($(date -u +%FT%TZ), SEQ_LEN $SEQ_LEN) ==="; printf '%s\n' "${summary[@]}"; } \
  | tee "$OUT/summary.txt"
tail -5 "$LOG"
