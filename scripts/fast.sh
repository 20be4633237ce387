#!/usr/bin/env bash
# The fast loop: the unit tests in a small environment without torch (rich, packaging, pytest, hypothesis; built
# once in .stacks/fast), about 20 s. Tests that need torch or an installed stepsync are skipped by their marker.
# Usage: bash scripts/fast.sh [pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command -v uv >/dev/null || python3 -m pip install -q uv || echo "uv could not be installed: building with pip" >&2
venv=$(python3 scripts/envs.py tools .stacks/fast "rich>=12" "packaging>=20" "pytest>=8" "hypothesis>=6")
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not integration" "$@"
