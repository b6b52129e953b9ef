#!/usr/bin/env bash
# Here (no GPU): prepares the two carry folders of scripts/fa4_check.sh from the FlashAttention-4
# wheels for the GPU machine (Python 3.12, x86-64), downloading any that $WHEELS lacks:
#   .fa4_part1/  the small wheels and the first 45 MiB of nvidia-cutlass-dsl-libs-cu13 (92 MB)
#   .fa4_part2/  the rest of it and SHA256SUMS of every whole wheel
# Each part stays under 55 MiB: a device call carries at most 64 MiB with the working tree
# (about 6 MiB), and the second call also carries .whl (deepspeed and the rest, about 13 MiB).
# Both folders are git-ignored (.gitignore). Then the two device calls in scripts/fa4_check.sh.
#
#   bash scripts/fa4_stage.sh                   # wheels from /work/fa4_wheels (WHEELS=DIR: elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-/work/fa4_wheels}
# flash-attn-4 and what it needs beyond the GPU machine's image (which has torch 2.11 cu130, einops,
# cuda-bindings, protobuf, typing-extensions); the versions require each other (their metadata)
REQUIREMENTS=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
              nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
              apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)
BIG=nvidia_cutlass_dsl_libs_cu13-4.8.1-*.whl
LIMIT_MIB=55

mkdir -p "$WHEELS"
for requirement in "${REQUIREMENTS[@]}"; do
  name=${requirement%%==*} version=${requirement#*==}
  if ! ls "$WHEELS/${name//-/_}-$version-"*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform any -d "$WHEELS" "$requirement"
  fi
done
big=$(ls "$WHEELS"/$BIG)
rm -rf .fa4_part1 .fa4_part2
mkdir .fa4_part1 .fa4_part2
for requirement in "${REQUIREMENTS[@]}"; do
  name=${requirement%%==*} version=${requirement#*==}
  wheel=$(ls "$WHEELS/${name//-/_}-$version-"*.whl)
  [ "$wheel" = "$big" ] || cp "$wheel" .fa4_part1/
done
split -b 45M -d "$big" ".fa4_part1/$(basename "$big").part-"
mv ".fa4_part1/$(basename "$big").part-01" .fa4_part2/
{ (cd .fa4_part1 && sha256sum *.whl); (cd "$WHEELS" && sha256sum "$(basename "$big")"); } >.fa4_part2/SHA256SUMS
mib() { echo $(( ($(cat | tail -1 | cut -f1) + 1048575) / 1048576 )); }  # MiB, rounded up
tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb | mib)
[ -d .whl ] || echo "note: .whl/ (deepspeed and the rest, scripts/device_env.sh) is missing here; call 2 carries it"
for part in .fa4_part1 .fa4_part2; do
  size=$(du -sb "$part" | mib)
  carried=$(du -cb "$part" $([ "$part" = .fa4_part2 ] && [ -d .whl ] && echo .whl) | mib)
  echo "$part: $size MiB ($(ls "$part" | wc -l) files); its call carries $((carried + tree)) MiB with the tree"
  [ "$size" -le "$LIMIT_MIB" ] || { echo "$part is over $LIMIT_MIB MiB"; exit 1; }
done
