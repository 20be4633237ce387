#!/usr/bin/env bash
# The demo: build the drifting stack (transformers 5.24 + accelerate 1.7) once, then show the drift and the fix.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/stack.sh" drifting)
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1  # the compiled op goes to ~/.cache/stepsync/deepspeed-VERSION
exec "$venv/bin/python" -m stepsync demo --compare "$@"
