#!/usr/bin/env bash
# docs/tensorboard.png: what TensorBoard shows of the Trainer run in tests/integration/test_trackers.py (its
# stepsync scalars above, its stepsync texts below), taken from TensorBoard's own pages by a headless Chromium.
# Needs the drifting stack (bash scripts/stack.sh drifting) and Chromium (Debian: apt-get install chromium).
# Usage: bash scripts/tensorboard_picture.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=.stacks/drifting/bin/python
work=$(mktemp -d)
trap 'kill "$board" 2>/dev/null || true; rm -rf "$work"' EXIT
STEPSYNC_STACK=drifting DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 "$python" -m pytest -q -p no:cacheprovider \
    --basetemp "$work/run" tests/integration/test_trackers.py -k trainer
logdir=$(dirname "$(find "$work/run" -name 'events.out.tfevents.*' | head -n 1)")
port=6123
.stacks/drifting/bin/tensorboard --logdir "$(dirname "$logdir")" --port "$port" > "$work/board.log" 2>&1 &
board=$!
for _ in $(seq 60); do curl -sf "http://localhost:$port" > /dev/null && break; sleep 1; done
shoot() {  # a page of TensorBoard's, once its charts are drawn
    chromium --headless --no-sandbox --enable-unsafe-swiftshader --hide-scrollbars --window-size=1400,"$2" \
        --virtual-time-budget=25000 --screenshot="$work/$1.png" "http://localhost:$port/?darkMode=false#$3" 2>/dev/null
}
shoot scalars 720 "scalars&tagFilter=stepsync%2F(drift%7Cupdates_skipped%7Cengine_steps%7Ctrainer_steps)&_smoothingWeight=0"
shoot text 660 "text&tagFilter=stepsync"
"$python" - "$work" docs/tensorboard.png <<'PY'
import sys
from PIL import Image

work, out = sys.argv[1:]
parts = [Image.open(f"{work}/{name}.png").convert("RGB") for name in ("scalars", "text")]
picture = Image.new("RGB", (max(p.width for p in parts), sum(p.height for p in parts)), "white")
top = 0
for part in parts:
    picture.paste(part, (0, top))
    top += part.height
picture.save(out, optimize=True)
print(f"{out}: {picture.width}x{picture.height}")
PY
