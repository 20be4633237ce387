#!/usr/bin/env bash
# Build (once) the virtual environment of one named stack under .stacks/NAME and print its path.
# Usage: bash scripts/stack.sh aligned|drifting
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
name=${1:?usage: scripts/stack.sh aligned|drifting}
case "$name" in
  aligned)  pins="transformers==5.24.0 accelerate==1.16.0 deepspeed==0.19.8" ;;
  drifting) pins="transformers==5.24.0 accelerate==1.7.0 deepspeed==0.19.8" ;;
  *) echo "unknown stack '$name': choose aligned or drifting" >&2; exit 2 ;;
esac
venv="$root/.stacks/$name"
stamp="$venv/.stepsync-$(echo "$pins" | tr ' =' '_-')"
if [ ! -f "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip setuptools wheel >&2
  # torch first, pinned: a CPU build; letting pip resolve it pulls a multi-GB CUDA build.
  "$venv/bin/pip" install -q torch==2.13.0 >&2
  "$venv/bin/pip" install -q --no-build-isolation $pins rich 'pytest>=7' 'hypothesis>=6' nbclient ipykernel >&2
  "$venv/bin/pip" install -q --no-build-isolation --no-deps -e "$root" >&2
  touch "$stamp"
fi
echo "$venv"
