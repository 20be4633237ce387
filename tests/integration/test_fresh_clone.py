"""The README's first commands from a fresh clone, as a newcomer runs them with a ``python3`` that has only pip (no
``packaging``, no ``rich``): the demo builds its stack and shows the drift and the fix; a script of the user's beside
the clone imports the installed stepsync. (The test command is what CI itself runs, from such a ``python3`` too.)"""
import os
import subprocess
import sys

import pytest

from harness.paths import REPO
from harness.runs import child_env
from harness.stack import STACK, needs_stack

pytestmark = [needs_stack, pytest.mark.skipif(STACK not in ("", "drifting"), reason="the demo's own stack")]


def test_the_demo_runs_from_a_fresh_clone_and_a_script_beside_it_imports_stepsync(tmp_path):
    clone = tmp_path / "stepsync-src"  # the README's clone line
    subprocess.run(["git", "clone", "-q", REPO, str(clone)], check=True, timeout=120)
    env = {k: v for k, v in child_env().items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "STEPSYNC_STACK")}
    bare = tmp_path / "python3"  # a new machine's interpreter: the standard library and pip, nothing else
    subprocess.run([sys.executable, "-m", "venv", str(bare)], check=True, timeout=300)
    listed = subprocess.run([str(bare / "bin" / "python"), "-c", "import importlib.util as u; print([m for m in "
                             "('packaging', 'rich', 'torch') if u.find_spec(m)])"], capture_output=True, text=True)
    assert listed.stdout.strip() == "[]", listed.stdout
    env["PATH"] = os.pathsep.join([str(bare / "bin"), *(p for p in env.get("PATH", "").split(os.pathsep)
                                                         if ".stacks" not in p)])
    demo = subprocess.run(["bash", "scripts/demo.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    flat = " ".join(demo.stdout.split())
    assert "stepsync demo: 3/3 training" in flat and "drift +1" in flat and "drift +0" in flat
    script = tmp_path / "train.py"
    script.write_text("import stepsync\nprint(stepsync.StepSyncCallback.__name__)\n")
    python = clone / ".stacks" / "drifting" / "bin" / "python"
    proc = subprocess.run([str(python), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "StepSyncCallback", proc.stderr[-2000:]
