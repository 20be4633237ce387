#!/usr/bin/env bash
# Regenerate docs/releases.md's support table from real runs on every stack (builds missing stacks first).
# Usage: bash scripts/support_table.sh [STACK ...]   (default: every stack of tests/harness/matrix.py)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for stack in ${@:-$(bash scripts/stack.sh --list)}; do
  venv=$(bash scripts/stack.sh "$stack")
  start=$(date +%s)
  # The compiled op goes to ~/.cache/stepsync/deepspeed-VERSION (stepsync.tools.tiny_run.cpu_distributed_env).
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 \
    "$venv/bin/python" scripts/support_table.py measure "$stack" > "$venv/support.log" 2>&1 \
    || { tail -40 "$venv/support.log" >&2; exit 1; }
  echo "measured $stack in $(( $(date +%s) - start )) s"
done
"$(bash scripts/stack.sh aligned)/bin/python" scripts/support_table.py render
echo "docs/releases.md support table rewritten from tests/support/*.json"
