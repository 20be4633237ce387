#!/usr/bin/env bash
# The test command: lint and type-check the package, run the unit tests without torch, build every stack of the matrix (tests/harness/matrix.py; once, in .stacks/, with uv),
# run the full suite on the two newest (drifting, aligned) and the focused set on the others, printing each
# stack's build and test time.
# Usage: bash scripts/test.sh [pytest args]   STEPSYNC_STACKS="drifting aligned" limits the stacks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command -v uv >/dev/null || python3 -m pip install -q uv || echo "uv could not be installed: building with pip" >&2
status=0
start=$(date +%s)
bash scripts/lint.sh || status=1
echo "=== lint and type check (ruff, mypy): $(( $(date +%s) - start )) s"
start=$(date +%s)
bash scripts/fast.sh || status=1
echo "=== the fast loop, without torch (scripts/fast.sh): $(( $(date +%s) - start )) s"
# The drifting stack's numerical test compares with the aligned stack: build that first.
start=$(date +%s)
# A stack list or a reference stack that cannot be had fails the run: never a green run that tested nothing.
aligned=$(bash scripts/stack.sh aligned) || { echo "=== the aligned stack could not be built" >&2; exit 1; }
export STEPSYNC_ALIGNED_PYTHON="$aligned/bin/python"
echo "=== built the aligned stack first (the numerics reference) in $(( $(date +%s) - start )) s"
stacks=${STEPSYNC_STACKS:-$(bash scripts/stack.sh --list)} || exit 1
[ -n "$stacks" ] || { echo "=== no stack to test" >&2; exit 1; }
summary=""
for stack in $stacks; do
  start=$(date +%s)
  if ! venv=$(bash scripts/stack.sh "$stack"); then  # one stack that cannot be built fails the run, not the others
    status=1
    summary+="=== stack $stack: FAILED to build in $(( $(date +%s) - start )) s"$'\n'
    continue
  fi
  built=$(date +%s)
  read -r -a tests <<< "$(python3 scripts/envs.py tests "$stack")"  # tests/harness/matrix.py: TESTS
  # Each stack compiles DeepSpeed's ops once, into ~/.cache/stepsync/deepspeed-VERSION-ENV
  # (stepsync.tools.tiny_run.cpu_distributed_env): a build serves the environment that made it.
  export STEPSYNC_STACK="$stack" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  unset TORCH_EXTENSIONS_DIR
  echo "=== stack $stack: $(python3 scripts/envs.py pins "$stack")"
  result=passed
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" "$@" || { status=1; result=FAILED; }
  line="=== stack $stack: $result; build $(( built - start )) s, tests $(( $(date +%s) - built )) s"
  echo "$line"
  summary+="$line"$'\n'
done
printf '%s' "$summary"
exit $status
