#!/usr/bin/env bash
# A short end-to-end MTraining run: a tiny Qwen2-shaped model (2 layers, hidden 64, 4 query / 2
# key-value heads, RoPE theta 1e6) trained on the Python standard library's own sources (byte
# tokens, 1024-token sequences), 2 ranks under the deepspeed launcher sharing each sequence in a
# sparse striped ring (top-p 0.9), ZeRO-2 with CPU optimizer offload. Nothing is downloaded.
# The ranks run on two GPUs where at least two are usable, else on the CPU (the first line says
# which: ds_mtraining/training/placement.py). Prints progress (loss, tokens/s, index density, ring
# imbalance), then where the checkpoint and the metrics went and what to run next.
#
#   bash scripts/train_demo.sh [extra ds_mtraining.train options, e.g. --resume --steps 60]
#
# Environment: STEPS (30), SAVE_DIR (runs/demo), PORT (a free one).
# A second run into the same SAVE_DIR needs --resume (continue) or --overwrite (start over): without
# either it stops with one line before launching anything.
# First run on a machine: the CPU op and DeepSpeed's shm comm op compile once (each says so).
# Stop: Ctrl-C, or `kill -- -PGID` (the process group of this script); every rank exits within
# seconds with one line naming the last checkpoint (continue with `--resume`).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # 2 ranks share the cores
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
save_dir="${SAVE_DIR:-runs/demo}"
settings="$(python -m ds_mtraining.training.placement "$save_dir" "$@")" || exit $?  # (or its one refusal line)
eval "$settings"
echo "$DEMO_LINE"
echo "demo: expect index density 0.9-1.0: an untrained model on 1024-token sequences attends almost uniformly," \
     "so top-p keeps nearly every entry (a model trained at 32K keeps about 13%: docs/RESULTS.md)"
if [ "$DEMO_ACCELERATOR" = cpu ]; then export DS_ACCELERATOR=cpu; fi

launcher=(deepspeed)  # the launcher's command; its module where pip installed no script (--target)
command -v deepspeed >/dev/null || launcher=(python -m deepspeed.launcher.runner)

# After a rank's error the launcher prints its own line (the whole command, "exits with return
# code = N"), which would follow the rank's one line: left out of stderr here, and said in one line
# only where no rank said why. (stderr goes through the filter, stdout stays the terminal, so the
# progress bar stays live)
said="$(mktemp)"
trap 'rm -f "$said"' EXIT
set +e
{ "${launcher[@]}" --quiet --num_gpus 2 --master_port "${PORT:-$DEMO_PORT}" \
    --module ds_mtraining.train --deepspeed_config "$DEMO_CONFIG" \
    --steps "${STEPS:-30}" --save_dir "$save_dir" --save_interval 10 "$@" \
    2>&1 1>&3 3>&- | grep --line-buffered -v 'sigkill_handler.*exits with return code' | tee "$said" >&2; } 3>&1
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ] && ! grep -q '^ds_mtraining' "$said"; then
  echo "demo: a rank exited with code $status and the launcher stopped the others (the output above says why)" >&2
fi
exit "$status"
