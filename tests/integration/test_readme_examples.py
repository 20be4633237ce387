"""README.md's "Three examples", each run as written: its code block, its `...` filled with what a user has (the tiny
GPT-2, a dataset, a DeepSpeed config), saved as train.py and started with the README's own CPU launch line
(`DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 train.py`). The report each prints must be stepsync's, with the
counts this stack makes."""
import os
import re
import subprocess
import sys

import pytest

from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What a user's script has before the README's lines: a model, its data, a DeepSpeed config; the shared-memory op
# skipped as the README's Install section says one can.
TRAINER_PREAMBLE = """\
import sys
from transformers import Trainer, TrainingArguments
from stepsync.tools.tiny_run import TinyDataset, deepspeed_config, skip_shared_memory_op, tiny_model
skip_shared_memory_op()
ds_config = deepspeed_config(0)
"""
TRAINER_FILLED = {"model=...": "model=tiny_model()",
                  "TrainingArguments(..., ": "TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=1, "
                                             "num_train_epochs=2, learning_rate=1e-2, report_to=[], save_strategy='no', ",
                  "train_dataset=...": "train_dataset=TinyDataset(3)"}
LOOP_PREAMBLE = """\
import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from stepsync.tools.tiny_run import TinyDataset, skip_shared_memory_op, tiny_model
skip_shared_memory_op()
num_epochs = 2
accelerator = Accelerator(gradient_accumulation_steps=2, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 0},
    "zero_allow_untested_optimizer": True}))
model = tiny_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
train_dataloader = torch.utils.data.DataLoader(TinyDataset(3), batch_size=1)
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)
"""


def readme():
    return open(os.path.join(ROOT, "README.md")).read()


def examples():
    """The Python blocks of "Three examples", in order."""
    text = readme()
    section = text[text.index("## Three examples"):]
    section = section[:section.index("\n## ", 4)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def launch_line():
    """The README's CPU launch line, split into its variable and its command."""
    found = re.search(r"`(DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 train\.py)`", readme())
    assert found, "the README's Install section names the CPU launch line"
    variable, *command = found.group(1).split()
    return dict([variable.split("=")]), command


def launch(tmp_path, script: str):
    """train.py started with the README's launch line (torchrun from this environment), as a user starts it."""
    (tmp_path / "train.py").write_text(script)
    variables, command = launch_line()
    assert command[0] == "torchrun"
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.update(variables, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return subprocess.run([torchrun, *command[1:], str(tmp_path / "out")], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)


def filled(block: str, replacements: dict) -> str:
    for ellipsis, value in replacements.items():
        assert ellipsis in block, ellipsis
        block = block.replace(ellipsis, value)
    assert "..." not in block  # every blank of the README's example is filled above
    return block


def test_the_readme_has_three_examples_and_a_cpu_launch_line():
    blocks = examples()
    assert len(blocks) == 3 and "StepSyncCallback()" in blocks[0] and "stepsync.watch(accelerator" in blocks[1]
    assert "stepsync.lightning" in blocks[2]
    assert launch_line() == ({"DS_ACCELERATOR": "cpu"}, ["torchrun", "--nproc_per_node", "1", "train.py"])


def test_the_trainer_example_runs_as_written(tmp_path):
    from harness.stack import DRIFTS

    done = launch(tmp_path, TRAINER_PREAMBLE + filled(examples()[0], TRAINER_FILLED))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "stepsync report (policy 'warn')" in done.stdout
    # 3 samples, G=2, 2 epochs: the Trainer counts 4 updates; the engine makes 3 where they drift
    assert f"Trainer 4 updates, engine {3 if DRIFTS else 4} (drift {'+1' if DRIFTS else '+0'})" in done.stdout


def test_the_accelerate_loop_example_runs_as_written(tmp_path):
    done = launch(tmp_path, LOOP_PREAMBLE + examples()[1])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "stepsync report (policy 'sync')" in done.stdout
    # sync makes the engine update where the loop counts: 2 updates per epoch on every accelerate release
    assert "your loop 4 updates, engine 4 (drift +0)" in done.stdout, done.stdout[-2000:]
