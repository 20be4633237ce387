#!/usr/bin/env bash
# Build (once) the virtual environment of one named stack under .stacks/NAME and print its path.
# The pins live in tests/harness/matrix.py (STACKS); scripts/envs.py installs them (uv, or pip as the fallback).
# Usage: bash scripts/stack.sh NAME     (bash scripts/stack.sh --list names them all)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
exec python3 "$root/scripts/envs.py" stack "${1:?usage: scripts/stack.sh NAME (or --list)}"
