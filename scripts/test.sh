#!/usr/bin/env bash
# The test command: lint and type-check the package, run the unit tests without torch, build every stack of the matrix (tests/harness/matrix.py; once, in .stacks/, with uv),
# run the full suite on the two newest (drifting, aligned) and the focused set on the others, printing each
# stack's build and test time. The stacks run in two lanes at once (each stack's runs use one core, mostly):
# STEPSYNC_LANES=1 runs them one after another.
# Usage: bash scripts/test.sh [pytest args]   STEPSYNC_STACKS="drifting aligned" limits the stacks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command -v uv >/dev/null || python3 -m pip install -q uv || echo "uv could not be installed: building with pip" >&2
status=0
begun=$(date +%s)
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

# One stack: build it, run its tests, and print one summary line (its own pytest output goes to the lane's log).
run_stack() {
  local stack=$1 venv start built result
  start=$(date +%s)
  if ! venv=$(bash scripts/stack.sh "$stack"); then  # one stack that cannot be built fails the run, not the others
    echo "=== stack $stack: FAILED to build in $(( $(date +%s) - start )) s" >&3
    return 1
  fi
  built=$(date +%s)
  read -r -a tests <<< "$(python3 scripts/envs.py tests "$stack")"  # tests/harness/matrix.py: TESTS
  echo "=== stack $stack: $(python3 scripts/envs.py pins "$stack")"
  result=passed
  # Each stack compiles DeepSpeed's ops once, into ~/.cache/stepsync/deepspeed-VERSION-ENV
  # (stepsync.tools.tiny_run.cpu_distributed_env): a build serves the environment that made it. Each stack's temporary
  # folders are its own, so two stacks at once never clean up each other's.
  env -u TORCH_EXTENSIONS_DIR STEPSYNC_STACK="$stack" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$root/.stacks/tmp/$stack" "${tests[@]}" \
    "${pytest_args[@]}" || result=FAILED
  local line="=== stack $stack: $result; build $(( built - start )) s, tests $(( $(date +%s) - built )) s"
  echo "$line"
  echo "$line" >&3
  [ "$result" = passed ]
}

pytest_args=("$@")
mkdir -p .stacks/tmp .stacks/lanes
rm -f .stacks/lanes/*
read -r -a names <<< "$(echo $stacks)"
lane=0
pids=()
while read -r members; do
  [ -n "$members" ] || continue
  lane=$((lane + 1))
  (
    lane_status=0
    for stack in $members; do
      run_stack "$stack" || lane_status=1
    done
    exit $lane_status
  ) > ".stacks/lanes/$lane.log" 2>&1 3> ".stacks/lanes/$lane.summary" &
  pids+=("$!")
done < <(python3 scripts/envs.py lanes "${STEPSYNC_LANES:-2}" "${names[@]}")
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
for log in .stacks/lanes/*.log; do
  cat "$log"
done
cat .stacks/lanes/*.summary
echo "=== all of it: $(( $(date +%s) - begun )) s"
exit $status
