#!/usr/bin/env bash
# The longest sequence on one GPU (bench.capacity; docs/RESULTS.md, "Capacity on one H200"):
#   build     the ops a run JIT-compiles (ours for CUDA and the CPU, DeepSpeed's CPU Adam and pin_memory),
#             and how pinned blocks get their size here (ds_mtraining.training.memory.exact_pinning)
#   capacity  python -m ds_mtraining.bench.capacity for the 3B shape at SEQ_LEN, STEPS steps (all
#             timed: WARMUP 0, as four 1M steps and the start-up outlast a call), 5% density, the
#             mtraining.memory defaults (or MEMORY, JSON): peaks against the plan's predicted ones, tokens/s
# A fresh machine spends about two minutes in the builds, and three 1M steps take about seven, more
# than one device call holds: two calls back to back (a warm machine keeps the builds in /tmp):
#   run(command="ONLY=build bash scripts/capacity_check.sh", carry=[".whl"], needs_h200=true)
#   run(command="ONLY=capacity bash scripts/capacity_check.sh", carry=[".whl"], needs_h200=true)
# $OUT (default ./capacity_out) gets capacity_check.log, the result capacity_<TAG>.json and its PNG,
# the run's train.log and summary.txt (printed last); the launches' folders stay in SCRATCH.
#
#   SEQ_LEN (1048576), STEPS (3), WARMUP (0), TAG (h200), MEMORY (unset), BUDGET_S (590: this call's seconds)
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
OUT=${OUT:-$PWD/capacity_out}
SCRATCH=${SCRATCH:-${TMPDIR:-/tmp}/capacity_check}
mkdir -p "$OUT" "$SCRATCH"
LOG=$OUT/capacity_check.log
SEQ_LEN=${SEQ_LEN:-1048576} STEPS=${STEPS:-3} WARMUP=${WARMUP:-0} TAG=${TAG:-h200}
source scripts/device_env.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
[ "$gpus" -ge 1 ] || { echo "capacity_check: no CUDA device visible" | tee "$OUT/summary.txt"; exit 1; }

build() {
  python3 -c "
import time, torch
from ds_mtraining import ops
from ds_mtraining.training.memory import exact_pinning
from deepspeed.ops.op_builder import CPUAdamBuilder, PinMemoryBuilder
t = time.time(); ops.op_module('cuda'); ops.op_module('cpu'); CPUAdamBuilder().load(); PinMemoryBuilder().load()
print(f'ops built and loaded in {time.time() - t:.1f} s; torch {torch.__version__}: {exact_pinning(True)[0]}')"
}
export -f build  # `stage` runs its command under timeout: a new bash

stage build 300 "$LOG" bash -c build
if stage_wanted capacity; then
  left=$(( ${BUDGET_S:-590} - (SECONDS - start) - 20 ))
  stage capacity "$left" "$LOG" python3 -m ds_mtraining.bench.capacity --models qwen2.5-3b --modes mtraining \
    --density 0.05 --starting_len "$SEQ_LEN" --max_len "$SEQ_LEN" --steps "$STEPS" --warmup "$WARMUP" --timeout $((left - 10)) \
    --out "$SCRATCH" --tag "$TAG" ${MEMORY:+--memory "$MEMORY"}
  cp "$SCRATCH/capacity_$TAG.json" "$SCRATCH/capacity_$TAG.png" "$OUT/" 2>/dev/null
  cp "$SCRATCH/capacity_$TAG/qwen2.5-3b_mtraining_w1_s$SEQ_LEN/train.log" "$OUT/" 2>/dev/null
fi
{ echo "=== capacity_check ($(date -u +%FT%TZ), SEQ_LEN $SEQ_LEN) ==="; printf '%s\n' "${summary[@]}"; } \
  | tee "$OUT/summary.txt"
tail -5 "$LOG"
