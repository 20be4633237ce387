"""README.md's "Three examples" and the docs' own examples, each run as written: its code block, its `...` filled with
what a user has (the tiny GPT-2, a dataset, a DeepSpeed config), saved as train.py and started with the README's own
CPU launch line (`DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 train.py`); the docs' command lines run on a user's
config. The report each prints must be stepsync's, with the counts this stack makes. Lightning's example runs on
the Lightning stacks (tests/integration/test_lightning.py), with the one device check the README names lifted;
docs/resume.md's Ray Train example is followed by tests/entry/ray_runs.py."""
import re
import subprocess
import sys

import pytest

from harness.readme import doc_blocks, examples, filled, launch, launch_line
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]

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


def test_the_docs_trainer_and_lightning_examples_are_the_readmes():
    """docs/trainer.md and docs/lightning.md show the README's examples, which the tests above run."""
    assert doc_blocks("trainer.md") == [examples()[0]] and doc_blocks("lightning.md") == [examples()[2]]


def test_the_accelerate_pages_example_runs_as_written(tmp_path):
    block, = doc_blocks("accelerate.md")
    preamble = LOOP_PREAMBLE.replace("model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, "
                                     "optimizer, train_dataloader, lr_scheduler)\n", "")
    assert "accelerator.prepare(" in block  # the page prepares the objects itself
    done = launch(tmp_path, preamble + block)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "your loop 4 updates, engine 4 (drift +0)" in done.stdout, done.stdout[-2000:]


def test_the_deepspeed_pages_example_and_command_run_as_written(tmp_path):
    """docs/deepspeed.md: a loop that drives the engine itself (7 micro-batches, G=3: a DeepSpeed-Chat loop, which
    steps after every micro-batch), and its `stepsync check` line for the same shape."""
    block, = doc_blocks("deepspeed.md")
    preamble = TRAINER_PREAMBLE + """import deepspeed, torch
model = tiny_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3, "zero_optimization": {"stage": 0},
          "zero_allow_untested_optimizer": True}
"""
    done = launch(tmp_path, preamble + filled(block, {"config=config, ...": "config=config, training_data=TinyDataset(7)"}))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # sync: 7 micro-batches per epoch in windows of 3, 3 and 1, on both counts
    assert "stepsync report (policy 'sync'): your loop 6 updates, engine 6 (drift +0)" in done.stdout, \
        done.stdout[-2000:]
    command, = doc_blocks("deepspeed.md", "bash")
    checked = subprocess.run([sys.executable, "-m", *command.split()], capture_output=True, text=True, timeout=120)
    assert checked.returncode in (0, 1) and "epoch" in checked.stdout, checked.stderr


def test_the_updates_pages_verify_line_runs_on_a_users_config(tmp_path):
    command, = doc_blocks("updates.md", "bash")
    words = re.sub(r"\s+#.*$", "", command.strip()).split()
    assert words[:2] == ["stepsync", "verify"]
    (tmp_path / "ds_config.json").write_text('{"zero_optimization": {"stage": 1}}')
    done = subprocess.run([sys.executable, "-m", *words], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode in (0, 1) and done.stdout.startswith("DeepSpeed "), done.stderr[-2000:]
