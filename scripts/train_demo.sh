#!/usr/bin/env bash
# A short end-to-end MTraining run on this machine's CPU: a tiny Qwen2-shaped model (2 layers,
# hidden 64, 4 query / 2 key-value heads, RoPE theta 1e6) trained on the Python standard
# library's own sources (byte tokens, 1024-token sequences), 2 ranks under the deepspeed launcher
# (gloo), sparse striped ring attention (top-p 0.9), ZeRO-2 with CPU optimizer offload.
# Prints progress (loss, tokens/s, index density, ring imbalance) and where the checkpoint and
# the metrics went. Nothing is downloaded.
#
#   bash scripts/train_demo.sh [extra ds_mtraining.train options, e.g. --steps 50 --resume]
#
# Environment: STEPS (30), SAVE_DIR (runs/demo), PORT (29561).
# First run: the CPU op's JIT build (~35 s) and DeepSpeed's shm comm op (~90 s) are compiled once.
# Stop: Ctrl-C, or `kill -- -PGID` (the process group of this script); every rank exits within
# seconds with one line naming the last checkpoint (continue with `--resume`).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # 2 ranks share the cores
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec deepspeed --num_gpus 2 --master_port "${PORT:-29561}" \
    --module ds_mtraining.train --deepspeed_config ds_configs/cpu_demo.json \
    --steps "${STEPS:-30}" --save_dir "${SAVE_DIR:-runs/demo}" --save_interval 10 "$@"
