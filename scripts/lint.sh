#!/usr/bin/env bash
# Lint and type-check the package (ruff, mypy; settings in ruff.toml and setup.cfg), with pinned tools in their
# own environment, .stacks/lint, built once.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=$(python3 scripts/envs.py tools .stacks/lint ruff==0.17.6 mypy==2.4.1 "rich>=12" "packaging>=20")
"$venv/bin/ruff" check stepsync benchmarks
"$venv/bin/mypy"
