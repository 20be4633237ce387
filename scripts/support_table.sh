#!/usr/bin/env bash
# Regenerate the README's support table from real runs on every stack (builds missing stacks first).
# Usage: bash scripts/support_table.sh [STACK ...]   (default: all five)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for stack in ${@:-aligned drifting t447 t445 t424}; do
  venv=$(bash scripts/stack.sh "$stack")
  start=$(date +%s)
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \
    "$venv/bin/python" scripts/support_table.py measure "$stack" > "$venv/support.log" 2>&1 \
    || { tail -40 "$venv/support.log" >&2; exit 1; }
  echo "measured $stack in $(( $(date +%s) - start )) s"
done
"$(bash scripts/stack.sh aligned)/bin/python" scripts/support_table.py render
echo "README.md support table rewritten from tests/support/*.json"
