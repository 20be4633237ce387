"""What DeepSpeed compiles before a run on a CPU, measured: its shared-memory collective is said before it is built,
built once for the environment that made it, and built again (over it) by another environment that shares its
TORCH_EXTENSIONS_DIR; the README's Install section says exactly that. The other environment is the aligned stack
(scripts/test.sh builds it first and names its python in STEPSYNC_ALIGNED_PYTHON), with the same DeepSpeed."""
import logging
import os
import subprocess
import sys

import pytest

from harness.paths import REPO
from harness.runs import child_env
from harness.stack import STACK, needs_stack

ALIGNED = os.environ.get("STEPSYNC_ALIGNED_PYTHON", "")
pytestmark = [needs_stack, pytest.mark.skipif(STACK not in ("", "drifting"), reason="measured once, on drifting")]

# In a child process of a stack: what stepsync says it will build, then (BUILD=1) DeepSpeed's own build of the op.
SAY_THEN_BUILD = """
import os
from stepsync.engine.deepspeed import op_builds_of
print("SAID:", op_builds_of(None, True))
if os.environ.get("BUILD"):
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    ShareMemCommBuilder().load()
"""


def say_then_build(python, extensions, build):
    env = child_env(dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions), DS_ACCELERATOR="cpu",
                         PYTHONPATH=REPO, **({"BUILD": "1"} if build else {})))
    done = subprocess.run([python, "-c", SAY_THEN_BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    said = next(line for line in done.stdout.splitlines() if line.startswith("SAID:"))
    return "deepspeed_shm_comm" in said


def built_at(extensions):
    """The compiled op's modification time (None: not built)."""
    found = [os.path.join(folder, name) for folder, _, names in os.walk(extensions) for name in names
             if name == "deepspeed_shm_comm.so"]
    return os.stat(found[0]).st_mtime_ns if found else None


@pytest.mark.skipif(not os.path.exists(ALIGNED), reason="needs the aligned stack (scripts/test.sh builds it first)")
def test_the_shared_memory_build_is_said_then_serves_the_environment_that_made_it(tmp_path):
    extensions = tmp_path / "extensions"
    assert say_then_build(sys.executable, extensions, build=True)  # said, then built
    first = built_at(extensions)
    assert first is not None
    assert not say_then_build(sys.executable, extensions, build=True)  # built here: nothing said, nothing built
    assert built_at(extensions) == first
    assert say_then_build(ALIGNED, extensions, build=True)  # another environment: said, and built again over it
    assert built_at(extensions) != first
    assert say_then_build(sys.executable, extensions, build=False)  # so the first environment builds again


def test_the_callback_says_the_shared_memory_build_at_the_trainers_init(tmp_path, caplog):
    """DeepSpeed on a CPU, its collective buildable and not built here: said at the Trainer's init, before train()
    starts DeepSpeed; the Trainer is not trained."""
    import deepspeed.ops
    from transformers import Trainer

    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import TinyDataset, cpu_distributed_env, tiny_model, training_args

    cpu_distributed_env()  # which switches the collective off for the tests' runs: on again, for this one
    ops = deepspeed.ops.__compatible_ops__
    before, extensions = ops["deepspeed_shm_comm"], os.environ.get("TORCH_EXTENSIONS_DIR")
    ops["deepspeed_shm_comm"] = True
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "none-built")
    try:
        with caplog.at_level(logging.WARNING, logger="stepsync"):
            Trainer(model=tiny_model(), args=training_args(str(tmp_path), 2), train_dataset=TinyDataset(3),
                    callbacks=[StepSyncCallback(console=False)])
    finally:
        ops["deepspeed_shm_comm"] = before
        os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    said = [r.getMessage() for r in caplog.records if "will compile" in r.getMessage()]
    assert len(said) == 1 and "its shared-memory collective for CPUs (deepspeed_shm_comm)" in said[0]
    assert '__compatible_ops__["deepspeed_shm_comm"] = False' in said[0]
