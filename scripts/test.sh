#!/usr/bin/env bash
# The test command: build the five stacks from scratch (once, in .stacks/), run the full suite on the two
# newest and the focused integration set (support table + forecast rules) on the three older ones.
# Usage: bash scripts/test.sh [pytest args]   STEPSYNC_STACKS="drifting aligned" limits the stacks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
status=0
# The drifting stack's numerical test compares with the aligned stack: build that first.
aligned=$(bash scripts/stack.sh aligned)
export STEPSYNC_ALIGNED_PYTHON="$aligned/bin/python" STEPSYNC_ALIGNED_EXTENSIONS="$aligned/torch_extensions"
summary=""
for stack in ${STEPSYNC_STACKS:-drifting aligned t447 t445 t424}; do
  start=$(date +%s)
  venv=$(bash scripts/stack.sh "$stack")
  case "$stack" in
    drifting|aligned) tests=(tests) ;;
    *) tests=(tests/test_support.py tests/test_forecast.py) ;;
  esac
  # Each DeepSpeed build compiles its CPU op once; never share the cache between stacks.
  export TORCH_EXTENSIONS_DIR="$venv/torch_extensions" STEPSYNC_STACK="$stack" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  echo "=== stack $stack: $("$venv/bin/python" -c 'import importlib.metadata as m; print(*(p + " " + m.version(p) for p in ("transformers","accelerate","deepspeed")), sep=", ")')"
  result=passed
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" "$@" || { status=1; result=FAILED; }
  line="=== stack $stack: $result in $(( $(date +%s) - start )) s (build included)"
  echo "$line"
  summary+="$line"$'\n'
done
printf '%s' "$summary"
exit $status
