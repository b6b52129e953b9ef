#!/usr/bin/env bash
# FlashAttention-4 on the GPU machine (issue 40), in two device calls, because its wheels
# (97 MiB, nvidia-cutlass-dsl-libs-cu13 alone 88 MiB) are more than one call carries (64 MiB with
# the working tree). First, here: `bash scripts/fa4_stage.sh` (fills .fa4_part1/ and .fa4_part2/).
#
#   call 1:  run(command="bash scripts/fa4_check.sh part1", carry=[".fa4_part1"], timeout_s=120)
#   call 2, at once (the machine keeps /tmp only 30 s after a call):
#            run(command="bash scripts/fa4_check.sh part2", carry=[".whl", ".fa4_part2"], timeout_s=600)
#
# part1 copies its wheels and the first piece of the big one to /tmp/fa4 and stops. part2 adds the
# rest, joins the big wheel, checks every wheel against SHA256SUMS, installs them with
# `pip install --no-index --no-deps --target /tmp/fa4site`, then runs (stages, each under its own
# timeout, logs in $OUT):
#   env    versions, the GPU, `dense_backend` fa4 resolved here;
#   tests  tests/test_cuda_fa4.py (FA4 output and gradients against float64, also its varlen path;
#          the dense and Ulysses paths with fa4 against sdpa; the profile's kinds);
#   bench  bench.kernel's dense causal fwd+bwd, H 16 / KV 2, D 128, bf16, 32K-512K, FA4 and
#          SDPA-flash in one run -> $OUT/fa4_dense_h200.json (BENCH_ARGS replaces the default
#          arguments after --out, e.g. to add MTraining's rows: "--seq-lens 131072 262144 524288
#          --densities 0.05 --dense-backend sdpa fa4 --skip-flex").
# A later call on the still-warm machine reuses the install (and FA4's compiled kernels, cached in
# /tmp/fa4_cache): run(command="SKIP_TESTS=1 bash scripts/fa4_check.sh run", carry=[".whl"]).
# SKIP_TESTS=1 / SKIP_BENCH=1 skip a stage. FA4_COMMAND="..." runs one more command last, with FA4
# on the path (stage `command`, FA4_COMMAND_TIMEOUT seconds, default 500, log $OUT/command.log), e.g.
# the end-to-end pair against both dense kernels:
#   FA4_COMMAND="python3 -m ds_mtraining.bench.e2e ... --dense_backends sdpa fa4 --out \$OUT"
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/fa4 SITE=/tmp/fa4site
OUT=${OUT:-$PWD/fa4_check_out}
mkdir -p "$OUT" "$STAGE"

case ${1:-} in
  part1)
    cp .fa4_part1/* "$STAGE"/ || exit 1
    ls -l "$STAGE"
    echo "part 1 is in $STAGE; start call 2 now: bash scripts/fa4_check.sh part2"
    exit 0 ;;
  part2)
    if ! ls "$STAGE"/*.part-00 >/dev/null 2>&1; then
      echo "part 1 is not in $STAGE: this machine is a fresh one (the last was given back after call 1);"
      echo "run call 1 again and call 2 right after it"
      exit 1
    fi
    cp .fa4_part2/* "$STAGE"/ || exit 1
    (cd "$STAGE" && for first in *.part-00; do
       wheel=${first%.part-00}; cat "$wheel".part-* >"$wheel" && rm "$wheel".part-*; done \
     && sha256sum --quiet -c SHA256SUMS) || { echo "the wheels do not match SHA256SUMS"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$STAGE"/*.whl || { echo "FA4 wheel install failed"; exit 1; } ;;
  run)
    [ -d "$SITE/flash_attn/cute" ] || { echo "FA4 is not in $SITE: run the two calls (part1, part2)"; exit 1; } ;;
  *)
    echo "usage: bash scripts/fa4_check.sh part1 | part2 | run (see the header)"; exit 2 ;;
esac

source scripts/device_env.sh
# --target installs skip .pth files: nvidia-cutlass-dsl's puts its dsl_packages/ (the `cutlass` module) on the path
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
# FA4 compiles each kernel on first use (CuTe DSL); the disk cache lets the bench reuse the tests'
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_cache
export TVM_FFI_CACHE_DIR=/tmp/tvm_ffi_cache

stage env 120 "$OUT/env.log" python3 -c "
import time; t = time.time()
import torch, flash_attn.cute, cutlass
from importlib.metadata import version
from ds_mtraining.dense_backend import resolve_dense_backend
print(torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability(), 'torch', torch.__version__)
print('flash-attn-4', version('flash-attn-4'), 'nvidia-cutlass-dsl', version('nvidia-cutlass-dsl'),
      'quack-kernels', version('quack-kernels'), 'apache-tvm-ffi', version('apache-tvm-ffi'))
print('torch has the DLPack exchange API:', hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))
print(resolve_dense_backend('fa4').describe(), '|', resolve_dense_backend('auto').describe())
print(f'imported in {time.time() - t:.1f} s')"
cat "$OUT/env.log"

if [ -z "${SKIP_TESTS:-}" ]; then
  per_test_limit=()  # a hung compile or kernel fails its test instead of the whole call
  python3 -c "import pytest_timeout" 2>/dev/null && per_test_limit=(--timeout 150 -o timeout_method=thread)
  stage tests 200 "$OUT/tests.log" python3 -m pytest tests/test_cuda_fa4.py -v \
    --tb=short -p no:cacheprovider "${per_test_limit[@]}"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/tests.log" | tail -40
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  # shellcheck disable=SC2086
  stage bench 320 "$OUT/bench.log" python3 -m ds_mtraining.bench.kernel --out "$OUT/fa4_dense_h200.json" \
    ${BENCH_ARGS:---seq-lens 32768 65536 131072 262144 524288 --dense-backend sdpa fa4 --skip-sparse}
  tail -20 "$OUT/bench.log"
fi

if [ -n "${FA4_COMMAND:-}" ]; then
  stage command "${FA4_COMMAND_TIMEOUT:-500}" "$OUT/command.log" bash -c "$FA4_COMMAND"
  tail -30 "$OUT/command.log"
fi

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  echo "=== fa4_check summary ($(date -u +%FT%TZ)) ==="; printf '%s\n' "${summary[@]}"; } | tee "$OUT/summary.txt"
