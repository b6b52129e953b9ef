#!/usr/bin/env bash
# The 128K quality study's start model from one stay to the next (scripts/quality_128k.sh). The
# machine starts bare each stay and the model (117 MiB in bf16) is more than one device call brings
# back (16 MiB a file, 64 MiB a call) or carries (64 MiB with the working tree), so it travels as
# the pack the study writes when its start stage is trained: $STUDY/start_pack, 8 parts of at most
# 15 MiB and manifest.json (ds_mtraining.bench.model_pack; checksums of each part and the whole).
#
# Back, at the end of a stay that trained the dense stages (at once after its last quality_128k.sh
# call, whose $OUT holds study.tar.gz, while the machine is warm):
#   run(command="bash scripts/quality_model.sh send 1 2", timeout_s=60)
#   run(command="bash scripts/quality_model.sh send 2 2", timeout_s=60)
# then here: both calls' files and that study.tar.gz into .quality_state/ (git-ignored).
# Forth, on the next stay's machine, after FA4's two calls (scripts/fa4_check.sh part1, then part2
# with SKIP_TESTS=1 SKIP_BENCH=1), three parts a call (45 MiB beside the tree), each call at once
# after the one before (a warm machine keeps /tmp 30 s):
#   run(command="bash scripts/quality_model.sh receive", carry=[".quality_state/model.tar.part-00",
#       ".quality_state/model.tar.part-01", ".quality_state/model.tar.part-02"], timeout_s=60)
#   ... parts 03-05 the same way, then
#   run(command="bash scripts/quality_model.sh receive && bash scripts/quality_128k.sh", carry=[
#       ".quality_state/model.tar.part-06", ".quality_state/model.tar.part-07",
#       ".quality_state/manifest.json", ".quality_state/study.tar.gz"], timeout_s=600)
# The study continues from the archive and unpacks the start model when the arms first need it; a
# part that did not arrive stops it with a line naming the part (it never trains the model again
# silently). .whl need not travel again after part2: the later calls reuse its install.
#
# Env: STUDY (/tmp/quality_128k), OUT (./quality_model_out).
set -uo pipefail
cd "$(dirname "$0")/.."
STUDY=${STUDY:-/tmp/quality_128k}
OUT=${OUT:-$PWD/quality_model_out}
PACK=$STUDY/start_pack

case ${1:-} in
  send)
    share=${2:-} shares=${3:-}
    [[ "$share" =~ ^[0-9]+$ && "$shares" =~ ^[0-9]+$ && $share -ge 1 && $share -le $shares ]] \
      || { echo "usage: bash scripts/quality_model.sh send K N (the K-th of N shares, 1 <= K <= N)"; exit 2; }
    [ -f "$PACK/manifest.json" ] \
      || { echo "no pack in $PACK: this machine has not trained the study's start stage (a fresh one?)"; exit 1; }
    mapfile -t files < <(cd "$PACK" && ls model.tar.part-* manifest.json)
    per=$(( (${#files[@]} + shares - 1) / shares ))
    mkdir -p "$OUT"
    for file in "${files[@]:$(( (share - 1) * per )):$per}"; do
      cp "$PACK/$file" "$OUT/" && echo "sent $file ($(du -h "$PACK/$file" | cut -f1))"
    done ;;
  receive)
    shopt -s nullglob
    files=(.quality_state/model.tar.part-*)
    [ -f .quality_state/manifest.json ] && files+=(.quality_state/manifest.json)
    [ ${#files[@]} -gt 0 ] \
      || { echo "no part of the pack in .quality_state/: carry some (this script's header)"; exit 1; }
    mkdir -p "$PACK"
    for file in "${files[@]}"; do
      cp "$file" "$PACK/" && echo "received $(basename "$file")"
    done
    echo "the pack in $PACK has $(ls "$PACK" | wc -l) files" ;;
  *)
    echo "usage: bash scripts/quality_model.sh send K N | receive (see the header)"; exit 2 ;;
esac
