# Sourced by the device scripts (gpu_check.sh, fa4_check.sh, multi_gpu_check.sh, documents_check.sh,
# quality_study.sh), from the repository root: the Python environment of a bare GPU machine.
# - installs the wheels carried in .whl/ (deepspeed, datasets, ...) into /tmp/site when deepspeed
#   is missing (or uses /tmp/site where an earlier call on this warm machine filled it), and puts
#   the checkout on PYTHONPATH;
# - links op_builder/ as ds_mtraining_op_builder (the name setup.py installs it under);
# - NVLink multicast off (also for launchers that build their own env);
# - one extension cache and 16 build jobs;
# - `stage`, which gpu_check.sh and fa4_check.sh run their stages with (the others define their own).
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext} MAX_JOBS=${MAX_JOBS:-16}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import deepspeed" >/dev/null 2>&1 && has_deepspeed=1 || has_deepspeed=
if [ -z "$has_deepspeed" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
elif [ -z "$has_deepspeed" ] && [ -d /tmp/site/deepspeed ]; then
  export PYTHONPATH=/tmp/site:$PWD  # installed by an earlier call on this warm machine: .whl need not travel again
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import ds_mtraining_op_builder" >/dev/null 2>&1; then
  mkdir -p /tmp/ds_mtraining_site && ln -sfn "$PWD/op_builder" /tmp/ds_mtraining_site/ds_mtraining_op_builder
  export PYTHONPATH=/tmp/ds_mtraining_site:$PYTHONPATH
fi
summary=()
stage_wanted() {  # stage_wanted NAME: whether ONLY (stage names; unset: every stage) runs NAME; the build always runs
  [ -z "${ONLY:-}" ] || [ "$1" = build ] || [[ " $ONLY " == *" $1 "* ]]
}
stage() {  # stage NAME TIMEOUT_S LOG COMMAND...: runs (appending to LOG), records status and seconds
  local name=$1 limit=$2 log=$3; shift 3
  local start=$SECONDS
  echo "=== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local code=$?
  summary+=("$(printf '%-10s %-8s %4ss  %s' "$name" "$([ $code -eq 0 ] && echo ok || echo FAIL:$code)" $((SECONDS - start)) "$(basename "$log")")")
  return $code
}
