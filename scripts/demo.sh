#!/usr/bin/env bash
# The demo: build the drifting stack (transformers 5.24 + accelerate 1.7) once, then show the drift and the fix.
# bash scripts/demo.sh --framework lightning: the same on PyTorch Lightning (its own stack).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)
if command -v uv >/dev/null; then
  echo "stepsync demo: 1/3 uv, the fast installer, is here"
elif [ -n "${STEPSYNC_NO_UV:-}" ]; then
  echo "stepsync demo: 1/3 STEPSYNC_NO_UV is set: your python3 is left as it is, and pip builds the stack (slower)"
else
  echo "stepsync demo: 1/3 installing uv, the fast installer, into $(python3 -c 'import sys; print(sys.prefix)') with pip (remove it later with: python3 -m pip uninstall uv; STEPSYNC_NO_UV=1 leaves your python3 as it is, and pip builds the stack, slower)"
  python3 -m pip install -q uv || echo "stepsync demo: no uv; pip will build the stack (slower)"
fi
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
if [ "${1:-}" = "--framework" ] && [ "${2:-}" = "lightning" ]; then
  echo "stepsync demo: 2/3 building the Lightning stack in .stacks/lightning (torch CPU, lightning 2.6.6, deepspeed 0.19.8; about 30 s the first time, seconds after)"
  venv=$(bash "$root/scripts/stack.sh" lightning)
  echo "stepsync demo: 3/3 training (ready after $(( $(date +%s) - start )) s); the CLI is now $venv/bin/stepsync"
  exec "$venv/bin/python" -m stepsync demo "$@"
fi
echo "stepsync demo: 2/3 building the drifting stack in .stacks/drifting (torch CPU, transformers 5.24, accelerate 1.7, deepspeed 0.19.8; about 30 s and 1.3 GB the first time, seconds after)"
venv=$(bash "$root/scripts/stack.sh" drifting)
echo "stepsync demo: 3/3 training (ready after $(( $(date +%s) - start )) s); the CLI is now $venv/bin/stepsync"
exec "$venv/bin/python" -m stepsync demo --compare "$@"
