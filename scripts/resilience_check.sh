#!/usr/bin/env bash
# A run that lasts days, on one GPU (the CPU side is tests/test_faults.py): build the CUDA op, then
# each stage under `timeout`:
#   timeouts   tests/test_faults.py -k process_group: every process group of a run, the NCCL ones
#              included, times out stall_timeout_s + 60 s into a collective (and the gloo case)
#   reference  STEPS uninterrupted steps of the Qwen2.5-3B shape (LAYERS layers, 5% density) at
#              SEQ_LEN tokens through ds_mtraining.train, no checkpoint
#   preempt    the same run: SIGTERM to its rank while step 3 runs; it must exit 143 with that step
#              saved (the checkpoint named latest), and its line gives the save's seconds
#   resume     --resume of it to STEPS (no checkpoint): each step's loss against the reference's
#   heartbeat  tokens/s of that run with stall_timeout_s 600 (the default) and 0 (no heartbeat),
#              launched A B A B: the heartbeat's cost, within the noise between launches
# The signal goes to the rank alone, as a scheduler signals every process of a job: DeepSpeed's
# launch.py, signalled too, would kill the rank 30 s later, before a save of this size is done.
# The runs go to SCRATCH (default $TMPDIR/resilience_check, kept between calls: a later call reads
# the reference's losses there); preempt's checkpoint (~16 GB at 12 layers) is removed by the
# resume stage. $OUT (default ./resilience_out) gets resilience_check.log (every stage's output,
# appended), each run's loss and tokens/s CSVs, notes.txt, summary.txt (printed last) and resilience.json
# (ds_mtraining.bench.resilience: the result file, for benchmarks/results/).
#
#   GPU run (offline wheels in .whl/):  bash scripts/resilience_check.sh
#   SEQ_LEN (131072), LAYERS (12), STEPS (8); ONLY="preempt resume": only these stages (and the
#   build), e.g. one call each for "timeouts", "reference", "preempt resume", "heartbeat" where a
#   call may last 10 minutes (resume needs preempt's checkpoint; resume, the reference's losses)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/resilience_out}
mkdir -p "$OUT"
LOG=$OUT/resilience_check.log
SCRATCH=${SCRATCH:-${TMPDIR:-/tmp}/resilience_check}
mkdir -p "$SCRATCH"
SEQ_LEN=${SEQ_LEN:-131072} LAYERS=${LAYERS:-12} STEPS=${STEPS:-8}
source scripts/device_env.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
[ "$gpus" -ge 1 ] || { echo "resilience_check: no CUDA device visible" | tee "$OUT/summary.txt"; exit 1; }

run_stage() {  # run_stage NAME LIMIT_S LOG COMMAND...: `stage` (device_env.sh) unless ONLY leaves NAME out
  stage_wanted "${1%%_*}" || return 1  # heartbeat_600_a: a stage of heartbeat
  stage "$@"
}
finish() {
  { echo "=== resilience_check ($(date -u +%FT%TZ), $gpus GPU(s), seq_len $SEQ_LEN, $LAYERS layers)"
    printf '%s\n' "${summary[@]}"; cat "$OUT/notes.txt" 2>/dev/null; } | tee "$OUT/summary.txt"
  python3 -m ds_mtraining.bench.resilience "$OUT" --out "$OUT/resilience.json" \
    --check_command "${ONLY:+ONLY=\"$ONLY\" }bash scripts/resilience_check.sh"
}
note() { echo "$*" >>"$OUT/notes.txt"; }

# the runs' JSONs: bench.e2e's measurement of MTraining on one GPU, with the stall timeout given
python3 - "$SCRATCH" "$SEQ_LEN" "$LAYERS" <<'EOF' || { echo "resilience_check: cannot write the configs"; exit 1; }
import json, sys
from ds_mtraining.bench.e2e import launch_config
scratch, seq_len, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base = json.load(open("ds_configs/e2e_zero2_offload_bf16.json"))
for stall in (600, 0):
    config = launch_config(base, "qwen2.5-3b", "mtraining", seq_len, 1, layers, density=0.05)
    config["mtraining"]["stall_timeout_s"] = stall
    json.dump(config, open(f"{scratch}/stall{stall}.json", "w"))
EOF

# the functions below run under `timeout` in a bash of their own: exported, with what they read
export OUT SCRATCH STEPS
train() {  # train NAME CONFIG ARGS...: one launch on GPU 0, its metrics copied to $OUT/NAME
  local name=$1 config=$2; shift 2
  # (no deepspeed script where device_env.sh installs the wheels: the runner's module)
  python3 -m deepspeed.launcher.runner --num_gpus 1 --master_port $((29500 + RANDOM % 1000)) --module ds_mtraining.train \
    --deepspeed_config "$config" --steps "$STEPS" --save_dir "$SCRATCH/$name" "$@"
  local code=$?
  mkdir -p "$OUT/$name" && cp "$SCRATCH/$name"/metrics/mtraining/Train_mtraining_{loss,tokens_per_s}.csv "$OUT/$name/" 2>/dev/null
  return $code
}
preempt() {  # the run, SIGTERM to its rank once step 2 is logged (step 3 runs): exit 143, that step saved
  local run=$SCRATCH/preempt log=$OUT/preempt.log
  bash -c "train preempt $SCRATCH/stall600.json" >"$log" 2>&1 &
  local launcher=$!
  until grep -q "^step 2/$STEPS" "$log"; do
    kill -0 $launcher 2>/dev/null || { echo "the run ended before step 2"; tail -20 "$log"; return 1; }
    sleep 0.2
  done
  pkill -TERM -f "ds_mtraining.train --local_rank=0.*$run" && echo "SIGTERM to the rank: $(date -u +%T.%N)"
  wait $launcher
  local code=$?
  tail -5 "$log"
  local line
  line=$(grep "ds_mtraining.train: stopped by SIGTERM" "$log")
  note "preempt: exit $code; ${line#ds_mtraining.train: }"
  local step=${line#*after finishing step }
  step=${step%%:*}  # 3, unless step 3 ended before the signal was seen
  [ $code -eq 143 ] && [ "$(cat "$run/latest")" = "step$step" ] && [ "$step" -ge 3 ]
}
compare() {  # compare RUN: the run's losses against the reference's, step by step (SCRATCH: from any call)
  python3 - "$SCRATCH"/{reference,$1}/metrics/mtraining/Train_mtraining_loss.csv <<'EOF'
import csv, sys
rows = [{int(r[0]): float(r[1]) for r in csv.reader(open(p)) if r and r[0] != "step"} for p in sys.argv[1:]]
reference, run = rows
worst = max(abs(run[s] - reference[s]) / abs(reference[s]) for s in reference)
print(f"steps {sorted(run)} against {sorted(reference)}; largest relative difference {worst:.2e}")
sys.exit(0 if sorted(run) == sorted(reference) and worst < 1e-3 else 1)
EOF
}
tokens_per_s() {  # tokens_per_s RUN: the mean over the steps after the first two
  python3 -c "import csv, sys; v = [float(r[1]) for r in csv.reader(open(sys.argv[1])) if r and r[0] != 'step'][2:]; \
print(f'{sum(v) / len(v):.0f}')" "$SCRATCH/$1/metrics/mtraining/Train_mtraining_tokens_per_s.csv"
}

run_stage build 300 "$LOG" python3 -c "from ds_mtraining import ops; ops.op_module('cuda')" \
  || { tail -30 "$LOG"; finish; exit 1; }
run_stage timeouts 300 "$LOG" python3 -m pytest tests/test_faults.py -k process_group -q -rA --tb=short -p no:cacheprovider
export -f train preempt compare note
run_stage reference 600 "$LOG" bash -c "train reference $SCRATCH/stall600.json --no_checkpoint"
run_stage preempt 600 "$LOG" bash -c preempt
if run_stage resume 600 "$LOG" bash -c "train preempt $SCRATCH/stall600.json --resume --no_checkpoint && compare preempt"
then note "resume: $(grep 'largest relative difference' "$LOG" | tail -1)"; fi
[[ " ${ONLY:-resume} " == *" resume "* ]] && rm -rf "$SCRATCH/preempt"  # its checkpoint, done with
lanes=""
for lane in A B; do
  for stall in 600 0; do
    run_stage "heartbeat_${stall}_$lane" 300 "$LOG" bash -c "train heartbeat_${stall}_$lane $SCRATCH/stall$stall.json \
      --no_checkpoint" || continue 2
  done
  lanes+=" lane $lane $(tokens_per_s "heartbeat_600_$lane") / $(tokens_per_s "heartbeat_0_$lane");"
done
[ -n "$lanes" ] && note "heartbeat: tokens/s with stall_timeout_s 600 / 0:$lanes"
finish
