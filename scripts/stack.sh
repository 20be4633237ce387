#!/usr/bin/env bash
# Build (once) the virtual environment of one named stack under .stacks/NAME and print its path.
# Usage: bash scripts/stack.sh aligned|drifting|t447|t445|t424
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
name=${1:?usage: scripts/stack.sh aligned|drifting|t447|t445|t424}
# Older stacks need numpy<2 and setuptools<81 (pkg_resources); see shared notes in README "Supported stacks".
old="numpy<2 setuptools<81"
case "$name" in
  aligned)  pins="transformers==5.24.0 accelerate==1.16.0 deepspeed==0.19.8" ;;
  drifting) pins="transformers==5.24.0 accelerate==1.7.0 deepspeed==0.19.8 matplotlib" ;;  # matplotlib: the notebook
  t447)     pins="transformers==4.47.1 accelerate==1.2.1 deepspeed==0.16.2 $old" ;;
  t445)     pins="transformers==4.45.2 accelerate==0.34.2 deepspeed==0.15.4 $old" ;;
  t424)     pins="transformers==4.24.0 accelerate==0.15.0 deepspeed==0.14.5 $old" ;;
  *) echo "unknown stack '$name': choose aligned, drifting, t447, t445 or t424" >&2; exit 2 ;;
esac
venv="$root/.stacks/$name"
stamp="$venv/.stepsync-$(echo "$pins" | tr -c "A-Za-z0-9.\n" "_")"
if [ ! -f "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip 'setuptools<81' wheel >&2
  # torch first, pinned: a CPU build; letting pip resolve it pulls a multi-GB CUDA build.
  "$venv/bin/pip" install -q torch==2.13.0 >&2
  "$venv/bin/pip" install -q --no-build-isolation $pins rich 'pytest>=7' 'hypothesis>=6' nbclient ipykernel >&2
  "$venv/bin/pip" install -q --no-build-isolation --no-deps -e "$root" >&2
  touch "$stamp"
fi
echo "$venv"
