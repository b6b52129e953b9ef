#!/usr/bin/env bash
# One device call of the 128K quality study (issue 52: python -m ds_mtraining.bench.quality long) on
# one GPU: dense stages at 4K and 32K, then dense (FlashAttention-4), MTraining and static continued to
# 128K from the 32K export on one token stream, evaluated at 32K/64K/128K (held-out loss by position, the
# RULER-style tasks, each MTraining layer's density), compared. Each call runs the stages not done
# yet until BUDGET_S, stopping in time with what it did saved (training: the step in flight
# checkpointed; evaluation: its trials), so the same command, called again, continues:
#
#   here, once:  the wheels in .whl/, and for FA4 `bash scripts/fa4_stage.sh` (.fa4_part1/, .fa4_part2/);
#                the corpus is built on the machine (below: a carried one would not fit beside FA4's part 2)
#   device:      run(command="bash scripts/fa4_check.sh part1", carry=[".fa4_part1"], timeout_s=120)
#                run(command="SKIP_TESTS=1 SKIP_BENCH=1 bash scripts/fa4_check.sh part2 && BUDGET_S=540 bash
#                    scripts/quality_128k.sh", carry=[".whl", ".fa4_part2"], timeout_s=600)
#                run(command="bash scripts/quality_128k.sh", carry=[".whl"], timeout_s=600)
#                ... the last again, at once each time (a warm machine keeps /tmp 30 s), until it prints
#                the goals: quality_128k_<device>_<date>.json, its PNGs and study.tar.gz in $OUT.
#
# The study lives in STUDY on the machine; every 30 s and at the end study.tar.gz in $OUT holds all
# of it but the models, checkpoints and the start model's pack (0.1-1 GB each: more than a call
# brings back). $OUT gets six files (the log, the JSON, three PNGs, the archive) and a call brings
# back eight: a wrapper that adds more (fa4_check.sh's FA4_COMMAND adds three) loses one, maybe the
# archive. On a fresh machine (a later stay), put that archive in .quality_state/ and carry it
# (".quality_state/study.tar.gz"): the study continues from it, the evaluations keep their trials
# (each row names the model it ran on), and a model it needs is trained again (same settings, seed
# and data), except the start model where the pack came along: a stay that cannot reach the arms'
# end stops after the budget (STAGES=pretrain,extend,probe,budget) and brings the start model back
# with scripts/quality_model.sh, and the next stay carries it in and trains the arms from it.
#
# Env: BUDGET_S (560: seconds of this call), STAGES (all, or e.g. "pretrain,extend,probe,budget"),
#      STUDY (/tmp/quality_128k), DATA (data/quality: built from the standard library and torch's source when missing),
#      TAG (128k), DEVICE (cuda:0; cpu: a dry run of the script with a toy study in STUDY_ARGS),
#      STUDY_ARGS (more options of `bench.quality long`, fixed by the study's first call:
#      --steps, --max_trials, ...)
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
OUT=${OUT:-$PWD/quality_128k_out}
STUDY=${STUDY:-/tmp/quality_128k}
DATA=${DATA:-data/quality}
mkdir -p "$OUT"
source scripts/device_env.sh
if [ -d /tmp/fa4site/flash_attn/cute ]; then  # installed by scripts/fa4_check.sh part2 on this machine
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_cache
  export TVM_FFI_CACHE_DIR=/tmp/tvm_ffi_cache
else
  echo "quality_128k: FA4 is not on this machine: the dense arm would train with torch SDPA (its first lines say"
  echo "so); run scripts/fa4_check.sh part1 and part2 first (this script's header) for the FA4 arm"
fi
if [ ! -f "$STUDY/study.json" ] && [ -f .quality_state/study.tar.gz ]; then
  mkdir -p "$(dirname "$STUDY")" && tar xzf .quality_state/study.tar.gz -C "$(dirname "$STUDY")" \
    && echo "quality_128k: continuing the study of .quality_state/study.tar.gz in $STUDY"
fi
if [ ! -f "$DATA/train.parquet" ]; then
  # the standard library alone (9M characters on the GPU machine): the 4K stage would read it almost 3 times
  torch_source=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))") || exit 1
  echo "quality_128k: no corpus in $DATA: building one from the standard library and $torch_source"
  python3 -m ds_mtraining.eval.corpus --stdlib --code "$torch_source" --out "$DATA" || exit 1
fi
DEVICE=${DEVICE:-cuda:0}
[ "$DEVICE" = cpu ] || python3 -c "
import time; t = time.time()
from ds_mtraining import ops
ops.op_module('cuda')
print(f'CUDA op built and loaded in {time.time() - t:.1f} s')" || exit 1

sync_out() {  # one archive: the study but its models, checkpoints and the start model's pack
  [ -d "$STUDY" ] || return 0
  tar czf "$OUT/study.tar.gz.part" --exclude hf --exclude 'step[0-9]*' --exclude latest --exclude start_pack \
    -C "$(dirname "$STUDY")" "$(basename "$STUDY")" 2>/dev/null && mv "$OUT/study.tar.gz.part" "$OUT/study.tar.gz"
}
( while sleep 30; do sync_out; done ) &
syncer=$!

left=$(( ${BUDGET_S:-560} - (SECONDS - start) ))
QUALITY_128K_COMMAND="bash scripts/quality_128k.sh" python3 -m ds_mtraining.bench.quality long --out "$STUDY" \
  --data "$DATA" --device "$DEVICE" --stages "${STAGES:-all}" --time_budget "$left" --tag "${TAG:-128k}" \
  --results "$OUT" ${STUDY_ARGS:-} 2>&1 | tee -a "$OUT/quality_128k.log"
code=${PIPESTATUS[0]}
kill "$syncer" 2>/dev/null
sync_out
echo "quality_128k: exit $code after $((SECONDS - start)) s"
exit "$code"
