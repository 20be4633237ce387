"""Write and execute notebooks/walkthrough.ipynb (run with the drifting stack: .stacks/drifting/bin/python)."""
import os
import tempfile

import nbformat as nbf
from nbclient import NotebookClient

md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
cells = [
md("""# stepsync walkthrough

With DeepSpeed and `gradient_accumulation_steps=G > 1`, the Trainer decides where an accumulation window ends,
and DeepSpeed decides it again with its own micro-step counter. That counter never restarts at an epoch.
When an epoch's micro-batch count N is not a multiple of G, the two disagree. The Trainer's `state.global_step`
(logging, saving, `max_steps`, checkpoint names) then drifts from `engine.global_steps` (the real updates and the
learning-rate schedule). The smallest case: G=2, N=3, 2 epochs, transformers 5.24 with accelerate 1.7. The Trainer
counts 4 updates, DeepSpeed makes 3.

This notebook runs on CPU: a tiny GPT-2 built from a config, the real Trainer, the real DeepSpeed engine.
The test suite runs it on the drifting stack (`bash scripts/test.sh`)."""),
md("## 1. The forecast, before any training"),
code("""from stepsync import RunPlan, Stack, behaviour_of, forecast

stack = Stack.installed()
predicted = forecast(RunPlan(micro_batches_per_epoch=3, gradient_accumulation_steps=2, num_train_epochs=2),
                     behaviour_of(stack))
print(stack)
print(predicted.verdict())
[(row.epoch, row.trainer_steps, row.engine_steps) for row in predicted.epochs]"""),
md("## 2. A real run that drifts (stepsync only watches: policy `warn`)"),
code("""import os, socket, tempfile

import deepspeed.ops
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

# One process on a CPU: DeepSpeed's rendezvous on a free port, gloo, and no build of its optional shared-memory op.
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                  WORLD_SIZE="1")
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
             "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 0},
             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
             "zero_allow_untested_optimizer": True}


class Sequences(torch.utils.data.Dataset):
    \"\"\"``samples`` fixed sequences of 8 tokens: data in memory.\"\"\"

    def __init__(self, samples):
        self.rows = torch.randint(0, 64, (samples, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def tiny_trainer(samples, gas, epochs, callbacks):
    \"\"\"A tiny GPT-2 built from a config (nothing downloaded), the real Trainer and DeepSpeed on CPU.\"\"\"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=1, gradient_accumulation_steps=gas,
                             num_train_epochs=epochs, learning_rate=1e-2, report_to=[], disable_tqdm=True,
                             logging_strategy="no", save_strategy="no", use_cpu=True, deepspeed=DS_CONFIG)
    return Trainer(model=model, args=args, train_dataset=Sequences(samples), callbacks=callbacks)"""),
code("""import logging
from transformers import TrainerCallback
from stepsync import StepSyncCallback


class Counters(TrainerCallback):
    \"\"\"Both counters after every micro-batch, read from the Trainer's state and its DeepSpeed engine.\"\"\"

    def __init__(self):
        self.trainer_steps, self.engine_steps, self.trainer = [], [], None

    def watch(self, trainer):
        self.trainer = trainer

    def _read(self, state):
        self.trainer_steps.append(state.global_step)
        self.engine_steps.append(self.trainer.model_wrapped.global_steps)

    def on_substep_end(self, args, state, control, **kwargs):
        self._read(state)

    def on_step_end(self, args, state, control, **kwargs):
        self._read(state)


def counted_run(policy):
    counters, sync = Counters(), StepSyncCallback(policy, console=False)
    trainer = tiny_trainer(samples=3, gas=2, epochs=2, callbacks=[counters, sync])
    counters.watch(trainer)
    trainer.train()
    return counters, sync.report


logging.getLogger("stepsync").setLevel(logging.ERROR)  # the report below says it all
watched, report = counted_run("warn")
print(f"Trainer {report.trainer_steps}, engine {report.engine_steps}, drift {report.drift:+d}")
for event in report.events:
    print(event.message())
assert [(r.trainer_steps, r.engine_steps) for r in report.epochs] == [(r.trainer_steps, r.engine_steps) for r in predicted.epochs]"""),
md("## 3. The same run with `policy=\"sync\"`: DeepSpeed updates where the Trainer counts"),
code("""synced, synced_report = counted_run("sync")
print(f"Trainer {synced.trainer_steps[-1]}, engine {synced.engine_steps[-1]}, drift {synced_report.drift:+d}")
assert synced.trainer_steps == synced.engine_steps and synced_report.drift == 0"""),
md("## 4. Both counters against micro-batches"),
code("""import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100, sharey=True)
for ax, (title, result) in zip(axes, [("without a remedy (policy 'warn')", watched), ("policy 'sync'", synced)]):
    steps = range(1, len(result.trainer_steps) + 1)
    ax.step(steps, result.trainer_steps, where="post", linewidth=2.5, label="Trainer global_step")
    ax.step(steps, result.engine_steps, where="post", linewidth=2.5, linestyle="--",
            label="engine global_steps")
    ax.set_title(title, fontsize=13)
    ax.set_xlabel("micro-batch", fontsize=12)
    ax.set_xticks(list(steps))
    ax.grid(alpha=0.3)
axes[0].set_ylabel("optimizer updates counted", fontsize=12)
axes[0].legend(fontsize=11, loc="upper left")
plt.tight_layout()
plt.show()"""),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": tempfile.mkdtemp()}}).execute()
for cell in nb.cells:  # keep stored outputs small: drop build noise on stderr
    cell.get("metadata", {}).pop("execution", None)
    if "outputs" in cell:
        cell["outputs"] = [o for o in cell["outputs"] if o.get("name") != "stderr"]
nbf.write(nb, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks", "walkthrough.ipynb"))
