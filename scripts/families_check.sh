#!/usr/bin/env bash
# Bring your own model, on GPUs, in one run: build the ops, then each stage under `timeout`:
#   tests      tests/test_cuda_families.py: windows through the CUDA kernels against float64,
#              float32 inputs in bfloat16 with one warning, families in bf16 against SDPA; and
#              tests/test_cuda_attention.py's head_dim 256 cases and kernel paths (mma.sync at 256)
#   head_dims  python -m ds_mtraining.bench.kernel --head-dims 64 96 128 256 at 128K, 5%: each
#              against FlexAttention at the same head_dim (kernel_head_dims.json)
#   families   python -m ds_mtraining.bench.families at $SEQ_LEN: the family matrix in bf16,
#              loss and forward+backward time against the same model with SDPA
#   examples   the examples' documented commands, unchanged but for the GPU count
#              (deepspeed --num_gpus $GPUS ...): each twin of examples/, logs in examples.log
# $OUT (default ./families_out) gets families_check.log, examples.log, the benchmark's JSON and
# summary.txt (printed last).
#
#   GPU run (offline wheels in .whl/):  bash scripts/families_check.sh
#   SEQ_LEN (32768); GPUS (1: the examples' GPU count); ONLY="families examples": only these stages
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/families_out}
mkdir -p "$OUT"
LOG=$OUT/families_check.log
source scripts/device_env.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
[ "$gpus" -ge 1 ] || { echo "families_check: no CUDA device visible" | tee "$OUT/summary.txt"; exit 1; }
export LAUNCHER="python3 -m deepspeed.launcher.runner"  # no deepspeed script where the wheel went to --target

run_stage() {  # run_stage NAME LIMIT_S LOG COMMAND...: `stage` (device_env.sh) unless ONLY leaves it out
  stage_wanted "$1" || return 0
  stage "$@"
}
examples() {  # every documented command; the first failure's code, after running them all
  local code=0 port=29650 status
  for command in "deepspeed_loop.py --deepspeed_config examples/ds_config.json" \
                 "deepspeed_loop_mtraining.py --deepspeed_config examples/ds_config.json" \
                 "trainer.py --deepspeed_config examples/ds_config_trainer.json --bf16" \
                 "trainer_mtraining.py --deepspeed_config examples/ds_config_trainer.json --bf16" \
                 "trainer_mtraining.py --deepspeed_config examples/ds_config_trainer.json"; do  # float32: one warning
    port=$((port + 1))
    echo "=== deepspeed --num_gpus ${GPUS:-1} examples/$command"
    # shellcheck disable=SC2086  # the launcher's and the command's words
    $LAUNCHER --num_gpus "${GPUS:-1}" --master_port $port examples/$command
    status=$?
    echo "=== exit $status"
    [ $code -eq 0 ] && code=$status
  done
  return $code
}
export -f examples  # `stage` runs its command under timeout: a new bash

run_stage build 300 "$LOG" python3 -c "from ds_mtraining import ops; ops.op_module('cuda'); ops.op_module('cpu')"
run_stage tests 300 "$LOG" python3 -m pytest -q -ra tests/test_cuda_families.py tests/test_cuda_attention.py \
  -k "test_cuda_families or 256 or tensor_core"
run_stage head_dims 300 "$LOG" python3 -m ds_mtraining.bench.kernel --seq-lens 131072 --densities 0.05 --skip-dense \
  --repeats 5 --head-dims 64 96 128 256 --out "$OUT/kernel_head_dims.json"
run_stage families 300 "$LOG" python3 -m ds_mtraining.bench.families --seq_len "${SEQ_LEN:-32768}" --repeats 3 \
  --out "$OUT"
run_stage examples 400 "$OUT/examples.log" bash -c examples
[ -f "$OUT/examples.log" ] && python3 -m ds_mtraining.bench.families --examples_log "$OUT/examples.log" --out "$OUT" \
  --tag "$(python3 -c "from ds_mtraining.bench.e2e import device_name, device_tag; print(device_tag(device_name(False), False, 1))")" \
  --device "$(python3 -c "from ds_mtraining.bench.e2e import device_name; print(device_name(False))")" >>"$LOG" 2>&1
{ echo "=== families_check ($(date -u +%FT%TZ), $gpus GPU(s)) ==="; printf '%s\n' "${summary[@]}"; } \
  | tee "$OUT/summary.txt"
