#!/usr/bin/env bash
# The dense / MTraining / static quality study (python -m ds_mtraining.bench.quality) in one
# run of at most BUDGET_S: a dense stage 1 at 4K (data parallel on every GPU, PRETRAIN_STEPS) trains the
# shared initialisation; then dense continues at 32K on GPU 0 while MTraining and then static
# continue on GPU 1 (on one GPU the three run in turn), the step count
# calibrated to fit BUDGET_S. Checkpoints and exported models stay on the machine (too large to bring back); $OUT
# gets quality_<TAG>.json, its PNGs, quality.log and study.tar.gz (the study directory's JSON,
# metrics and logs, refreshed every 20 s, so a run cut short still leaves what finished;
# `bench.quality compare` rebuilds the results from it).
#
#   data:        python -m ds_mtraining.eval.corpus ... --out data/quality   (see its --help)
#   GPU run:     bash scripts/quality_study.sh      (offline wheels in .whl/, data in data/quality)
#   Env: BUDGET_S (570: seconds for this script), CONFIG (ds_configs/quality_32k.json),
#        PRETRAIN_CONFIG (ds_configs/quality_pretrain_4k.json; empty: none), PRETRAIN_STEPS (800),
#        DATA (data/quality), TAG (32k), STEPS (fixed steps instead of calibrating),
#        STUDY_ARGS (more options of `bench.quality run`)
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
OUT=${OUT:-$PWD/quality_out}
STUDY=/tmp/quality_study
rm -rf "$STUDY"  # a warm machine keeps /tmp: an earlier call's study would mix into this one
mkdir -p "$OUT"
source scripts/device_env.sh

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
case "$gpus" in
  0) echo "quality_study: no CUDA device visible"; exit 1 ;;
  1) devices=cuda:0 ;;
  *) devices=cuda:0,cuda:1 ;;
esac
python3 -c "
import time; t = time.time()
from ds_mtraining import ops
ops.op_module('cuda')
print(f'CUDA op built and loaded in {time.time() - t:.1f} s')" || exit 1

sync_out() {  # one archive (the device returns 8 files): everything but checkpoints and models
  tar czf "$OUT/study.tar.gz.part" --exclude hf --exclude 'step[0-9]*' -C "$(dirname "$STUDY")" \
    "$(basename "$STUDY")" 2>/dev/null && mv "$OUT/study.tar.gz.part" "$OUT/study.tar.gz"
}
( while sleep 20; do sync_out; done ) &
syncer=$!

left=$(( ${BUDGET_S:-570} - (SECONDS - start) ))
length=(--time_budget "$left")
[ -n "${STEPS:-}" ] && length=(--steps "$STEPS")
pretrain=(--pretrain_config "${PRETRAIN_CONFIG-ds_configs/quality_pretrain_4k.json}" --pretrain_steps "${PRETRAIN_STEPS:-800}")
[ -z "${PRETRAIN_CONFIG-x}" ] && pretrain=()
python3 -m ds_mtraining.bench.quality run --config "${CONFIG:-ds_configs/quality_32k.json}" \
  --data "${DATA:-data/quality}" "${length[@]}" "${pretrain[@]}" --devices "$devices" --out "$STUDY" \
  --tag "${TAG:-32k}" --results "$OUT" ${STUDY_ARGS:-} 2>&1 | tee "$OUT/quality.log"
code=${PIPESTATUS[0]}
kill "$syncer" 2>/dev/null
sync_out
echo "quality_study: exit $code after $((SECONDS - start)) s"
exit "$code"
