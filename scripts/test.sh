#!/usr/bin/env bash
# The test command: build the aligned and drifting stacks from scratch (once) and run the suite on each.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
status=0
# The drifting stack's numerical test compares with the aligned stack: build both first.
aligned=$(bash scripts/stack.sh aligned)
export STEPSYNC_ALIGNED_PYTHON="$aligned/bin/python" STEPSYNC_ALIGNED_EXTENSIONS="$aligned/torch_extensions"
for stack in drifting aligned; do
  start=$(date +%s)
  venv=$(bash scripts/stack.sh "$stack")
  # Each DeepSpeed build compiles its CPU op once; never share the cache between stacks.
  export TORCH_EXTENSIONS_DIR="$venv/torch_extensions" STEPSYNC_STACK="$stack" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  echo "=== stack $stack: $("$venv/bin/python" -c 'import importlib.metadata as m; print(*(p + " " + m.version(p) for p in ("transformers","accelerate","deepspeed")), sep=", ")')"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@" || status=1
  echo "=== stack $stack took $(( $(date +%s) - start )) s"
done
exit $status
